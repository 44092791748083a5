"""A Mooncake Store client in a process of its own (the side venv's wheel), driven line by line
from a test: put, get, exist and remove, each answered with one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

from mmreuse.cluster.install import require_venv
from mmreuse.cluster.mooncake import MooncakeStore

# A client: mounts `segment` bytes, runs the commands read from stdin (one JSON list a line),
# answers each with one JSON line; "wait" just answers (the test reads its sockets meanwhile).
CLIENT = textwrap.dedent(
    """
    import json, os, sys
    from mooncake.store import MooncakeDistributedStore
    cfg = json.loads(sys.argv[1])
    s = MooncakeDistributedStore()
    ok = s.setup("127.0.0.1", cfg["metadata_server"], cfg["global_segment_size"],
                 cfg["local_buffer_size"], cfg["protocol"], "", cfg["master_server_address"])
    print(json.dumps({"setup": ok, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        op, *args = json.loads(line)
        if op == "put":
            out = [s.put(k, bytes([i % 251]) * n) for i, (k, n) in enumerate(args)]
        elif op == "get":
            out = [[len(b), b[:1].hex()] for b in (s.get(k) for k in args)]
        elif op == "exist":
            out = [s.is_exist(k) for k in args]
        elif op == "put_raw":
            out = [s.put(k, bytes.fromhex(v)) for k, v in args]
        elif op == "remove":
            out = [s.remove(k) for k in args]
        else:
            out = None
        print(json.dumps(out), flush=True)
    """
)


class Client:
    def __init__(self, store: MooncakeStore, segment: int, buffer: int = 16 << 20) -> None:
        """Join `store`, mounting `segment` bytes (0: none)."""
        py = require_venv()
        cfg = store.client_config(segment, buffer)
        self.proc = subprocess.Popen(
            [str(py), "-c", CLIENT, json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            env={**os.environ, **store.client_env()}, text=True, start_new_session=True,
        )  # fmt: skip
        hello = json.loads(self.proc.stdout.readline())
        assert hello["setup"] == 0, hello
        self.pid = hello["pid"]

    def ask(self, *cmd):
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, "the client died"
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)

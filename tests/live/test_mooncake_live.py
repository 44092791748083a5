"""The Mooncake Store under the harness (mmreuse.cluster.mooncake), on the side venv's wheel:
clients in two processes put and get across each other's segments over TCP, every endpoint
of the master and the clients binds loopback and every connection stays on it, and a store
smaller than what is put evicts. Skipped unless MMREUSE_LIVE=1."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time

import pytest

from mmreuse.cluster.install import require_venv
from mmreuse.cluster.mooncake import MooncakeStore, connections, is_loopback, listeners

pytestmark = pytest.mark.live

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
        else:
            out = None
        print(json.dumps(out), flush=True)
    """
)


class Client:
    def __init__(self, store: MooncakeStore, segment: int) -> None:
        py = require_venv()
        cfg = store.client_config(segment, 16 << 20)
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


@pytest.fixture
def store(tmp_path):
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    with MooncakeStore(tmp_path) as s:
        yield s


def test_two_clients_share_objects_on_loopback_only(store):
    a, b = Client(store, 64 << 20), Client(store, 16 << 20)
    try:
        assert a.ask("put", ["k0", 1 << 20], ["k1", 4096]) == [0, 0]
        assert b.ask("exist", "k0", "k1", "nope") == [1, 1, 0]
        assert b.ask("get", "k0", "k1") == [[1 << 20, "00"], [4096, "01"]]  # from a's segment
        pids = [store.process.pid, a.pid, b.pid]
        # the master's own pid may be a wrapper's: take its whole process group
        group = [int(p) for p in os.listdir("/proc") if p.isdigit() and _pgid(int(p)) == store.process.pid]  # fmt: skip
        opened = listeners(pids + group)
        assert opened and all(is_loopback(ip) for _, ip, _ in opened), opened
        assert len({pid for pid, _, _ in opened} & {a.pid, b.pid}) == 2  # each client listens
        peers = connections(pids + group)
        assert peers and all(is_loopback(ip) for _, ip, _ in peers), peers
    finally:
        a.close()
        b.close()


def test_a_store_smaller_than_what_is_put_evicts_the_oldest(store):
    c = Client(store, 16 << 20)  # the store's only segment: 16 MiB
    try:
        keys = [[f"obj{i}", 1 << 20] for i in range(48)]  # 48 MiB in all
        puts = [c.ask("put", k)[0] for k in keys]
        # The master evicts in the background, at its high watermark: until it has, a put into
        # the full store is refused (-200, NO_AVAILABLE_HANDLE), a miss later, never a crash
        # or a wrong object; then the oldest objects are gone and puts land again.
        assert set(puts) <= {0, -200} and puts[:16] == [0] * 16 and -200 in puts, puts
        deadline = time.monotonic() + 15
        while c.ask("put", ["late", 1 << 20]) != [0]:
            assert time.monotonic() < deadline, "the master never evicted"
            time.sleep(0.2)
        held = c.ask("exist", *[k for k, _ in keys], "late")
        print("puts", puts, "held", held)
        assert sum(1 for h in held if h == 1) <= 16, held  # never more than its capacity
        assert held[0] == 0 and held[-1] == 1, held  # the oldest went first; the late one landed
        assert all(h == 0 for h, p in zip(held[:-1], puts, strict=True) if p != 0), (puts, held)
    finally:
        c.close()


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None

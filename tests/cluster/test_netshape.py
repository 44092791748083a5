"""mmreuse.cluster.netshape: the store's link paced on a private loopback, and only there."""

import json
import shutil
import subprocess
import sys
import textwrap

import pytest

from mmreuse.cluster import netshape
from mmreuse.cluster.netshape import NetshapeError, StoreLink
from mmreuse.errors import InvalidArgument


@pytest.mark.parametrize(
    ("put", "get", "field"),
    [
        (0, 1, "put_mibps"),
        (1, -2, "get_mibps"),
        (float("nan"), 1, "put_mibps"),
        ("9", 1, "put_mibps"),
    ],
)
def test_a_link_refuses_a_rate_that_is_not_positive(put, get, field):
    with pytest.raises(InvalidArgument, match=field):
        StoreLink(put_mibps=put, get_mibps=get)


def test_pacing_refuses_the_machines_own_namespace(monkeypatch):
    monkeypatch.setattr(netshape, "in_private_netns", lambda: False)
    with pytest.raises(NetshapeError, match="namespace"):
        netshape.pace([1234], StoreLink(1, 1))


def test_pacing_needs_a_port():
    with pytest.raises(InvalidArgument, match="ports"):
        netshape.pace([], StoreLink(1, 1))
    with pytest.raises(InvalidArgument, match="port"):
        netshape.pace([70000], StoreLink(1, 1))


_IN_NAMESPACE = textwrap.dedent(
    r"""
    import json, re, socket, subprocess, threading
    from mmreuse.cluster import netshape
    assert netshape.in_private_netns()
    srv = socket.create_server(("127.0.0.1", 0))
    other = socket.create_server(("127.0.0.1", 0))
    port, other_port = srv.getsockname()[1], other.getsockname()[1]
    netshape.pace([port], netshape.StoreLink(put_mibps=40.0, get_mibps=80.0))

    def drain(sock, n):
        while n > 0:
            n -= len(sock.recv(1 << 20))

    def exchange(server, n_up, n_down):
        # a put: the client sends n_up to the server's port; a get: the server sends n_down back
        c = socket.create_connection(("127.0.0.1", server.getsockname()[1]))
        s, _ = server.accept()
        t = threading.Thread(target=lambda: (drain(s, n_up), s.sendall(b"d" * n_down)))
        t.start()
        c.sendall(b"u" * n_up)
        drain(c, n_down)
        t.join()
        s.close(); c.close()

    exchange(srv, 1 << 20, 2 << 20)      # the store's port: both directions paced
    exchange(other, 4 << 20, 4 << 20)    # any other: not
    out = subprocess.run(["tc", "-s", "class", "show", "dev", "lo"], capture_output=True,
                         text=True, check=True).stdout
    units = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9}
    classes = {
        m[1]: {"rate_bits": float(m[2]) * units[m[3]], "bytes": int(m[4])}
        for m in re.finditer(r"class htb (\S+) .*? rate ([\d.]+)([KMG]?)bit.*?\n Sent (\d+) bytes", out)
    }
    print(json.dumps(classes))
    """
)


def test_only_the_stores_ports_go_through_the_paced_classes(tmp_path):
    if not all(shutil.which(t) for t in ("unshare", "ip", "tc")):
        pytest.skip("needs unshare, ip and tc")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, check=False)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a network namespace here: {probe.stderr.decode().strip()}")
    script = tmp_path / "paced.py"
    script.write_text(
        "from mmreuse.cluster import netshape\n"
        "if not netshape.in_private_netns():\n"
        "    netshape.reexec_in_private_netns()  # this script again, in a namespace of its own\n"
        + _IN_NAMESPACE
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    classes = json.loads(done.stdout.strip().splitlines()[-1])
    put, get, rest = classes["1:3"], classes["1:4"], classes["1:2"]
    mib = 1 << 20
    assert put["rate_bits"] == pytest.approx(40 * mib * 8, rel=1e-3)  # tc rounds to 6 digits
    assert get["rate_bits"] == pytest.approx(80 * mib * 8, rel=1e-3)
    # payloads (plus headers and the other side's acks) went where their port says
    assert 1 * mib <= put["bytes"] < 1.2 * mib
    assert 2 * mib <= get["bytes"] < 2.4 * mib
    assert rest["bytes"] >= 8 * mib


def test_this_command_keeps_python_dash_m(monkeypatch):
    import sys
    import types

    from mmreuse.cluster import netshape

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="mmreuse.cli")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", ["/x/mmreuse/cli.py", "bench-cluster", "--pace-store"])
    assert netshape.this_command() == [sys.executable, "-m", "mmreuse.cli", "bench-cluster", "--pace-store"]  # fmt: skip
    main.__spec__ = None  # type: ignore[attr-defined]
    assert netshape.this_command() == [sys.executable, "/x/mmreuse/cli.py", "bench-cluster", "--pace-store"]  # fmt: skip

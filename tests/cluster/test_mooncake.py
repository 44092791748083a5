"""mmreuse.cluster.mooncake without a store: the master's command line (every endpoint on
loopback), the client config, and reading a process's sockets from /proc (checked on this
test process's own sockets). The store itself runs in tests/live/test_mooncake_live.py."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from mmreuse.cluster.mooncake import (
    MooncakeStore,
    StoreSpec,
    _address,
    connections,
    holder_argv,
    is_loopback,
    listeners,
    master_argv,
    store_layout,
)
from mmreuse.errors import InvalidArgument


def test_the_master_binds_and_serves_on_loopback_only():
    argv = master_argv(StoreSpec(5001, 5002, 5003, 5004, high_watermark=0.8), Path("/v"))
    assert argv[0] == "/v/bin/mooncake_master"
    assert "--rpc_address=127.0.0.1" in argv and "--metrics_host=127.0.0.1" in argv
    assert "--http_metadata_server_host=127.0.0.1" in argv
    assert "--eviction_high_watermark_ratio=0.8" in argv
    assert not any("0.0.0.0" in a for a in argv)


def test_a_clients_config_is_vllms_mooncake_store_config(tmp_path):
    store = MooncakeStore(tmp_path, spec=StoreSpec(5001, 5002, 5003, 5004))
    cfg = store.client_config(64 << 20)
    assert cfg["master_server_address"] == "127.0.0.1:5001"
    assert cfg["metadata_server"] == "http://127.0.0.1:5003/metadata"
    assert cfg["protocol"] == "tcp" and cfg["global_segment_size"] == 64 << 20
    assert store.client_config(0)["global_segment_size"] == 0  # joins without a segment
    with pytest.raises(InvalidArgument, match="segment_bytes"):
        store.client_config(1 << 20)  # below Mooncake's 16 MiB


def test_the_holder_serves_on_loopback_and_mounts_the_segment():
    argv = holder_argv(StoreSpec(5001, 5002, 5003, 5004), Path("/v"), 32 << 20)
    assert argv[0] == "/v/bin/mooncake_client"
    assert "--host=127.0.0.1" in argv and "--port=5004" in argv
    assert "--global_segment_size=32MB" in argv  # Mooncake's MB is 2**20 bytes
    assert "--master_server_address=127.0.0.1:5001" in argv


@pytest.mark.parametrize(
    ("capacity", "segment", "ballast"),
    [
        (1 << 20, 16 << 20, int((16 << 20) * 0.9) - (1 << 20)),  # a tiny store: mostly ballast
        (64 << 10, 16 << 20, int((16 << 20) * 0.9) - (64 << 10)),
        (
            256 << 20,
            285 << 20,
            int((285 << 20) * 0.9) - (256 << 20),
        ),  # a large one: a bigger segment
    ],
)
def test_the_layout_evicts_at_the_capacity(capacity, segment, ballast):
    assert store_layout(capacity, 0.9) == (segment, ballast)
    seg, bal = store_layout(capacity, 0.9)
    assert 0 <= int(seg * 0.9) - bal - capacity < 1  # the watermark is ballast + capacity
    assert seg % (1 << 20) == 0 and seg >= 16 << 20


def test_the_layout_refuses_a_store_too_small_to_hold_anything():
    with pytest.raises(InvalidArgument, match="capacity"):
        store_layout(1024, 0.9)


@pytest.mark.parametrize("field", ["rpc_port", "metrics_port", "metadata_port", "holder_port"])
def test_spec_ports_checked(field):
    ports = {"rpc_port": 1, "metrics_port": 2, "metadata_port": 3, "holder_port": 4, field: 0}
    with pytest.raises(InvalidArgument, match=field):
        StoreSpec(**ports)


def test_proc_addresses():
    assert _address("0100007F:1F90") == ("127.0.0.1", 8080)
    assert _address("00000000:0050") == ("0.0.0.0", 80)
    assert _address("0000000000000000FFFF00000100007F:0050") == ("::ffff:127.0.0.1", 80)
    assert is_loopback("127.0.0.1") and is_loopback("::ffff:127.0.0.1") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.2")


def test_listeners_and_connections_of_a_process():
    import os

    lo = socket.socket()
    lo.bind(("127.0.0.1", 0))
    lo.listen()
    wild = socket.socket()
    wild.bind(("0.0.0.0", 0))
    wild.listen()
    client = socket.create_connection(lo.getsockname())
    try:
        mine = listeners([os.getpid()])
        assert ("127.0.0.1", lo.getsockname()[1]) in [(ip, p) for _, ip, p in mine]
        assert ("0.0.0.0", wild.getsockname()[1]) in [(ip, p) for _, ip, p in mine]
        assert (os.getpid(), "127.0.0.1", lo.getsockname()[1]) in connections([os.getpid()])
    finally:
        client.close()
        lo.close()
        wild.close()


def test_the_loopback_shim_binds_wildcards_to_loopback(tmp_path):
    # Built as `mmreuse cluster install` builds it; a process under it that binds 0.0.0.0 and
    # :: (dual-stack) gets 127.0.0.1 and ::ffff:127.0.0.1, and an explicit address is kept.
    import subprocess
    import sys

    from mmreuse.cluster.install import _Runner, build_loopback_shim

    shim = build_loopback_shim(tmp_path, _Runner(tmp_path, lambda _m: None))
    code = (
        "import socket\n"
        "a = socket.socket(); a.bind(('0.0.0.0', 0))\n"
        "b = socket.socket(socket.AF_INET6); b.bind(('::', 0))\n"
        "c = socket.socket(); c.bind(('127.0.0.2', 0))\n"
        "print(a.getsockname()[0], b.getsockname()[0], c.getsockname()[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env={"LD_PRELOAD": str(shim)}, capture_output=True,
        text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert out == ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.2"]
    assert build_loopback_shim(tmp_path, _Runner(tmp_path, lambda _m: None)) == shim  # kept

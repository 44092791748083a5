"""The Mooncake Store under the harness (mmreuse.cluster.mooncake), on the side venv's wheel:
clients in two processes put and get across each other's segments over TCP, every endpoint
of the master and the clients binds loopback and every connection stays on it, and a store
smaller than what is put evicts. Skipped unless MMREUSE_LIVE=1."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from mmreuse.cluster.install import require_venv
from mmreuse.cluster.mooncake import MooncakeStore, connections, is_loopback, listeners
from tests.support.mooncake_client import Client

pytestmark = pytest.mark.live


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


VLLM_COMPAT = """
import struct, torch
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding import data, store_client
from mmreuse.embedding_store import HEADER, embedding_key, pack_embedding, unpack_embedding
assert embedding_key("ns@x", "id1") == data.make_embedding_key("ns@x", "id1")
for dt in ("float32", "float16", "bfloat16"):
    t = torch.randn(5, 7).to(getattr(torch, dt))
    ours = pack_embedding(dt, 5, 7, t.view(torch.uint8).numpy().tobytes())
    theirs = store_client._encode_mooncake_tensor_metadata(t)
    assert ours[: HEADER.size] == theirs, (dt, ours[:24], theirs)
    spec = data.TensorSpec((5, 7), str(t.dtype), t.numel() * t.element_size())
    store_client._validate_mooncake_tensor_metadata("k", ours[: HEADER.size], spec)
    back = unpack_embedding(theirs + t.view(torch.uint8).numpy().tobytes(), tokens=5)
    assert back.dtype == dt and (back.tokens, back.hidden) == (5, 7)
print("ok")
"""


def test_objects_and_keys_are_vllms():
    """vLLM's own store codec (in the side venv) reads mmreuse's objects and writes ones
    mmreuse reads: a deployment can move between the two."""
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    out = subprocess.run(
        [str(require_venv()), "-c", VLLM_COMPAT], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]

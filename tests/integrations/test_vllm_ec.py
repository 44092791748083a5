"""Encoder-cache events: the wire (mmreuse.events.ec_wire) and EventfulEncoderCacheManager,
whose events must describe vLLM's real encoder cache exactly (oracle venvs, 0.33.0 and 0.34.0:
tools/oracle/ec_events_check.py drives the real manager and checks after every flush, then a
replay from seq 0)."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse.events.ec_wire import (
    EncoderCacheCleared,
    EncoderCacheEventBatch,
    EncoderCacheEvicted,
    EncoderCacheFreeable,
    EncoderCacheReferenced,
    EncoderCacheStored,
    apply_ec_batch,
    decode_ec_batch,
    encode_ec_batch,
)
from mmreuse.events.wire import MalformedBatch
from tests.support.oracle import oracle_json
from tests.support.paths import REPO


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 3])
def test_events_equal_vllms_real_encoder_cache(oracle_python, seed):
    py = oracle_python
    c = oracle_json(py, str(REPO / "tools/oracle/ec_events_check.py"), str(seed), timeout=300)
    assert c["mismatch"] == 0 and c["replay_equal"] and c["seq_in_order"], c
    assert c["flushes"] > 200 and c["evictions"] > 50 and c["hits"] > 50, c
    # its snapshot (an ECSnapshot's content) and the batches from its stamp: the real cache
    assert c["snapshots"] >= 10 and c["snapshot_mismatch"] == 0, c
    assert c["snapshots_mid_step"] >= 3, c  # some inside a step: its events split in two batches
    assert c["snapshot_order_mismatch"] == 0, c  # freeable entries in vLLM's eviction order


_SETTINGS_CHECK = """
import json
from types import SimpleNamespace as N
from mmreuse.integrations.vllm_ec import EventfulEncoderCacheManager as M
out = [M.create_manager(cache_size=8, vllm_config=N(additional_config=a)).publisher is None
       for a in ({}, {"other": 1}, {"mmreuse": {}})]
for bad in ({"mmreuse": None}, {"mmreuse": ["x"]},
            {"mmreuse": {"encoder_cache_events_endpoint": 5}},
            {"mmreuse": {"encoder_cache_event_endpoint": "tcp://*:1"}},
            {"mmreuse": {"encoder_cache_snapshot_endpoint": "tcp://*:1"}}):
    try:
        M.create_manager(cache_size=8, vllm_config=N(additional_config=bad))
        out.append("accepted")
    except ValueError as e:
        out.append(str(e))
print(json.dumps(out))
"""


@pytest.mark.oracle
def test_settings_read_once_and_a_mistyped_one_refused(oracle_python):
    py = oracle_python
    got = oracle_json(py, "-c", _SETTINGS_CHECK, timeout=300)
    assert got[:3] == [True, True, True]  # nothing of ours: vLLM's manager, publishing nothing
    assert got[3].startswith("additional_config['mmreuse'] must be a dict")
    assert got[4].startswith("additional_config['mmreuse'] must be a dict")
    assert got[5].startswith(
        "additional_config['mmreuse']['encoder_cache_events_endpoint'] must be a str"
    )
    # a mistyped key stops vLLM, naming it; a snapshot endpoint needs the events it is stamped by
    assert got[6].startswith(
        "additional_config['mmreuse'] has no key 'encoder_cache_event_endpoint'"
    )
    assert got[7].startswith(
        "additional_config['mmreuse']['encoder_cache_snapshot_endpoint'] needs "
        "additional_config['mmreuse']['encoder_cache_events_endpoint']"
    )


_E_SNAPSHOT_CHECK = """
import json, socket
from types import SimpleNamespace as N
import zmq
from mmreuse.demand_query import ECSnapshot, ECSnapshotQuery, StatsQuery, decode_answer, encode
from mmreuse.integrations.vllm_ec import EventfulEncoderCacheManager as M

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

events, snap = port(), port()
ours = {"encoder_cache_events_endpoint": f"tcp://127.0.0.1:{events}",
        "encoder_cache_snapshot_endpoint": f"tcp://127.0.0.1:{snap}"}
m = M.create_manager(cache_size=8, vllm_config=N(additional_config={"mmreuse": ours}))
dealer = zmq.Context.instance().socket(zmq.DEALER)
dealer.setsockopt(zmq.LINGER, 0)
dealer.connect(f"tcp://127.0.0.1:{snap}")
out = []
for q in (ECSnapshotQuery("e0"), StatsQuery("s0")):
    dealer.send(encode(q))
    assert dealer.poll(10_000), "no answer"
    a = decode_answer(dealer.recv())
    out.append([type(a).__name__, a.stamp if isinstance(a, ECSnapshot) else a.error])
m._server.stop()
m.publisher.shutdown()
print(json.dumps(out))
"""


@pytest.mark.oracle
def test_e_serves_its_snapshot_without_a_scheduler_plugin(oracle_python):
    """With `encoder_cache_snapshot_endpoint`, the manager itself answers ECSnapshotQuery on its
    own ROUTER (E runs no DemandScheduler), and refuses any other query, naming it."""
    got = oracle_json(oracle_python, "-c", _E_SNAPSHOT_CHECK, timeout=300)
    assert got[0] == ["ECSnapshot", 0], got
    assert got[1][0] == "DemandError" and "ECSnapshotQuery only" in got[1][1], got


def test_round_trip_and_fold():
    batch = EncoderCacheEventBatch(
        1.5,
        [
            EncoderCacheStored("a", 16),
            EncoderCacheStored("b", 4),
            EncoderCacheFreeable(["a", "b"]),
            EncoderCacheReferenced(["a"]),
            EncoderCacheEvicted(["b"]),
        ],
        0,
    )
    again = decode_ec_batch(encode_ec_batch(batch))
    assert again == batch
    state: dict = {}
    apply_ec_batch(state, again)
    assert state == {"a": [16, False]}
    apply_ec_batch(state, EncoderCacheEventBatch(2.0, [EncoderCacheCleared()]))
    assert state == {}


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgspec.msgpack.encode([1.0, [{"type": "EncoderCacheStored", "identifier": "a"}], 0]),
        msgspec.msgpack.encode(
            [1.0, [{"type": "EncoderCacheStored", "identifier": "a", "num_embeds": 0}], 0]
        ),
        msgspec.msgpack.encode([1.0, [{"type": "Nope"}], 0]),
        msgspec.msgpack.encode([1.0, [{"type": "EncoderCacheEvicted", "identifiers": [3]}], 0]),
        msgspec.msgpack.encode({"ts": 1}),
        b"\x91" * 10_000,  # deep nesting
    ],
)
def test_malformed_payloads_raise_malformed_batch(payload):
    with pytest.raises(MalformedBatch):
        decode_ec_batch(payload)


@given(st.binary(max_size=300))
def test_any_bytes_decode_or_raise_malformed(data):
    with contextlib.suppress(MalformedBatch):  # anything else escaping fails the test
        decode_ec_batch(data)

"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout): drive
`EventfulEncoderCacheManager` (vLLM's real `EncoderCacheManager` underneath) through a random
scheduler-like sequence of hits, allocations with evictions, frees and resets, with real
`Request`s; receive its events over vLLM's own ZMQ publisher; after every flush, the state the
events describe must equal the manager's real one. Then a replay from seq 0 must rebuild it.
At random points the manager's snapshot (`EventfulEncoderCacheManager.snapshot`, what
it serves as an ECSnapshot) is taken, some inside a step (between an eviction and the
allocation it made room for): it plus every batch from its stamp on must equal the real state
at the end, with the freeable entries in vLLM's eviction order.
Prints one JSON line of counts."""

from __future__ import annotations

import json
import random
import socket
import sys
import time
from types import SimpleNamespace

import zmq
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.request import Request

from mmreuse.events.ec_wire import apply_ec_batch, decode_ec_batch
from mmreuse.integrations.vllm import EventfulEncoderCacheManager


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def real_state(m) -> dict:
    return {h: [n, h in m.freeable] for h, n in m.num_embeds_by_hash.items()}


def main(seed: int = 0, steps: int = 400) -> dict:
    rng = random.Random(seed)
    port, replay = free_port(), free_port()
    config = SimpleNamespace(
        additional_config={"mmreuse": {
            "encoder_cache_events_endpoint": f"tcp://*:{port}",
            "encoder_cache_events_replay_endpoint": f"tcp://*:{replay}",
        }},
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )  # fmt: skip
    m = EventfulEncoderCacheManager.create_manager(cache_size=64, vllm_config=config)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    time.sleep(0.5)  # the slow joiner
    sizes = {f"img-{i}": rng.choice([4, 9, 16]) for i in range(14)}
    state: dict = {}
    counts = {"flushes": 0, "events": 0, "mismatch": 0, "evictions": 0, "hits": 0, "seqs": []}
    live: list = []
    rid = 0
    boots: list = []  # (stamp, the state a snapshot bootstraps), then the batches from the stamp
    counts["snapshots"] = counts["snapshot_order_mismatch"] = 0

    def drain(expect_change: bool) -> None:
        deadline = time.monotonic() + (2.0 if expect_change else 0.05)
        while time.monotonic() < deadline:
            if sub.poll(20):
                _topic, seq, payload = sub.recv_multipart()
                batch = decode_ec_batch(payload)
                counts["seqs"].append(int.from_bytes(seq, "big"))
                counts["events"] += len(batch.events)
                apply_ec_batch(state, batch)
                for stamp, boot in boots:
                    if int.from_bytes(seq, "big") >= stamp:
                        apply_ec_batch(boot, batch)
                if state == real_state(m):
                    return
        if state != real_state(m):
            counts["mismatch"] += 1

    def snapshot(mid_step: bool = False) -> None:
        """What a late proxy bootstraps from. Mid-step: between `can_allocate`'s eviction and
        `allocate` (the manager's lock is not the scheduler's), so the step's events come in
        two batches."""
        stamp, entries = m.snapshot()
        boots.append((stamp, {h: [n, f] for h, n, f in entries}))
        counts["snapshots"] += 1
        counts["snapshots_mid_step"] += mid_step
        counts["snapshot_order_mismatch"] += [h for h, _, f in entries if f] != list(m.freeable)

    counts["snapshots_mid_step"] = 0
    for _ in range(steps):
        op = rng.random()
        if op < 0.4 or not live:  # a new request's items go through the scheduler's checks
            ids = rng.sample(sorted(sizes), rng.randrange(1, 4))
            feats, pos = [], 10
            for ident in ids:
                feats.append(MultiModalFeatureSpec(data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(pos, sizes[ident])))  # fmt: skip
                pos += sizes[ident] + 3
            rid += 1
            req = Request(request_id=f"r{rid}", prompt_token_ids=[1] * (pos + 5), sampling_params=SamplingParams(), pooling_params=None, mm_features=feats)  # fmt: skip
            scheduled = 0
            for i in range(len(feats)):
                if m.check_and_update_cache(req, i):
                    counts["hits"] += 1
                else:
                    n = len(m.freed)
                    if m.can_allocate(req, i, 10_000, scheduled):
                        if len(m.freed) > n and rng.random() < 0.3:  # inside the step: see below
                            snapshot(mid_step=True)
                        m.allocate(req, i)
                        scheduled += req.get_num_encoder_embeds(i)
                    counts["evictions"] += len(m.freed) - n
            live.append(req)
        elif op < 0.9:  # a request finishes
            m.free(live.pop(rng.randrange(len(live))))
        elif op < 0.98:  # one item consumed
            req = rng.choice(live)
            ids = sorted(m.get_cached_input_ids(req))
            if ids:
                m.free_encoder_input(req, rng.choice(ids))
        else:
            m.reset()
            live.clear()
        if rng.random() < 0.6:  # the next scheduler step
            m.get_freed_mm_hashes()
        if rng.random() < 0.1:  # a late proxy asks for the snapshot (what is pending, published)
            snapshot()
        if not m._pending:  # everything recorded is published: the events must tell it all
            counts["flushes"] += 1
            drain(state != real_state(m))

    # A late joiner rebuilds the same state from the replay buffer (seq 0 on).
    m.get_freed_mm_hashes()
    m.flush()
    drain(True)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    dealer.send_multipart([b"", (0).to_bytes(8, "big")])
    rebuilt: dict = {}
    while dealer.poll(2000):
        # (b"", topic, seq, payload) in vLLM 0.33 and 0.34
        *_, seq, payload = dealer.recv_multipart()
        if int.from_bytes(seq, "big", signed=True) == -1:
            break
        apply_ec_batch(rebuilt, decode_ec_batch(payload))
    counts["replay_equal"] = rebuilt == real_state(m) == state
    counts["snapshot_mismatch"] = sum(1 for _, boot in boots if boot != real_state(m))
    seqs = counts.pop("seqs")
    counts["batches"] = len(seqs)
    counts["seq_in_order"] = seqs == list(range(len(seqs)))
    m.publisher.shutdown()
    return counts


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]) if len(sys.argv) > 1 else 0)))

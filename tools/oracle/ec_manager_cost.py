"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout): what
EventfulEncoderCacheManager adds to vLLM's EncoderCacheManager per scheduler call, publisher
attached (vLLM's ZmqEventPublisher on loopback, no subscriber): the same scripted sequence of
hits, allocations with evictions, frees and per-step flushes through both; best of 7. Also the
plug-in with its lock replaced by a no-op (`mmreuse_unlocked`): what the RLock taken by every
method costs (uncontended: no snapshot is asked meanwhile)."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import time
from types import SimpleNamespace

from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.request import Request

from mmreuse.integrations.vllm import EventfulEncoderCacheManager


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def script(n_requests: int = 2000, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    reqs = []
    for r in range(n_requests):
        ids = rng.sample(range(40), 3)
        feats = [MultiModalFeatureSpec(data=None, modality="image", identifier=f"img-{i}", mm_position=PlaceholderRange(10 + 20 * k, 16)) for k, i in enumerate(ids)]  # fmt: skip
        reqs.append(Request(request_id=f"r{r}", prompt_token_ids=[1] * 80, sampling_params=SamplingParams(), pooling_params=None, mm_features=feats))  # fmt: skip
    return reqs


def drive(m, reqs) -> tuple[float, int]:
    calls = 0
    t0 = time.perf_counter()
    for req in reqs:
        scheduled = 0
        for i in range(len(req.mm_features)):
            calls += 1
            if not m.check_and_update_cache(req, i):
                calls += 1
                if m.can_allocate(req, i, 10_000, scheduled):
                    calls += 1
                    m.allocate(req, i)
                    scheduled += 16
        m.get_freed_mm_hashes()  # one scheduler step
        m.free(req)
        calls += 2
    return time.perf_counter() - t0, calls


def unlocked(m):
    """The plug-in with a no-op in place of its lock (measuring only: never thread-safe)."""
    m._lock = contextlib.nullcontext()
    return m


def main() -> dict:
    reqs = script()

    def cfg() -> SimpleNamespace:  # a port of its own each time (a publisher's close lingers)
        return SimpleNamespace(additional_config={"mmreuse": {"encoder_cache_events_endpoint": f"tcp://*:{port()}"}}, parallel_config=SimpleNamespace(data_parallel_rank=0))  # fmt: skip

    best = {}
    for _ in range(7):
        for name, make in (
            ("vllm", lambda: EncoderCacheManager(cache_size=160)),
            ("mmreuse", lambda: EventfulEncoderCacheManager.create_manager(cache_size=160, vllm_config=cfg())),
            ("mmreuse_unlocked", lambda: unlocked(EventfulEncoderCacheManager.create_manager(cache_size=160, vllm_config=cfg()))),
        ):  # fmt: skip
            m = make()
            for r in reqs:
                r.__dict__.pop("_mmreuse_request_keys", None)
            dt, calls = drive(m, reqs)
            best[name] = min(best.get(name, dt), dt)
            best[f"{name}_calls"] = calls
            if getattr(m, "publisher", None) is not None:
                m.publisher.shutdown()
    n = len(reqs)
    return {
        "requests": n,
        "calls": best["vllm_calls"],
        "vllm_us_per_request": best["vllm"] / n * 1e6,
        "mmreuse_us_per_request": best["mmreuse"] / n * 1e6,
        "added_us_per_call": (best["mmreuse"] - best["vllm"]) / best["vllm_calls"] * 1e6,
        "lock_us_per_call": (best["mmreuse"] - best["mmreuse_unlocked"]) / best["vllm_calls"] * 1e6,
    }


if __name__ == "__main__":
    print(json.dumps(main()))

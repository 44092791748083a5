"""pytest-benchmark: the `index` decision of `mmreuse proxy` for a 32,768-token prompt with 16
images (hash under P's configuration + live-view lookup + coverage + demand + the item map;
render excluded), and, on its own, reading render's answer for that prompt.

.venv/bin/python -m pytest benchmarks/test_bench_proxy.py --benchmark-enable
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import msgspec
import pytest

from mmreuse.blockhash import to_event_id
from mmreuse.events.wire import BlockStored, KVEventBatch
from mmreuse.proxy.app import Proxy
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.policy import _occurrence_items
from mmreuse.render import from_render, from_render_json

N, IMAGES, IMAGE_TOKENS, BLOCK = 32_768, 16, 576, 16
IMAGE_PAD = 151655


def _request_and_render(seed: int = 0):
    rng = random.Random(seed)
    tokens, places, content = [], [], []
    gap = (N - IMAGES * IMAGE_TOKENS) // (IMAGES + 1)
    for k in range(IMAGES):
        tokens += [rng.randrange(1000, 100_000) for _ in range(gap)]
        places.append({"offset": len(tokens), "length": IMAGE_TOKENS})
        tokens += [IMAGE_PAD] * IMAGE_TOKENS
        content.append(
            {"type": "image_url", "image_url": {"url": f"https://x/{k}.png"}, "uuid": f"img-{k}"}
        )
        content.append({"type": "text", "text": "..."})
    tokens += [rng.randrange(1000, 100_000) for _ in range(N - len(tokens))]
    render = {
        "token_ids": tokens,
        "features": {
            "mm_hashes": {"image": [f"img-{k}" for k in range(IMAGES)]},
            "mm_placeholders": {"image": places},
        },
    }
    request = {"model": "m", "messages": [{"role": "user", "content": content}]}
    return request, render


def _index_proxy(**subscriber: object) -> Proxy:
    """An `index` proxy with one PD whose view runs without ZMQ (its subscriber faked)."""
    config = parse_args(
        ["--encode-servers-urls", "http://e", "--decode-servers-urls", "http://pd",
         "--policy", "index", "--kv-events-endpoints", "tcp://127.0.0.1:1",
         "--hash-seed", "0", "--block-size", str(BLOCK)]
    )  # fmt: skip
    proxy = Proxy(config)
    proxy.views[0].stream = SimpleNamespace(is_alive=True, error=None, **subscriber)
    return proxy


@pytest.fixture(scope="module", params=[0.0, 0.5, 1.0], ids=["cold", "half", "all"])
def planner(request):
    """A proxy with one PD whose live view holds the first `fraction` of the prompt's blocks."""
    proxy = _index_proxy()
    view = proxy.views[0]
    req, render = _request_and_render()
    rendered = from_render(render)
    assert view.hasher is not None
    hashes = view.hasher.hash_prompt(list(rendered.token_ids), mm=rendered.occurrences)
    held = [to_event_id(h) for h in hashes[: int(len(hashes) * request.param)]]
    if held:
        stored = BlockStored(held, None, [0] * BLOCK * len(held), BLOCK, None, None, None)
        view.index.apply(KVEventBatch(0.0, [stored]))
    return proxy.planner, rendered, req


def _decide(plan, rendered, items):
    """What `Planner.decide` does after render under index: each occurrence's item, the hashes
    (a fresh memo: nothing carried over between calls) and the plan."""
    return plan._plan(rendered, _occurrence_items(rendered, items), items, 0, {})


def test_index_decision_32k_16_images(benchmark, planner):
    plan, rendered, req = planner
    items = req["messages"][0]["content"][::2]
    decision = benchmark(_decide, plan, rendered, items)
    assert len(decision.dispatch.classes) == IMAGES


def test_read_render_answer_32k_16_images(benchmark):
    """The proxy's path: `from_render_json` (token ids checked by msgspec while decoding)."""
    _, render = _request_and_render()
    payload = msgspec.json.encode(render)
    rendered = benchmark(from_render_json, payload)
    assert len(rendered.occurrences) == IMAGES


def test_read_render_answer_32k_16_images_generic(benchmark):
    """`from_render` on a decoded dict (each token id checked in Python)."""
    _, render = _request_and_render()
    payload = msgspec.json.encode(render)
    rendered = benchmark(lambda: from_render(msgspec.json.decode(payload)))
    assert len(rendered.occurrences) == IMAGES


def _percentiles(n: int = 3000) -> None:
    """p50 / p99 of the decision over `n` calls, per view fill (pytest-benchmark reports no p99)."""
    import time

    for fraction in (0.0, 0.5, 1.0):
        plan, rendered, req = planner.__wrapped__(SimpleNamespace(param=fraction))  # type: ignore[attr-defined]
        items = req["messages"][0]["content"][::2]
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            _decide(plan, rendered, items)
            times.append(time.perf_counter() - t0)
        times.sort()
        p50, p99 = times[n // 2] * 1e3, times[int(n * 0.99)] * 1e3
        print(f"view holds {fraction:.0%}: p50 {p50:.3f} ms, p99 {p99:.3f} ms ({n} calls)")


if __name__ == "__main__":
    _percentiles()


@pytest.fixture(scope="module", params=[0.0, 0.5, 1.0], ids=["cold", "half", "all"])
def split_planner(request):
    """A proxy (index) with one PD whose complete view holds the first `fraction` of the
    prompt's blocks, published with their extra keys (so identifiers are followed)."""
    proxy = _index_proxy(complete=True)
    view = proxy.views[0]
    req, render = _request_and_render()
    rendered = from_render(render)
    assert view.hasher is not None and view.index.track_identifiers
    tokens = list(rendered.token_ids)
    hashes = view.hasher.hash_prompt(tokens, mm=rendered.occurrences)
    keys = view.hasher.block_extra_keys(tokens, mm=rendered.occurrences)
    n = int(len(hashes) * request.param)
    if n:
        extra = [
            None if k is None else [[x[1], x[2]] if x[0] == "mm" else x[1] for x in k]
            for k in keys[:n]
        ]
        stored = BlockStored(
            [to_event_id(h) for h in hashes[:n]], None, tokens[: n * BLOCK], BLOCK, None,
            None, None, extra_keys=extra,
        )  # fmt: skip
        view.index.apply(KVEventBatch(0.0, [stored]))
    assert view.usable and view.complete and view.index.identifiers_known()
    items = req["messages"][0]["content"][::2]
    return proxy.planner, req, items, [item["uuid"] for item in items], request.param


@pytest.mark.parametrize("images", [1, 16])
def test_arrival_split(benchmark, split_planner, images):
    """The arrival-time split of a request with `images` images (of the 16 above): the view's
    identifier lookups, P's encoder-cache records, the dedup; the issue's bound is 20 us per
    item (BENCHMARKS.md)."""
    planner, req, items, uuids, held = split_planner
    items, uuids = items[:images], uuids[:images]
    arrival = benchmark(planner.arrivals.split, req, items, uuids)
    assert arrival is not None
    if held == 0.0:
        assert len(arrival.now) == images
    if held == 1.0:
        assert arrival.now == ()


@pytest.mark.parametrize("images", [1, 16])
def test_held_references(benchmark, images):
    """--held-items reference, per request: E's metadata kept for the items it encoded and
    looked up for the items P holds (a 65,536-item table, full)."""
    from mmreuse.proxy.references import REFERENCE_ITEMS, HeldReferences

    refs = HeldReferences()
    meta = [{"metadata": {"image_grid_thw": [[1, 24, 24]]}, "modality": "image",
             "mm_hash": "", "transfer_id": "t"}]  # fmt: skip
    req = {"model": "m", "messages": []}
    for k in range(0, REFERENCE_ITEMS, 1024):
        uuids = [f"{i:064x}" for i in range(k, k + 1024)]
        refs.record(req, uuids, dict.fromkeys(range(1024), meta))
    uuids = [f"{i:064x}" for i in range(images)]
    held = frozenset(range(images))

    def request() -> dict:
        refs.record(req, uuids, {0: meta})  # the one E encoded
        return refs.lookup(req, uuids, held)

    assert len(benchmark(request)) == images

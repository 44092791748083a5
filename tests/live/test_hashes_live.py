"""Issue 12, live test 1: mmreuse's block hashes equal what a live vLLM P publishes.

For ~30 varied chat requests: render on the live P (`/v1/chat/completions/render`, mm_payload
none), turn the render into token ids and occurrences (`integrations.vllm.from_render`), hash with
mmreuse under P's configuration (sha256, block size 32, PYTHONHASHSEED=0), send the request, and
compare with the `BlockStored` events P publishes for it: the new blocks' hashes, their parent,
and their extra keys. Skipped unless MMREUSE_LIVE=1.
"""

import json
import os
import time

import pytest
import zmq

from mmreuse import BlockHasher
from mmreuse.blockhash import to_event_id
from mmreuse.cluster.client import image_part, png_data_url, post_json
from mmreuse.events import BlockStored, decode_batch
from mmreuse.render import from_render

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]

BLOCK = 32


def _text(n_words, seed):
    words = ["alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta"]
    return " ".join(words[(seed + i) % len(words)] for i in range(n_words))


def _img(size, color, uuid):
    return image_part(png_data_url(size, size, color), uuid=uuid)


def _requests(base):
    """(messages, extra body) for varied requests: no image, 1-3 images of several sizes, text
    lengths that move images across block boundaries (and one exactly onto one: `base` is the
    image offset after an empty prefix; the tiny tokenizer is one token per byte), the
    same image twice, cache_salt, and multi-turn conversations resent with their history."""
    out = []
    out.append(([{"role": "user", "content": _text(60, 0)}], {}))
    sizes = [56, 84, 112, 70, 98]
    on_boundary = (-base) % BLOCK + BLOCK  # prefix chars that put the image at k * BLOCK
    for i in range(14):  # one image after a prefix of varying length
        chars = on_boundary if i == 0 else 1 + 7 * i
        parts = [
            {"type": "text", "text": "x" * chars},
            _img(sizes[i % 5], (20 * i % 256, 40, 200), f"live-h-{i}"),
            {"type": "text", "text": _text(20, i + 1)},
        ]
        out.append(([{"role": "user", "content": parts}], {}))
    for i in range(4):  # 2-3 images, one repeated
        imgs = [_img(112, (9, 9, 9 + i), f"live-m-{i}"), _img(56, (1, 2, 3 + i), f"live-n-{i}")]
        if i % 2:
            imgs.append(imgs[0])
        parts = [{"type": "text", "text": _text(10 + i, i)}]
        for im in imgs:
            parts += [im, {"type": "text", "text": _text(7, i)}]
        out.append(([{"role": "user", "content": parts}], {}))
    out.append(([{"role": "user", "content": _text(70, 3)}], {"cache_salt": "tenant-a"}))
    out.append(([{"role": "user", "content": _text(70, 3)}], {"cache_salt": "tenant-b"}))
    no_uuid = image_part(png_data_url(84, 84, (77, 1, 200)))  # identifier: vLLM's content hash
    out.append(
        ([{"role": "user", "content": [no_uuid, {"type": "text", "text": _text(40, 2)}]}], {})
    )
    history = []
    for turn in range(8):  # multi-turn: the history resent every turn
        content = [{"type": "text", "text": _text(15, turn)}]
        if turn % 2 == 0:
            content.insert(0, _img(84, (turn * 30, 100, 50), f"live-chat-{turn}"))
        history = [*history, {"role": "user", "content": content}]
        out.append((history, {}))
        history = [*history, {"role": "assistant", "content": _text(9, turn + 7)}]
    return out


def _event_keys(keys):
    """mmreuse's hashed extra keys as vLLM publishes them (untagged: (identifier, offset) and bare
    salt), in JSON form (msgpack turns tuples into lists)."""
    if keys is None:
        return None
    return json.loads(json.dumps([list(k[1:]) if k[0] == "mm" else k[1] for k in keys]))


@pytest.fixture(scope="module")
def p_events(cluster):
    p = cluster.instances["P0"].spec
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(p.kv_events_endpoint)
    time.sleep(0.5)  # the slow joiner
    yield p, sub
    sub.close(0)


def _stored_until(sub, want, timeout=20.0):
    """BlockStored events received until `want` block hashes came (or the timeout)."""
    got, deadline = [], time.monotonic() + timeout
    while sum(len(e.block_hashes) for e in got) < want and time.monotonic() < deadline:
        if sub.poll(100):
            frames = sub.recv_multipart()
            got += [e for e in decode_batch(frames[-1]).events if isinstance(e, BlockStored)]
    return got


def test_live_block_hashes_equal_mmreuse(p_events):
    p, sub = p_events
    hasher = BlockHasher("sha256", BLOCK, seed="0")
    while sub.poll(200):  # what earlier tests left
        sub.recv_multipart()

    def render(body):
        return from_render(post_json(p.url + "/v1/chat/completions/render", {**body, "mm_payload": "none"}))  # fmt: skip

    # A system message unique to this run: P's cache holds nothing of these requests before
    # (earlier tests share the chat template's first block), so every block must be announced.
    system = [{"role": "system", "content": f"run {os.getpid()} {time.time_ns()}"}]
    probe = [{"type": "text", "text": "x"}, _img(56, (1, 1, 1), "live-probe")]
    probe_body = {"model": "tiny", "messages": [*system, {"role": "user", "content": probe}]}
    base = render(probe_body).occurrences[0].offset - 1  # the offset after an empty prefix
    stored: set[int] = set()  # P's cache never evicts here (1 GiB of KV for a tiny model)
    spans, compared = [], 0
    for messages, extra in _requests(base):
        body = {"model": "tiny", "messages": [*system, *messages], **extra}
        rendered = render(body)
        tokens, occs = list(rendered.token_ids), list(rendered.occurrences)
        spans += [(m.offset, m.end) for m in occs]
        hashes = hasher.hash_prompt(tokens, mm=occs, cache_salt=rendered.cache_salt)
        keys = hasher.block_extra_keys(tokens, mm=occs, cache_salt=rendered.cache_salt)
        ids = [to_event_id(h) for h in hashes]
        new = [i for i, k in enumerate(ids) if k not in stored]
        reply = post_json(p.url + "/v1/chat/completions", {**body, "max_tokens": 1, "temperature": 0, "return_token_ids": True})  # fmt: skip
        assert reply["prompt_token_ids"] == tokens  # render = what P ran
        events = _stored_until(sub, len(new))
        got = [h for e in events for h in e.block_hashes]
        assert got == [ids[i] for i in new], (messages, extra)
        for e in events:  # each event: a run of new blocks, its parent the block before
            first = ids.index(e.block_hashes[0])
            assert e.parent_block_hash == (ids[first - 1] if first else None)
            want_keys = [_event_keys(keys[first + j]) for j in range(len(e.block_hashes))]
            assert json.loads(json.dumps(e.extra_keys or [None] * len(want_keys))) == want_keys
        stored.update(ids)
        compared += len(new)
    assert compared >= 60
    assert any(a % BLOCK == 0 for a, _ in spans)  # an image starting exactly on a block
    assert any(a // BLOCK != (b - 1) // BLOCK for a, b in spans)  # and one across a boundary

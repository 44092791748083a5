"""HashConfigCheck: re-hash what P's BlockStored events publish with the proxy's configuration,
and BlockHasher.hash_block (one block as vLLM's hash_block_tokens).

Events come from three sources: vLLM's real BlockPool (the oracle venvs, 0.33.0 and 0.34.0:
mm keys, salts, prompt embeds, prefix hits, decode steps, LoRA, lookahead, a coarser KV group,
bytes hashes),
events built here exactly as that BlockPool builds them (mmreuse's hasher is vLLM's, byte for
byte: test_conformance.py), and the recorded 0.33.0 wire fixtures, whose hashes are random
stand-ins (they test the wire, not the hasher), so they may never verify."""

from __future__ import annotations

import base64
import json
import sys
import threading
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmreuse import BlockHasher, MMOccurrence, to_event_id
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from mmreuse.events.hashcheck import HashCheckStatus, HashConfigCheck
from mmreuse.hashing import fast_path_available
from tests.support.oracle import oracle_run
from tests.support.paths import KV_EVENT_FIXTURES, REPO

FIXTURES = json.loads(KV_EVENT_FIXTURES.read_text())

P_CONFIG = dict(hash_fn="sha256", block_size=16, seed="0")  # the cluster's P (docs/cluster.md)
CAUSES = "PYTHONHASHSEED or block size differs"


def tokens_of(n, base=1000):
    return [(base + 7919 * i) % 150000 for i in range(n)]


# ---- hash_block ----------------------------------------------------------------------------


REQUEST = dict(
    mm=[
        MMOccurrence("img-a", offset=5, length=20),
        MMOccurrence("img-a", offset=26, length=3),  # the same image again, in block 1 too
        MMOccurrence("é", offset=40, length=1),
        MMOccurrence("cat" * 30, offset=41, length=30),
    ],
    cache_salt="tenant-1",
)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash", "sha256_cbor", "xxhash_cbor"])
@pytest.mark.parametrize("lookahead", [0, 2])
def test_hash_block_chains_to_hash_prompt(hash_fn, fast, lookahead):
    if fast and not fast_path_available():
        pytest.fail("the C++ hashing fast path is not built")
    h = BlockHasher(hash_fn, 16, seed="42", lookahead=lookahead, use_fast_path=fast)
    tokens = tokens_of(100)
    expected = h.hash_prompt(tokens, **REQUEST)
    keys = h.block_extra_keys(tokens, **REQUEST)
    assert len(expected) == len(keys) == (100 - lookahead) // 16
    assert keys[0] is not None and ("cache_salt", "tenant-1") in (
        keys[0] if not lookahead else keys[0][0]
    )
    parent = None
    for i, (want, extra) in enumerate(zip(expected, keys, strict=True)):
        parent = h.hash_block(parent, tokens[i * 16 : (i + 1) * 16], extra)
        assert parent == want, i
        assert len(parent) == h.digest_size


def test_hash_block_text_equals_the_no_key_chain():
    h = BlockHasher(**P_CONFIG)
    tokens = tokens_of(48)
    got = None
    for i in range(3):
        got = h.hash_block(got, tuple(tokens[i * 16 : (i + 1) * 16]), None)
    assert got == h.hash_prompt(tokens)[-1]
    # numpy token arrays are sequences too; the digest is the same
    assert h.hash_block(None, np.array(tokens[:16]), None) == h.hash_prompt(tokens)[0]


@pytest.mark.parametrize(
    "args, cls, match",
    [
        ((b"x" * 31, [1] * 16, None), InvalidArgument, r"parent must be a 32-byte"),
        ((bytearray(32), [1] * 16, None), InvalidArgumentType, r"parent must be None or"),
        (("ab", [1] * 16, None), InvalidArgumentType, r"parent"),
        ((None, [1] * 15, None), InvalidArgument, r"token_ids must hold block_size=16 .* got 15"),
        ((None, [1] * 17, None), InvalidArgument, r"got 17"),
        ((None, "a" * 16, None), InvalidArgumentType, r"token_ids must be a sequence"),
        ((None, {1, 2}, None), InvalidArgumentType, r"token_ids"),
        ((None, [1] * 15 + [-1], None), InvalidArgument, r"token_ids\[15\] must be in \[0, "),
        ((None, [1] * 15 + [2**63], None), InvalidArgument, r"token_ids\[15\]"),
        ((None, [True] + [1] * 15, None), InvalidArgumentType, r"token_ids\[0\] must be an int"),
        ((None, [1.0] + [1] * 15, None), InvalidArgumentType, r"token_ids\[0\]"),
        ((None, [1] * 16, [("mm", "a", 0)]), InvalidArgumentType, r"extra_keys must be None or"),
    ],
)
def test_hash_block_refuses(args, cls, match):
    with pytest.raises(cls, match=match):
        BlockHasher(**P_CONFIG).hash_block(*args)


def test_hash_block_any_token_id_when_allowed():
    h = BlockHasher(**P_CONFIG, allow_any_token_id=True)
    tokens = [-5, 2**70] + [1] * 14
    assert h.hash_block(None, tokens, None) == h.hash_prompt(tokens)[0]


# ---- events as vLLM 0.33.0's BlockPool publishes them -----------------------------------------


def untag(keys):
    """vLLM's to_event_extra_keys for one block."""
    if keys is None:
        return None
    return tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)


def vllm_event(h, tokens, *, start=0, end=None, int_hashes=True, kv_block=1, **request):
    """BlockPool.cache_full_blocks' BlockStored for blocks [start, end) of a request, hashed by
    `h` (P's hasher); `kv_block` > 1 is a coarser KV group (hashes at its last boundary). Sent
    through the wire codec, so the shapes are what a subscriber decodes."""
    hashes = h.hash_prompt(tokens, **request)
    keys = h.block_extra_keys(tokens, **request)
    la, bs = h.lookahead, h.block_size * kv_block
    if kv_block > 1:
        hashes = hashes[kv_block - 1 :: kv_block]
        keys = [None] * len(hashes)  # text only in these tests
    end = len(hashes) if end is None else end

    def conv(x):
        return to_event_id(x) if int_hashes else x

    event = BlockStored(
        block_hashes=[conv(x) for x in hashes[start:end]],
        parent_block_hash=None if start == 0 else conv(hashes[start - 1]),
        token_ids=list(tokens[start * bs : end * bs]),
        block_size=bs,
        lora_id=None,
        medium="GPU",
        lora_name=request.get("lora_name"),
        extra_keys=[untag(k[0] if la and k is not None else k) for k in keys[start:end]],
        group_idx=0,
        lookahead_token_ids=[
            list(tokens[(i + 1) * bs : (i + 1) * bs + la]) for i in range(start, end)
        ]
        if la
        else None,
    )
    return wire(event)


def wire(*events):
    batch = decode_batch(encode_batch(KVEventBatch(ts=1.0, events=list(events))))
    return batch.events[0] if len(events) == 1 else batch.events


def check_of(*events, **config):
    chk = HashConfigCheck(BlockHasher(**{**P_CONFIG, **config}), instance="p0")
    for e in events:
        chk.observe(e)
    return chk.status


def totals(s: HashCheckStatus) -> int:
    assert sum(n for _, n in s.unverifiable_reasons) == s.unverifiable
    return s.verified + s.mismatches + s.unverifiable


P = BlockHasher(**P_CONFIG)
MM_TOKENS = tokens_of(100)
MM_EVENT = vllm_event(P, MM_TOKENS, **REQUEST)  # 6 blocks: mm keys, a repeated id, a salt


def test_published_shapes_are_vllms():
    assert MM_EVENT.extra_keys[0] == (["img-a", 5], "tenant-1")
    assert MM_EVENT.extra_keys[1] == (["img-a", -11], ["img-a", 10])  # one id twice
    assert MM_EVENT.extra_keys[2] == (["é", 8], ["cat" * 30, 9])


@pytest.mark.parametrize("int_hashes", [True, False])
@pytest.mark.parametrize("hash_fn", ["sha256", "xxhash", "sha256_cbor", "xxhash_cbor"])
def test_right_config_verifies_every_block(hash_fn, int_hashes):
    h = BlockHasher(hash_fn, 16, seed="0")
    events = [
        vllm_event(h, MM_TOKENS, int_hashes=int_hashes, **REQUEST),
        vllm_event(h, tokens_of(64, 5), int_hashes=int_hashes),
        vllm_event(h, tokens_of(40, 9), int_hashes=int_hashes, cache_salt="s"),
    ]
    s = check_of(*events, hash_fn=hash_fn)
    assert s == HashCheckStatus("p0", verified=6 + 4 + 2, mismatches=0, unverifiable=0,
                                first_mismatch=None)  # fmt: skip
    assert s.ok


@pytest.mark.parametrize(
    "config, cause",
    [
        (dict(seed="1"), "seed='1'"),
        (dict(seed=None), "seed=None"),  # vLLM's unset seed: "vllm-none-hash"
        (dict(hash_fn="xxhash"), "hash_fn='xxhash'"),
        (dict(hash_fn="sha256_cbor"), "hash_fn='sha256_cbor'"),
    ],
)
def test_wrong_seed_or_hash_fn_is_a_mismatch(config, cause):
    s = check_of(MM_EVENT, vllm_event(P, tokens_of(64, 5)), **config)
    assert s.verified == 0 and s.mismatches == 2 and not s.ok
    assert totals(s) == 6 + 4
    msg = s.first_mismatch
    assert "\n" not in msg and "'p0'" in msg and "block 0 " in msg and cause in msg
    assert f"P published event id {MM_EVENT.block_hashes[0]}" in msg
    assert CAUSES in msg and "--hash-algo/--hash-seed/--block-size" in msg


@pytest.mark.parametrize(
    "proxy_bs, words",
    [
        (32, "P publishes block_size 16, the proxy hashes with"),  # not a divisor: no hashing
        (12, "P publishes block_size 16"),
        (8, "P's block_size 16 re-hashed as 2 blocks"),  # 16 = 2 x 8: tried, and refuted
        (4, "re-hashed as 4 blocks"),
    ],
)
def test_wrong_block_size_is_a_mismatch(proxy_bs, words):
    s = check_of(vllm_event(P, tokens_of(64, 5)), MM_EVENT, block_size=proxy_bs)
    assert s.verified == 0 and s.mismatches >= 1 and totals(s) == 4 + 6
    assert words in s.first_mismatch and "block size" in s.first_mismatch


def test_digest_size_alone_proves_the_algorithm():
    xx = BlockHasher("xxhash", 16, seed="0")
    e = vllm_event(xx, tokens_of(64), int_hashes=False)
    assert len(e.block_hashes[0]) == 16
    s = check_of(e)  # the proxy: sha256
    assert s.mismatches == 1 and s.unverifiable == 3
    assert "16-byte block hashes (xxhash*)" in s.first_mismatch
    assert "hash_fn='sha256'" in s.first_mismatch and "(32 bytes)" in s.first_mismatch
    s = check_of(vllm_event(P, tokens_of(64), int_hashes=False), hash_fn="xxhash")
    assert s.mismatches == 1 and "32-byte block hashes (sha256*)" in s.first_mismatch
    # even where nothing could be re-hashed (a LoRA event, an unknown parent)
    lora = vllm_event(xx, tokens_of(64), int_hashes=False, start=2, lora_name="a", lora_path="/a")
    assert check_of(lora).mismatches == 1


def test_first_mismatch_is_kept():
    a, b = vllm_event(P, tokens_of(32, 1)), vllm_event(P, tokens_of(32, 2))
    chk = HashConfigCheck(BlockHasher("sha256", 16, seed="9"), instance="p0")
    chk.observe(a)
    first = chk.status.first_mismatch
    chk.observe(b)
    s = chk.status
    assert s.mismatches == 2 and s.first_mismatch == first and str(a.block_hashes[0]) in first


def test_parent_chain_is_followed():
    tokens = tokens_of(16 * 7) + [3] * 5  # 7 full blocks
    first = vllm_event(P, tokens, end=3, **REQUEST)
    then = vllm_event(P, tokens, start=3, end=5, **REQUEST)  # parent: block 2, verified
    last = vllm_event(P, tokens, start=5, **REQUEST)
    assert then.parent_block_hash == first.block_hashes[-1]
    s = check_of(first, then, last)
    assert s.verified == 7 and s.mismatches == 0 and s.unverifiable == 0
    # without its root, a continuation is never judged
    s = check_of(then, last)
    assert s.verified == 0 and s.mismatches == 0
    assert s.unverifiable_reasons == (("unknown parent", 4),)
    # a wrong seed shows at the root; the continuation cannot be judged (its parent is P's)
    s = check_of(first, then, seed="x")
    assert s.mismatches == 1 and s.verified == 0
    assert dict(s.unverifiable_reasons) == {"after a mismatch in the chain": 2, "unknown parent": 2}


def test_a_known_parent_with_wrong_continuation_is_a_mismatch():
    tokens = tokens_of(64)
    first, then = vllm_event(P, tokens, end=2), vllm_event(P, tokens, start=2)
    forged = BlockStored(**{**{f: getattr(then, f) for f in then.__struct_fields__},
                            "token_ids": [t + 1 for t in then.token_ids]})  # fmt: skip
    s = check_of(first, forged)
    assert s.verified == 2 and s.mismatches == 1
    assert "block 0 of a BlockStored event (parent: verified earlier)" in s.first_mismatch


def test_bytes_parent_must_be_the_verified_digest():
    tokens = tokens_of(64)
    first = vllm_event(P, tokens, end=2, int_hashes=False)
    then = vllm_event(P, tokens, start=2, int_hashes=False)
    assert check_of(first, then).verified == 4
    # a P digest never verified from NONE_HASH is not chained from (a wrong seed would pass)
    s = check_of(then, seed="x")
    assert s.verified == 0 and s.mismatches == 0 and s.unverifiable == 2
    # same low 64 bits, other digest: not the parent this check knows
    odd = bytes(16) + then.parent_block_hash[16:]
    moved = BlockStored(**{**{f: getattr(then, f) for f in then.__struct_fields__},
                           "parent_block_hash": odd})  # fmt: skip
    assert check_of(first, moved).unverifiable_reasons == (("unknown parent", 2),)


def test_max_known_bounds_memory_lru():
    chk = HashConfigCheck(P, instance="p0", max_known=4)
    roots = [tokens_of(32, base) for base in range(10)]
    for tokens in roots:
        chk.observe(vllm_event(P, tokens, end=1))
        assert chk.num_known <= 4
    assert chk.num_known == 4
    chk.observe(vllm_event(P, roots[0], start=1))  # evicted: unknown
    chk.observe(vllm_event(P, roots[9], start=1))  # recent: chained
    s = chk.status
    assert s.verified == 11 and s.unverifiable_reasons == (("unknown parent", 1),)
    assert chk.num_known == 4
    big = tokens_of(16 * 50)
    chk.observe(vllm_event(P, big))
    assert chk.num_known == 4 and chk.status.verified == 61


def test_reset_forgets_counts_and_parents():
    tokens = tokens_of(64)
    chk = HashConfigCheck(BlockHasher("sha256", 16, seed="x"))
    chk.observe(vllm_event(P, tokens_of(32, 3)))
    assert chk.status.mismatches == 1
    chk.reset()
    assert chk.status == HashCheckStatus("default", 0, 0, 0, None)
    chk = HashConfigCheck(P)
    chk.observe(vllm_event(P, tokens, end=2))
    chk.reset()
    chk.observe(vllm_event(P, tokens, start=2))
    assert chk.status.unverifiable_reasons == (("unknown parent", 2),) and chk.num_known == 0


def test_lora_is_unverifiable_not_judged():
    e = vllm_event(P, tokens_of(64), lora_name="ad1", lora_path="/x/ad1")
    assert e.extra_keys[0] == ("ad1",) and e.lora_name == "ad1"
    s = check_of(e, seed="wrong")  # a wrong seed, but nothing can prove it here
    assert s.mismatches == 0 and s.verified == 0
    assert s.unverifiable_reasons == (("LoRA (its path is not published)", 4),)


def test_skipped_null_blocks_are_unverifiable():
    e = vllm_event(P, tokens_of(64))
    e.block_hashes.pop(1)  # a sliding-window group skips blocks; token_ids keep them
    e.extra_keys.pop(1)
    s = check_of(e)
    assert s.mismatches == 0 and s.unverifiable_reasons == (
        ("token count is not blocks x block_size", 3),
    )


def test_missing_extra_keys_are_unverifiable():
    e = vllm_event(P, tokens_of(64))
    s = check_of(BlockStored(**{**{f: getattr(e, f) for f in e.__struct_fields__},
                                "extra_keys": None}), seed="1")  # fmt: skip
    assert s.mismatches == 0 and s.unverifiable_reasons == (("extra keys not published", 4),)


def test_prompt_embeds_digest_is_retagged():
    pytest.importorskip("torch")
    import torch

    embeds = torch.arange(48 * 4, dtype=torch.float32).reshape(48, 4)
    e = vllm_event(P, [0] * 48, prompt_embeds=embeds)
    assert type(e.extra_keys[0][0]) is bytes and len(e.extra_keys[0][0]) == 32
    assert check_of(e).verified == 3
    assert check_of(e, seed="1").mismatches == 1


def test_lookahead_verifies_and_mismatches():
    la2 = BlockHasher("xxhash", 16, seed="0", lookahead=2)
    tokens = tokens_of(90)
    e = vllm_event(la2, tokens, **REQUEST)
    assert len(e.lookahead_token_ids) == 5 and len(e.lookahead_token_ids[0]) == 2
    assert check_of(e, hash_fn="xxhash", lookahead=2).verified == 5
    s = check_of(e, hash_fn="xxhash")  # the proxy forgot lookahead
    assert s.mismatches == 1 and "P publishes 2 lookahead tokens per block" in s.first_mismatch
    s = check_of(e, hash_fn="xxhash", lookahead=1)
    assert s.mismatches == 1 and "lookahead=1" in s.first_mismatch
    s = check_of(vllm_event(P, tokens), lookahead=2)
    assert s.mismatches == 1 and "P publishes no lookahead tokens" in s.first_mismatch


def test_coarser_kv_group_text_blocks_verify():
    """A hybrid model's 32-token KV group under a 16-token hash block: vLLM publishes the hash
    at each 32-block's last 16-boundary; text blocks re-hash as two, keyed ones can't."""
    tokens = tokens_of(96)
    e = vllm_event(P, tokens, kv_block=2)
    assert e.block_size == 32 and len(e.block_hashes) == 3
    assert check_of(e).verified == 3
    then = vllm_event(P, tokens + tokens_of(64, 7), kv_block=2, start=3)
    assert check_of(e, then).verified == 5
    s = check_of(e, seed="1")
    assert s.mismatches == 1 and "re-hashed as 2 blocks" in s.first_mismatch
    keyed = BlockStored(**{**{f: getattr(e, f) for f in e.__struct_fields__},
                           "extra_keys": [["s"], None, None]})  # fmt: skip
    s = check_of(keyed)
    assert s.mismatches == 0 and s.unverifiable_reasons == (
        ("coarser KV block with extra keys", 3),
    )


@pytest.mark.parametrize(
    "block, entry",
    [
        (1, (["a", 3], ["b", 3])),  # offsets not increasing: vLLM's items are sorted, disjoint
        (1, (["a", 5], ["b", 2])),
        (1, (["a", 16],)),  # starts at or after the block end
        (0, (["a", -1],)),  # request block 0: an offset is never negative
        (1, ("salt",)),  # a salt beyond request block 0
        (0, ("",)),  # an empty salt is no key in vLLM
        (0, ("s", ["a", 3])),  # the salt before an mm key
        (0, ("s", "t")),  # two salts
        (1, (bytes(32), ["a", 3])),  # the embeds digest before an mm key
        (1, (bytes(32), bytes(32))),
        (1, (bytes(31),)),
        (1, (["a", 3, 4],)),
        (1, ([3, "a"],)),
        (1, (["a", True],)),
        (1, (["a", 3.0],)),
        (1, ()),  # vLLM publishes None for a block without keys
        (1, "a"),
        (1, tuple(["a", i] for i in range(19))),  # more keys than the block can start
    ],
)
def test_shapes_vllm_never_publishes_are_unverifiable(block, entry):
    tokens = tokens_of(64)
    e = vllm_event(P, tokens)
    keys = list(e.extra_keys)
    keys[block] = entry
    s = check_of(replace(e, extra_keys=keys))
    assert s.mismatches == 0 and s.verified == block
    assert s.unverifiable_reasons == (("extra keys not re-taggable", 4 - block),)


def test_same_identifier_object_twice_is_hashed_as_vllm_does():
    """vLLM's identifiers are fresh str objects off its wire, so pickle writes a repeated one
    twice; a hand-built event holding one object twice must hash the same."""
    ident = sys.intern("img-a")

    def one_object(k):
        return (ident if k[0] == ident else k[0], k[1]) if type(k) is list else k

    entries = [None if x is None else tuple(map(one_object, x)) for x in MM_EVENT.extra_keys]
    assert entries[1][0][0] is entries[1][1][0]
    assert check_of(replace(MM_EVENT, extra_keys=entries)).verified == 6


def test_reset_during_observe_drops_that_event():
    chk = HashConfigCheck(P)
    real = BlockHasher.hash_block

    def resetting(h, *args):
        chk.reset()  # a publisher restart while this event is hashed
        return real(h, *args)

    with mock.patch.object(BlockHasher, "hash_block", resetting):
        chk.observe(vllm_event(P, tokens_of(32)))
    assert totals(chk.status) == 0 and chk.num_known == 0
    chk.observe(vllm_event(P, tokens_of(32)))
    assert chk.status.verified == 2


def test_removed_and_cleared_are_ignored_other_types_refused():
    chk = HashConfigCheck(P)
    chk.observe(BlockRemoved(block_hashes=[1], medium="GPU"))
    chk.observe(AllBlocksCleared())
    assert totals(chk.status) == 0
    with pytest.raises(InvalidArgumentType, match="event must be a KV cache event"):
        chk.observe({"type": "BlockStored"})


def test_constructor_refuses():
    with pytest.raises(InvalidArgument, match=r"scheme must tag its extra keys .*'vllm-0.30'"):
        HashConfigCheck(BlockHasher("sha256", 16, scheme="vllm-0.30"))
    with pytest.raises(InvalidArgumentType, match="hasher must be a BlockHasher"):
        HashConfigCheck("sha256")
    with pytest.raises(InvalidArgument, match="instance"):
        HashConfigCheck(P, instance="")
    with pytest.raises(InvalidArgument, match="max_known"):
        HashConfigCheck(P, max_known=0)
    with pytest.raises(InvalidArgumentType, match="max_known"):
        HashConfigCheck(P, max_known=True)


def test_status_is_a_frozen_value():
    s = check_of(MM_EVENT)
    with pytest.raises(AttributeError):
        s.verified = 0
    assert not hasattr(s, "__dict__") and s.ok


def test_concurrent_observe_and_status():
    """A subscriber thread observes while the proxy reads: every snapshot is consistent."""
    chk = HashConfigCheck(P, instance="p0")
    events = [vllm_event(P, tokens_of(48, b)) for b in range(150)]
    done = threading.Event()

    def feed():
        for e in events:
            chk.observe(e)
        done.set()

    t = threading.Thread(target=feed)
    t.start()
    prev = chk.status
    while not done.is_set():
        cur = chk.status
        assert prev.verified <= cur.verified and cur.verified % 3 == 0  # events apply whole
        assert totals(cur) == cur.verified
        prev = cur
    t.join()
    assert chk.status.verified == 450 and chk.status.ok


# ---- the recorded vLLM 0.33.0 wire fixtures -------------------------------------------------


def fixture_events():
    out = []
    for fx in FIXTURES["fixtures"]:
        out += decode_batch(base64.b64decode(fx["payload_b64"])).events
    return out


@pytest.mark.parametrize(
    "config",
    [
        P_CONFIG,
        dict(hash_fn="sha256", block_size=16, seed=None),
        dict(hash_fn="xxhash", block_size=64, seed="0"),
    ],
)
def test_recorded_wire_fixtures_never_raise_and_never_verify(config):
    """Their hashes are random stand-ins made for the wire tests: no configuration re-hashes
    to them. All of vLLM's shapes (mm pairs with negative offsets, salts, LoRA names, parents,
    both hash forms) go through observe(); each block lands in exactly one count."""
    events = fixture_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert any(e.extra_keys and any(k for k in e.extra_keys) for e in stored)
    assert any(e.parent_block_hash is not None for e in stored)
    s = check_of(*events, **config)
    assert totals(s) == sum(len(e.block_hashes) for e in stored)
    assert s.verified == 0


# ---- a hostile publisher -----------------------------------------------------------------------


@contextmanager
def counting_hash_block():
    """Counts BlockHasher.hash_block calls (the work observe() does) while inside."""
    calls = [0]
    real = BlockHasher.hash_block

    def counted(h, *args):
        calls[0] += 1
        return real(h, *args)

    with mock.patch.object(BlockHasher, "hash_block", counted):
        yield calls


def replace(e, **fields):
    return BlockStored(**{**{f: getattr(e, f) for f in e.__struct_fields__}, **fields})


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.binary(max_size=40),
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.tuples(inner, inner),
        st.dictionaries(st.text(max_size=3), inner, max_size=3),
    ),
    max_leaves=12,
)


@st.composite
def garbage_key(draw, window, first):
    """One published key of a shape vLLM never publishes (on request block 0 when `first`)."""
    return draw(
        st.one_of(
            st.none(),
            st.booleans(),
            st.integers(),
            st.floats(),
            st.just("") if first else st.text(max_size=8),  # a salt is a non-empty str on block 0
            st.binary(max_size=40).filter(lambda b: len(b) != 32),
            st.dictionaries(st.text(max_size=3), scalars, max_size=2),
            st.tuples(st.one_of(st.integers(), st.none(), st.binary(max_size=4)), st.integers()),
            st.tuples(
                st.text(max_size=4),
                st.one_of(st.booleans(), st.floats(), st.text(max_size=3), st.none()),
            ),
            st.tuples(st.text(max_size=4), st.integers(min_value=window)),
            st.lists(scalars, max_size=5).filter(lambda x: len(x) != 2),
            st.lists(st.lists(scalars, max_size=2), min_size=2, max_size=2),
        )
    )


@st.composite
def garbage_entry(draw, first):
    """A block's entry with at least one garbage key, among valid-looking ones."""
    if draw(st.booleans()):
        return draw(
            st.one_of(
                st.integers(),
                st.text(max_size=4),
                st.just([]),
                st.just(()),
                st.dictionaries(st.text(max_size=2), scalars, max_size=2),
            )
        )
    valid = draw(st.lists(st.tuples(st.text(max_size=4), st.integers(-40, 15)), max_size=3))
    bad = draw(garbage_key(16, first))
    at = draw(st.integers(0, len(valid)))
    return [*valid[:at], bad, *valid[at:]]


@settings(max_examples=300)
@given(data=st.data())
def test_garbage_extra_keys_never_raise_nor_mismatch(data):
    tokens = tokens_of(16 * 4, data.draw(st.integers(0, 9)))
    start = data.draw(st.sampled_from([0, 1]))
    root = vllm_event(P, tokens, end=start) if start else None
    e = vllm_event(P, tokens, start=start)
    keys = list(e.extra_keys)
    hit = data.draw(st.lists(st.integers(0, len(keys) - 1), min_size=1, unique=True))
    for i in hit:
        keys[i] = data.draw(garbage_entry(first=start == 0 and i == 0))
    chk = HashConfigCheck(P)
    with counting_hash_block() as calls:
        if root is not None:
            chk.observe(root)
        chk.observe(replace(e, extra_keys=keys))
    s = chk.status
    assert s.mismatches == 0
    assert s.verified == start + min(hit)  # the blocks before the first garbage entry
    assert totals(s) == 4
    assert calls[0] <= 4


@settings(max_examples=300)
@given(data=st.data())
def test_garbage_tokens_never_raise_nor_mismatch(data):
    e = vllm_event(P, tokens_of(80), **REQUEST)
    bad = st.one_of(
        st.integers(max_value=-1),
        st.integers(min_value=2**63),
        st.booleans(),
        st.floats(),
        st.text(max_size=2),
        st.none(),
    )
    tokens = list(e.token_ids)
    if data.draw(st.booleans()):  # a wrong count
        n = data.draw(st.integers(0, 120).filter(lambda n: n != 80))
        tokens = (tokens * 2)[:n]
    else:  # a token of a type or value vLLM never publishes
        for i in data.draw(st.lists(st.integers(0, 79), min_size=1, max_size=5)):
            tokens[i] = data.draw(bad)
    chk = HashConfigCheck(P)
    with counting_hash_block() as calls:
        chk.observe(replace(e, token_ids=tokens))
    s = chk.status
    assert s.mismatches == 0 and totals(s) == 5
    assert calls[0] <= 5


@settings(max_examples=400)
@given(
    hashes=st.one_of(
        anything,
        st.lists(
            st.one_of(
                st.integers(0, 2**64 - 1),
                st.binary(min_size=16, max_size=16),
                st.binary(min_size=32, max_size=32),
                scalars,
            ),
            max_size=6,
        ),
    ),
    parent=st.one_of(st.none(), st.integers(), st.binary(max_size=33), anything),
    tokens=st.one_of(
        anything,
        st.lists(st.integers(0, 2**63 - 1), max_size=200),
        st.lists(st.integers(), max_size=100),
    ),
    block_size=st.one_of(st.integers(-2, 70), st.sampled_from([16, 32, 8]), anything),
    keys=st.one_of(anything, st.lists(st.one_of(st.none(), anything), max_size=6)),
    lora=st.one_of(st.none(), anything),
    lookahead=st.one_of(
        st.none(), anything, st.lists(st.lists(st.integers(), max_size=3), max_size=6)
    ),
    proxy_la=st.sampled_from([0, 2]),
)
def test_random_events_never_raise_and_bound_the_work(
    hashes, parent, tokens, block_size, keys, lora, lookahead, proxy_la
):
    h = BlockHasher(**P_CONFIG, lookahead=proxy_la)
    chk = HashConfigCheck(h, max_known=2)
    e = BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=lora,
        extra_keys=keys,
        lookahead_token_ids=lookahead,
    )
    with counting_hash_block() as calls:
        chk.observe(e)
        chk.observe(e)  # again: its blocks may now be known parents
    s = chk.status
    n = len(hashes) if type(hashes) in (list, tuple) else 1
    assert totals(s) == (2 * n if type(hashes) not in (list, tuple) or hashes else 0)
    assert chk.num_known <= 2
    ntok = len(tokens) if type(tokens) in (list, tuple) else 0
    assert calls[0] <= 2 * (ntok // 16)
    if s.mismatches:
        assert s.first_mismatch and "\n" not in s.first_mismatch


# ---- against vLLM's real BlockPool (0.33.0, 0.34.0) ------------------------------------------

# Runs in the oracle venv: argv = [repo, JSON configs]. For each config, the requests go through
# a real Request (vLLM's msgpack wire, get_request_block_hasher) into a real BlockPool with KV
# events on; prefix hits are re-announced (emit_cached_block_events) and decode steps cached.
ORACLE_SCRIPT = r"""
import base64, json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tools", "oracle"))
import hash_oracle
import msgspec
V = hash_oracle.vllm_api()
from vllm.distributed.kv_events import KVEventBatch
from vllm.v1.core.block_pool import BlockPool
enc = msgspec.msgpack.Encoder()
result = {}
for cfg in json.loads(sys.argv[2]):
    os.environ["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if cfg["int_hashes"] else "0"
    hb, kvb, la = cfg["block_size"], cfg["kv_block_size"], cfg["lookahead"]
    hash_oracle.init_none_hash(cfg["hash_fn"], cfg["seed"])
    fn = V.hashing.get_hash_fn_by_name(cfg["hash_fn"])
    hasher = V.kcu.get_request_block_hasher(hb, fn, la)
    pool = BlockPool(num_gpu_blocks=512, enable_caching=True, hash_block_size=hb,
                     enable_kv_cache_events=True, num_hash_lookahead_tokens=la)
    payloads = []
    for j, case in enumerate(cfg["requests"]):
        c = hash_oracle.parse_case({"hash_fn": cfg["hash_fn"], "seed": cfg["seed"],
            "block_size": hb, "lookahead": la, **{k: v for k, v in case.items() if k != "then"}})
        ecr, _ = hash_oracle.engine_core_request(c)
        req = V.Request.from_engine_core_request(V.wire(ecr), block_hasher=hasher)
        hashes = V.kcu.resolve_block_hashes(req.block_hashes, hb, kvb)
        k = 0
        while k < len(hashes) and pool.get_cached_block(hashes[k], [0]) is not None:
            k += 1
        cached = [pool.get_cached_block(hashes[x], [0])[0] for x in range(k)]
        pool.touch(cached)
        n = len(hashes)
        blocks = cached + pool.get_new_blocks(n - k + 1)
        if k:
            pool.emit_cached_block_events(req, k, kvb, 0)
        pool.cache_full_blocks(req, blocks, k, n, kvb, 0)
        for out in case.get("then", []):
            req.append_output_token_ids(out)
            hashes = V.kcu.resolve_block_hashes(req.block_hashes, hb, kvb)
            if len(hashes) > n:
                blocks += pool.get_new_blocks(len(hashes) - n)
                pool.cache_full_blocks(req, blocks, n, len(hashes), kvb, 0)
                n = len(hashes)
        batch = KVEventBatch(ts=float(j), events=pool.take_events(), data_parallel_rank=0)
        payloads.append(base64.b64encode(enc.encode(batch)).decode())
    result[cfg["name"]] = payloads
print(json.dumps(result))
"""


def _oracle_requests():
    sys_prompt = tokens_of(40, 11)
    mm = [
        {"identifier": "img-a", "offset": 45, "length": 20},
        {"identifier": "img-a", "offset": 66, "length": 3},  # the same image, same block
        {"identifier": "x", "offset": 70, "length": 1},
        {"identifier": "é", "offset": 72, "length": 5},
    ]
    reqs = [
        {"tokens": sys_prompt + tokens_of(30, 12)},
        {
            "tokens": sys_prompt + tokens_of(60, 13),
            "mm": mm,
            "then": [tokens_of(20, 14), [77], tokens_of(17, 15)],  # decode steps
        },
        {
            "tokens": sys_prompt + tokens_of(50, 16),
            "cache_salt": "tenant-1",
            "mm": [{"identifier": "cat", "offset": 2, "length": 30}],
        },
        {"tokens": sys_prompt + tokens_of(30, 17), "lora": {"name": "ad1", "path": "/p/ad1"}},
        {"tokens": None, "prompt_embeds": {"rows": 40, "dim": 8, "seed": 3}},
    ]
    reqs.append({"tokens": reqs[1]["tokens"] + tokens_of(33, 18), "mm": mm})  # a prefix hit
    return reqs


ORACLE_CONFIGS = [
    dict(name="sha256-int", hash_fn="sha256", seed="0", block_size=16),
    dict(name="xxhash-bytes", hash_fn="xxhash", seed="7", block_size=32, int_hashes=False),
    dict(name="cbor-kv32", hash_fn="sha256_cbor", seed="1", block_size=16, kv_block_size=32),
    dict(name="lookahead", hash_fn="xxhash_cbor", seed="3", block_size=16, lookahead=2),
]


@pytest.fixture(scope="module")
def vllm_events(oracle_python):

    py = oracle_python
    configs = [
        {"int_hashes": True, "kv_block_size": c["block_size"], "lookahead": 0, **c,
         "requests": _oracle_requests()}
        for c in ORACLE_CONFIGS
    ]  # fmt: skip
    out = oracle_run(py, "-c", ORACLE_SCRIPT, str(REPO), json.dumps(configs), timeout=300)
    payloads = json.loads(out.stdout.strip().splitlines()[-1])
    return {
        c["name"]: [
            e for p in payloads[c["name"]] for e in decode_batch(base64.b64decode(p)).events
        ]
        for c in ORACLE_CONFIGS
    }


def _proxy(c, **over):
    cfg = {"hash_fn": c["hash_fn"], "seed": c["seed"], "block_size": c["block_size"],
           "lookahead": c.get("lookahead", 0), **over}  # fmt: skip
    return BlockHasher(**cfg)


@pytest.mark.oracle
@pytest.mark.parametrize("c", ORACLE_CONFIGS, ids=[c["name"] for c in ORACLE_CONFIGS])
def test_vllm_block_pool_events_verify_with_p_config(vllm_events, c):
    events = vllm_events[c["name"]]
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert any(e.parent_block_hash is not None for e in stored)  # decode steps, prefix hits
    assert any(k and any(type(x) is list for x in k) for e in stored for k in e.extra_keys)
    chk = HashConfigCheck(_proxy(c), instance="P0")
    for e in events:
        chk.observe(e)
    s = chk.status
    assert s.ok and s.first_mismatch is None
    assert totals(s) == sum(len(e.block_hashes) for e in stored)
    reasons = dict(s.unverifiable_reasons)
    assert "LoRA (its path is not published)" in reasons  # the one LoRA request
    if c.get("kv_block_size", c["block_size"]) == c["block_size"]:
        # everything but LoRA verifies: mm keys, a repeated id, the salt, embeds, lookahead
        assert set(reasons) == {"LoRA (its path is not published)"}
        assert s.verified >= 12
    else:  # a coarser KV group: text blocks verify, keyed ones cannot be re-hashed
        assert s.verified >= 3 and "coarser KV block with extra keys" in reasons


@pytest.mark.oracle
@pytest.mark.parametrize("c", ORACLE_CONFIGS, ids=[c["name"] for c in ORACLE_CONFIGS])
@pytest.mark.parametrize(
    "wrong, words",
    [
        (dict(seed="wrong"), "seed='wrong'"),
        (dict(hash_fn="sha256_cbor"), "hash_fn='sha256_cbor'"),
        (dict(block_size=8), "block"),
        (dict(block_size=64), "P publishes block_size"),
    ],
)
def test_vllm_block_pool_events_expose_a_wrong_config(vllm_events, c, wrong, words):
    if wrong.get("hash_fn") == c["hash_fn"]:
        wrong = dict(hash_fn="xxhash")
        words = "xxhash"
    chk = HashConfigCheck(_proxy(c, **wrong), instance="P0")
    for e in vllm_events[c["name"]]:
        chk.observe(e)
    s = chk.status
    assert s.mismatches >= 1 and s.verified == 0 and not s.ok
    assert words in s.first_mismatch and "'P0'" in s.first_mismatch

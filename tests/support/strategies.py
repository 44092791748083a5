"""Hypothesis strategies for whole hashing cases, in the oracle's case schema."""

from __future__ import annotations

import random

from hypothesis import strategies as st

from mmreuse.hashing import HASH_FUNCTIONS

IDENTIFIERS = [
    "0cf457e24a479f02fd4d34540389f720f0807dcff92a7562108165b2637ea82f",
    "5a0717cb6596468ea1dffa86011f9b0f497348d80421835b51799f9aeb455642",
    "a",
    "b",
    "é",
    "ā",
    "L1:0cf457e24a479f02",
    "img",
    "mm",
    "s",
    "x" * 300,
]
SEEDS = ["0", "42", "12345", "4294967295", "random", "", "seed-ü"]


@st.composite
def cases(
    draw,
    hash_fns=HASH_FUNCTIONS,
    max_lookahead=3,
    embeds=True,
    lora_int_id=False,
    max_tokens=700,
    token_bound=2**63,
):
    """A hashing case; `token_bound`: token ids stay below it (2**31 for vLLM 0.34.0's int32
    Request)."""
    fn = draw(st.sampled_from(hash_fns))
    seed = draw(st.sampled_from(SEEDS + ([None] if fn.startswith("sha256") else [])))
    bs = draw(st.one_of(st.integers(1, 64), st.sampled_from([1, 2, 16, 32, 64])))
    la = draw(st.integers(0, max_lookahead)) if max_lookahead else 0
    n = draw(st.integers(0, max_tokens))
    rng = random.Random(draw(st.integers(0, 2**32)))
    big = draw(st.booleans())
    tokens = [
        rng.randrange(token_bound)
        if big and rng.random() < 0.2
        else rng.choice([rng.randrange(256), rng.randrange(65536), rng.randrange(152000), 151655])
        for _ in range(n)
    ]
    steps = None
    prompt_len = n
    if n and draw(st.booleans()):
        prompt_len = draw(st.integers(0, n))
        rest = n - prompt_len
        steps = [prompt_len]
        while rest > 0:
            k = min(rest, draw(st.sampled_from([1, 1, 2, 3, 7, 16, 40])))
            steps.append(k)
            rest -= k
    mm = []
    pos = 0
    for _ in range(draw(st.integers(0, 8))):
        pos += draw(st.sampled_from([0, 0, 1, 3, 17, 40]))
        length = draw(st.sampled_from([1, 2, 5, 16, 17, 33, 64, 100]))
        if pos + length > prompt_len:
            break
        occ = {"identifier": draw(st.sampled_from(IDENTIFIERS)), "offset": pos, "length": length}
        if draw(st.integers(0, 4)) == 0:
            occ["is_embed"] = [rng.random() < 0.7 for _ in range(length)]
        mm.append(occ)
        for i in range(pos, pos + length):
            tokens[i] = 151655
        pos += length
    case = {"hash_fn": fn, "seed": seed, "block_size": bs, "lookahead": la, "tokens": tokens}
    if mm:
        case["mm"] = mm
    if steps:
        case["steps"] = steps
    if draw(st.integers(0, 3)) == 0:
        lora = {
            "name": draw(st.sampled_from(["L1", "a", "s", "adapter-ü", "img"])),
            "path": draw(st.sampled_from(["/p", "/a/b", "a"])),
        }
        if lora_int_id:
            lora["int_id"] = draw(st.integers(1, 1000))
        case["lora"] = lora
    if draw(st.integers(0, 3)) == 0:
        case["cache_salt"] = draw(st.sampled_from(["", "s", "a", "salt", "tenant-ü", "x" * 40]))
    if embeds and prompt_len and draw(st.integers(0, 6)) == 0:
        case["prompt_embeds"] = {
            "rows": prompt_len,
            "dim": draw(st.integers(1, 8)),
            "seed": draw(st.integers(0, 99)),
            "dtype": draw(st.sampled_from(["float32", "bfloat16", "float16"])),
        }
    return case


@st.composite
def demand_requests(draw, max_tokens=300, max_items=8, overlap=True):
    """(occurrences, N, C, Availability kwargs) for compute_demand."""
    from mmreuse import MMOccurrence

    n = draw(st.integers(1, max_tokens))
    rng = random.Random(draw(st.integers(0, 2**32)))
    idents = ["A", "B", "C", "D", "lora:E"][: draw(st.integers(1, 5))]
    occs = []
    offset = 0
    for _ in range(draw(st.integers(0, max_items))):
        if overlap and occs and rng.random() < 0.2:
            offset = rng.randrange(occs[-1].offset, occs[-1].end)  # use_audio_in_video
        else:
            offset += rng.choice([0, 0, 1, 3, 9, 16, 30])
        if offset >= n:
            break
        length = rng.randint(1, min(n - offset, rng.choice([1, 4, 16, 40, 80])))
        mask = None
        kind = rng.random()
        if kind < 0.2:
            mask = [rng.random() < 0.6 for _ in range(length)]
        elif kind < 0.3:
            mask = [False] * length  # zero embeds
        elif kind < 0.45:  # embeds with trailing / leading non-embed tokens
            a, b = sorted(rng.sample(range(length + 1), 2)) if length > 1 else (0, 1)
            mask = [a <= j < b for j in range(length)]
        occs.append(MMOccurrence(rng.choice(idents), offset, length, is_embed=mask))
        if not overlap:
            offset += length
    c = draw(st.integers(0, n - 1))
    # Availability: p_local sizes usually consistent with the identifier's embed count.
    counts = {}
    for m in occs:
        counts.setdefault(m.identifier, m.num_embeds)
    p_local = {}
    for ident in idents:
        if rng.random() < 0.3:
            good = counts.get(ident, 0)
            p_local[ident] = good if good and rng.random() < 0.85 else rng.randint(1, 50)
    freeable = frozenset(i for i in p_local if rng.random() < 0.4)
    p_external = frozenset(i for i in idents if rng.random() < 0.3)
    e_cached = frozenset(i for i in idents if rng.random() < 0.3)
    avail = dict(
        p_local=p_local, p_local_freeable=freeable, p_external=p_external, e_cached=e_cached
    )
    return occs, n, c, avail

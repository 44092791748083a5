"""Generations of vLLM's block-hash scheme, as named, frozen descriptions.

Every key-shape field holds a name; the C fast path reads those names (_hashcore.HashSpec) and
maps them to ids of its own, so no id is defined here.

vLLM changed how it keys a block several times (multimodal key shape and its
boundary tests, LoRA key, tags, prompt embeds, lookahead, NONE_HASH seeding). A
`HashScheme` records one generation; `BlockHasher(scheme=...)` reproduces it. The
version ranges were read off every released wheel from 0.10.2 to 0.34.0, and
tools/make_scheme_vectors.py runs each generation's own code to make the test vectors (0.34.0
also publishes its rule as vectors, tests/data/vllm-0.34.0-prompt-block-hash-vectors.json).
All generations hash pure text (no LoRA, salt or embeddings) identically.
`scheme_for_vllm(vllm.__version__)` names the generation of a running vLLM.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from ..errors import InvalidArgument
from ..validate import show
from .functions import HASH_FUNCTIONS


@dataclass(frozen=True, slots=True)
class HashScheme:
    """One generation of vLLM's prefix-cache block hashing."""

    # Name used by `BlockHasher(scheme=...)`.
    name: str
    # The released vLLM versions that hash this way (for people; `vllm_min` / `vllm_max` are
    # the same range for `scheme_for_vllm`).
    vllm_versions: str
    # The first and last released vLLM version of this generation (inclusive).
    vllm_min: str
    vllm_max: str
    # Multimodal extra key: ("mm", identifier, offset - block_start) | (identifier, offset - block_start)
    # | identifier.
    mm_key: Literal["tagged", "pair", "bare"]
    # Boundary tests of `_gen_mm_extra_hash_keys`: "exclusive" skips an item that ends exactly at the
    # block start (`start >= offset + length`); "inclusive" (older) still keys it (`start > offset + length`).
    mm_bounds: Literal["exclusive", "inclusive"]
    # LoRA extra key: ("lora", name, path) | name | int id.
    lora_key: Literal["tagged", "name", "int_id"]
    # Cache salt key on block 0: ("cache_salt", salt) | salt.
    salt_key: Literal["tagged", "bare"]
    # Prompt-embeds key: ("prompt_embeds", sha256) | sha256 | the block's raw tensor bytes |
    # not hashed (None: prompt_embeds are rejected, since the hash would ignore them).
    embeds_key: Literal["tagged", "bare", "raw"] | None
    # Whether `num_hash_lookahead_tokens` (EAGLE) exists.
    supports_lookahead: bool
    # Where a later (incremental) hasher call starts its mm scan: "window" = first item ending after
    # the block start (exact); "last" = only the last item (vLLM's `curr_mm_idx = -1` shortcut).
    incremental_mm: Literal["window", "last"]
    # Hash functions this generation offers.
    hash_fns: tuple[str, ...]
    # NONE_HASH when PYTHONHASHSEED is unset: "default-seed" = hash_fn("vllm-none-hash") for sha256*,
    # random for xxhash*; "random" = os.urandom(32) for every hash function.
    unset_seed: Literal["default-seed", "random"]


_ALL_FNS = HASH_FUNCTIONS
_SHA_FNS = ("sha256", "sha256_cbor")

SCHEMES: dict[str, HashScheme] = {
    s.name: s
    for s in (
        # Tagged keys (vLLM PR "tag block-hash extra keys"); lookahead keys exist from 0.33.0 on.
        # 0.34.0 reads tokens from an int32 buffer, same keys (its own vectors pin them).
        HashScheme(
            name="vllm-0.33",
            vllm_versions="0.31.0 - 0.34.0 (lookahead > 0: 0.33.0 on)",
            vllm_min="0.31.0",
            vllm_max="0.34.0",
            mm_key="tagged",
            mm_bounds="exclusive",
            lora_key="tagged",
            salt_key="tagged",
            embeds_key="tagged",
            supports_lookahead=True,
            incremental_mm="window",
            hash_fns=_ALL_FNS,
            unset_seed="default-seed",
        ),
        # (identifier, offset) mm keys (PR #36708) and the fixed "vllm-none-hash" seed.
        HashScheme(
            name="vllm-0.30",
            vllm_versions="0.29.0 - 0.30.0",
            vllm_min="0.29.0",
            vllm_max="0.30.0",
            mm_key="pair",
            mm_bounds="exclusive",
            lora_key="name",
            salt_key="bare",
            embeds_key="bare",
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=_ALL_FNS,
            unset_seed="default-seed",
        ),
        # Same keys as vllm-0.30; an unset PYTHONHASHSEED still meant a random NONE_HASH.
        HashScheme(
            name="vllm-0.28",
            vllm_versions="0.19.0 - 0.28.0",
            vllm_min="0.19.0",
            vllm_max="0.28.0",
            mm_key="pair",
            mm_bounds="exclusive",
            lora_key="name",
            salt_key="bare",
            embeds_key="bare",
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=_ALL_FNS,
            unset_seed="random",
        ),
        # Bare identifiers with the older boundary tests; prompt embeds as a SHA-256 digest.
        HashScheme(
            name="vllm-0.18",
            vllm_versions="0.17.0 - 0.18.1",
            vllm_min="0.17.0",
            vllm_max="0.18.1",
            mm_key="bare",
            mm_bounds="inclusive",
            lora_key="name",
            salt_key="bare",
            embeds_key="bare",
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=_ALL_FNS,
            unset_seed="random",
        ),
        # LoRA by name (PR #27211); prompt embeds hashed as the block's raw tensor bytes.
        # xxhash / xxhash_cbor exist from 0.13.0 on.
        HashScheme(
            name="vllm-0.11",
            vllm_versions="0.11.1 - 0.16.0",
            vllm_min="0.11.1",
            vllm_max="0.16.0",
            mm_key="bare",
            mm_bounds="inclusive",
            lora_key="name",
            salt_key="bare",
            embeds_key="raw",
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=_ALL_FNS,
            unset_seed="random",
        ),
        # LoRA by int id, prompt embeds not hashed.
        HashScheme(
            name="vllm-0.10",
            vllm_versions="0.10.2 - 0.11.0",
            vllm_min="0.10.2",
            vllm_max="0.11.0",
            mm_key="bare",
            mm_bounds="inclusive",
            lora_key="int_id",
            salt_key="bare",
            embeds_key=None,
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=_SHA_FNS,
            unset_seed="random",
        ),
    )
}

DEFAULT_SCHEME = "vllm-0.33"


def get_scheme(name: object) -> HashScheme:
    """Look up a scheme by name, or raise InvalidArgument listing the known ones."""
    if isinstance(name, HashScheme):
        return name
    try:
        return SCHEMES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise InvalidArgument(
            f"scheme must be one of {sorted(SCHEMES)}, got {show(name)}"
        ) from None


# PEP 440 as vLLM's versions are written: release, pre-release, post-release, dev, local label
# ("0.32.0+cpu", "0.33.0rc1", "0.33.1.dev12+g1a2b3c").
_VERSION = re.compile(
    r"v?(?P<release>[0-9]+(?:\.[0-9]+)*)"
    r"(?:[-_.]?(?P<pre>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>[0-9]*))?"
    r"(?:-(?P<post_n1>[0-9]+)|[-_.]?(?:post|rev|r)[-_.]?(?P<post_n2>[0-9]*))?"
    r"(?:[-_.]?(?P<dev>dev)[-_.]?(?P<dev_n>[0-9]*))?"
    r"(?:\+[a-z0-9]+(?:[-_.][a-z0-9]+)*)?",
    re.IGNORECASE,
)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}
_Key = tuple[tuple[int, ...], tuple[int, int], int, tuple[int, int]]


def vllm_version_key(version: object) -> _Key:
    """A sort key for a vLLM version string, in PEP 440's order: a local label is dropped
    ("0.32.0+cpu" is 0.32.0, a build of it), and pre-releases and dev builds of X.Y.Z come
    before X.Y.Z ("0.33.0rc1" and "0.33.0.dev3" are before 0.33.0, after 0.32.x)."""
    m = _VERSION.fullmatch(version.strip()) if isinstance(version, str) else None
    if m is None:
        raise InvalidArgument(
            f"vllm_version must be a version string such as '0.33.0', got {show(version)}"
        )
    release = [int(x) for x in m["release"].split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()  # 0.33 is 0.33.0
    post = m["post_n1"] or m["post_n2"]
    has_post = post is not None
    if m["pre"]:
        pre = (_PRE_RANK[m["pre"].lower()], int(m["pre_n"] or 0))
    elif m["dev"] and not has_post:
        pre = (-1, 0)  # X.Y.Z.devN comes before X.Y.Z's pre-releases
    else:
        pre = (3, 0)
    dev = (0, int(m["dev_n"] or 0)) if m["dev"] else (1, 0)
    return tuple(release), pre, int(post or 0) if has_post else -1, dev


def scheme_for_vllm(version: object, *, nearest: bool = False) -> HashScheme:
    """The scheme of the vLLM whose `vllm.__version__` is `version`: the generation whose
    released range holds it (a local build such as "0.32.0+cpu" as its release; a dev or
    pre-release of X.Y.Z just before X.Y.Z). A version in no range (newer than 0.34.0, older
    than 0.10.2, or between two ranges) raises InvalidArgument naming it, unless `nearest`:
    then the last generation that began at or before it (the oldest for an older one)."""
    key = vllm_version_key(version)
    ordered = _by_age()
    for s in ordered:
        if vllm_version_key(s.vllm_min) <= key <= vllm_version_key(s.vllm_max):
            return s
    if nearest:
        began = [s for s in ordered if vllm_version_key(s.vllm_min) <= key]
        return began[-1] if began else ordered[0]
    raise InvalidArgument(
        f"vllm_version must be a vLLM in a known hash scheme's range ({vllm_ranges()}), "
        f"got {show(version)}"
    )


def _by_age() -> list[HashScheme]:
    return sorted(SCHEMES.values(), key=lambda s: vllm_version_key(s.vllm_min))


def vllm_ranges() -> str:
    """The vLLM versions of every scheme, newest first: "vllm-0.33: 0.31.0 - 0.34.0, ..."."""
    return ", ".join(f"{s.name}: {s.vllm_min} - {s.vllm_max}" for s in reversed(_by_age()))

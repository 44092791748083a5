"""Generations of vLLM's block-hash scheme, as named, frozen descriptions.

Every key-shape field holds a name; the C fast path reads those names (_hashcore.HashSpec) and
maps them to ids of its own, so no id is defined here.

vLLM changed how it keys a block several times (multimodal key shape and its
boundary tests, LoRA key, tags, prompt embeds, lookahead, NONE_HASH seeding). A
`HashScheme` records one generation; `BlockHasher(scheme=...)` reproduces it. The
version ranges were read off every released wheel from 0.10.2 to 0.33.0, and
tools/make_scheme_vectors.py runs each generation's own code to make the test vectors.
All generations hash pure text (no LoRA, salt or embeddings) identically.
"""

from __future__ import annotations

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
    # The released vLLM versions that hash this way.
    vllm_versions: str
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
        # Tagged keys (vLLM PR "tag block-hash extra keys"); lookahead keys exist from 0.33.0 only.
        HashScheme(
            name="vllm-0.33",
            vllm_versions="0.31.0 - 0.33.0 (lookahead > 0: 0.33.0)",
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

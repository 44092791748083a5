"""Generations of vLLM's block-hash scheme, as named, frozen descriptions.

vLLM changed how it keys a block several times (multimodal key shape and its
boundary tests, LoRA key, tags, prompt embeds, lookahead, NONE_HASH seeding). A
`HashScheme` records one generation; `BlockHasher(scheme=...)` reproduces it. The
version ranges were read off the released wheels (tools/make_scheme_vectors.py
checks them against the real code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

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
    # Prompt-embeds key: ("prompt_embeds", sha256) | sha256 | not hashed (None: prompt_embeds rejected).
    embeds_key: Literal["tagged", "bare"] | None
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


SCHEMES: dict[str, HashScheme] = {
    s.name: s
    for s in (
        HashScheme(
            name="vllm-0.33",
            vllm_versions="0.33.0",
            mm_key="tagged",
            mm_bounds="exclusive",
            lora_key="tagged",
            salt_key="tagged",
            embeds_key="tagged",
            supports_lookahead=True,
            incremental_mm="window",
            hash_fns=HASH_FUNCTIONS,
            unset_seed="default-seed",
        ),
        HashScheme(
            name="vllm-0.30",
            vllm_versions="0.30.0",
            mm_key="pair",
            mm_bounds="exclusive",
            lora_key="name",
            salt_key="bare",
            embeds_key="bare",
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=HASH_FUNCTIONS,
            unset_seed="default-seed",
        ),
        HashScheme(
            name="vllm-0.11",
            vllm_versions="0.11.0",
            mm_key="bare",
            mm_bounds="inclusive",
            lora_key="int_id",
            salt_key="bare",
            embeds_key=None,
            supports_lookahead=False,
            incremental_mm="last",
            hash_fns=("sha256", "sha256_cbor"),
            unset_seed="random",
        ),
    )
}

DEFAULT_SCHEME = "vllm-0.33"


def get_scheme(name: object) -> HashScheme:
    """Look up a scheme by name, or raise ValueError listing the known ones."""
    if isinstance(name, HashScheme):
        return name
    try:
        return SCHEMES[name]  # type: ignore[index]
    except (KeyError, TypeError):
        raise ValueError(f"scheme must be one of {sorted(SCHEMES)}, got {name!r}") from None

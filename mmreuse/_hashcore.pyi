"""Types of the hashing fast path (csrc/hashcore.cpp); see docs/hashing-internals.md §6."""

from collections.abc import Sequence
from typing import Any

from _typeshed import ReadableBuffer

DEBUG_BUILD: bool
HASH_FUNCTIONS: tuple[str, ...]
MM_KEYS: tuple[str, ...]
MM_BOUNDS: tuple[str, ...]
LORA_KEYS: tuple[str, ...]
SALT_KEYS: tuple[str, ...]
EMBEDS_KEYS: tuple[str, ...]
INCREMENTAL_MM: tuple[str, ...]
MAX_BLOCK_TOKENS: int
MAX_LOOKAHEAD: int
MAX_KEY_BYTES: int

class RequestKeys:
    """One request's extra-key material for one HashSpec (HashSpec.request)."""

    @property
    def spec(self) -> HashSpec: ...
    @property
    def num_mm(self) -> int: ...
    def hash_blocks(
        self,
        # a list of ints, or a 1-D C-contiguous buffer of signed 32- / 64-bit ints
        # (array.array 'i' / 'l' / 'q', vLLM 0.34's TokenBuffer, numpy int32 / int64), read in place
        tokens: list[int] | ReadableBuffer,
        prior: list[bytes] | None = None,
        validate_from: int = 0,
        embeds: list[bytes] | None = None,
        /,
    ) -> list[bytes] | None: ...

class HashSpec:
    """One hasher's constant configuration, checked once in C."""

    hash_fn: str
    block_size: int
    lookahead: int
    none_hash: bytes
    mm_key: str
    mm_bounds: str
    lora_key: str
    salt_key: str
    embeds_key: str | None
    incremental_mm: str
    allow_any_token_id: bool
    def __init__(
        self,
        hash_fn: str,
        block_size: int,
        lookahead: int,
        none_hash: bytes,
        *,
        mm_key: str,
        mm_bounds: str,
        lora_key: str,
        salt_key: str,
        embeds_key: str | None,
        incremental_mm: str,
        allow_any_token_id: bool,
    ) -> None: ...
    def request(
        self, mm: Sequence[Any], lora: int | tuple[str, str] | None, salt: str | None, /
    ) -> RequestKeys | None: ...

def set_simd(on: bool) -> bool: ...
def simd_available() -> bool: ...

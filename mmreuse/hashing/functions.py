"""vLLM's four prefix-cache hash functions, byte for byte (vllm/utils/hashing.py).

`sha256` / `xxhash` serialize with pickle protocol 5 (HIGHEST_PROTOCOL on 3.8+),
`sha256_cbor` / `xxhash_cbor` with canonical CBOR (cbor2); the digest is SHA-256
(32 bytes) or XXH3-128 (16 bytes, canonical big-endian form).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Any

import cbor2
import xxhash as _xxhash

from ..validate import fail_value

# The names are the API (the reference path dispatches on them); the C fast path maps the same
# names to its own ids (mmreuse._hashcore.HASH_FUNCTIONS, checked equal by tests/test_hashcore.py).
HASH_FUNCTIONS: tuple[str, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

# Algorithms that are not collision resistant: vLLM never gives them a public default seed.
NON_CRYPTO_HASH_FUNCTIONS: frozenset[str] = frozenset({"xxhash", "xxhash_cbor"})

DIGEST_SIZE: dict[str, int] = {"sha256": 32, "sha256_cbor": 32, "xxhash": 16, "xxhash_cbor": 16}


def check_hash_fn(name: Any) -> str:
    """Return `name` if it is one of vLLM's hash function names, else raise InvalidArgument."""
    if not isinstance(name, str) or name not in HASH_FUNCTIONS:
        fail_value("hash_fn", f"one of {HASH_FUNCTIONS}", name)
    return name


def serialize(name: str, obj: Any) -> bytes:
    """The bytes vLLM's hash function `name` digests for `obj`."""
    if name.endswith("_cbor"):
        return cbor2.dumps(obj, canonical=True)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def digest(name: str, data: bytes) -> bytes:
    """Digest already-serialized bytes as vLLM's hash function `name` does."""
    if name.startswith("sha256"):
        return hashlib.sha256(data).digest()
    return _xxhash.xxh3_128_digest(data)


def get_hash_fn(name: str) -> Callable[[Any], bytes]:
    """vLLM's `get_hash_fn_by_name(name)`: object -> digest."""
    check_hash_fn(name)
    return lambda obj: digest(name, serialize(name, obj))

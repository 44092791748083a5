"""Block hashes: the one definition of what a block hash is and how it becomes an event id.

- `BlockHash`: the digest vLLM's prefix cache keys a full block by (32 bytes for sha256*, 16
  for xxhash*), as `mmreuse.hashing` computes it.
- `EventBlockId`: the 64-bit form vLLM's KV events publish by default
  (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the digest's low 64 bits, big-endian, an int in
  [0, 2**64). A negative int is not an event id (vLLM never publishes one) and is refused.
- `ExternalBlockHash`: what a KV event carries, either form.

`to_event_id` is the one conversion rule; the native table (`mmreuse._index`) applies the
same rule in C, and a property test holds the two equal: same key, or both refuse.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NewType

from . import _index
from .validate import fail_type, fail_value

__all__ = [
    "MIN_DIGEST_BYTES",
    "BlockHash",
    "EventBlockId",
    "ExternalBlockHash",
    "check_block_hashes",
    "to_event_id",
    "to_event_ids",
]

BlockHash = NewType("BlockHash", bytes)  # as vLLM's (vllm.v1.core.kv_cache_utils)
EventBlockId = int
ExternalBlockHash = bytes | int

MIN_DIGEST_BYTES = 8  # an event id needs 64 bits of digest
_EVENT_ID_END = 1 << 64


def to_event_id(block_hash: Any, field: str = "block_hash") -> EventBlockId:
    """The 64-bit event id of a block hash: digest bytes (>= 8) by their low 64 bits,
    big-endian (vLLM's `maybe_convert_block_hash`); an int event id in [0, 2**64) as it is."""
    if isinstance(block_hash, (bytes, bytearray)):
        if len(block_hash) < MIN_DIGEST_BYTES:
            fail_value(field, f"a block hash of >= {MIN_DIGEST_BYTES} bytes", block_hash)
        return int.from_bytes(block_hash[-8:], "big")
    if isinstance(block_hash, bool) or not isinstance(block_hash, int):
        fail_type(field, "a block hash (bytes) or a 64-bit int event id", block_hash)
    if not 0 <= block_hash < _EVENT_ID_END:
        fail_value(field, "an event id in [0, 2**64)", block_hash)
    return int(block_hash)


def to_event_ids(block_hashes: Iterable[Any], field: str = "block_hashes") -> list[EventBlockId]:
    """`to_event_id` for each hash, naming the index of a refused one (``block_hashes[3]``)."""
    if type(block_hashes) is list or type(block_hashes) is tuple:
        return _index.event_ids(block_hashes, field)  # the same rule, in one C call
    if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(block_hashes, Iterable):
        fail_type(field, "a sequence of block hashes", block_hashes)
    out = []
    for i, h in enumerate(block_hashes):
        if type(h) is bytes and len(h) >= MIN_DIGEST_BYTES:  # the common case, inlined
            out.append(int.from_bytes(h[-8:], "big"))
        else:
            out.append(to_event_id(h, f"{field}[{i}]"))
    return out


def check_block_hashes(block_hashes: Iterable[Any], field: str = "block_hashes") -> None:
    """`to_event_ids`' check alone, for a caller that keeps the hashes: refuses a bad one
    naming its index, builds no ids (a list or tuple is checked in one C call)."""
    if type(block_hashes) is list or type(block_hashes) is tuple:
        _index.check_event_ids(block_hashes, field)
    else:
        to_event_ids(block_hashes, field)

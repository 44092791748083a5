"""vLLM's KV-event wire format (vllm/distributed/kv_events.py), decoded with msgspec.

A batch is a msgpack array `[ts, events, data_parallel_rank]`. In vLLM 0.33.0 each event is a
msgpack *map* tagged `"type": "BlockStored" | "BlockRemoved" | "AllBlocksCleared"`, fields equal
to their default omitted. Older vLLM (see LEGACY_LAYOUT_VERSIONS) sent each event as a tagged
*array* `["BlockStored", block_hashes, parent_block_hash, ...]`; `decode_batch` accepts both.
Block hashes are 64-bit ints (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, the default since 0.10.2:
the low 64 bits of the digest, big-endian) or the raw digest bytes (=0); vLLM <= 0.10.1 sent
signed ints from Python's builtin hash().
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec

from ..blockhash import ExternalBlockHash  # re-exported: what an event's block hash is

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

# The vLLM releases whose events are tagged arrays (KVCacheEvent had array_like=True), read off
# every wheel 0.9.0 - 0.33.0. Events are tagged maps from 0.24.0 on; the batch is an array in
# all of them ([ts, events] in 0.9.0, [ts, events, data_parallel_rank] from 0.9.1).
LEGACY_LAYOUT_VERSIONS = "0.9.0 - 0.23.0"


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (vLLM 0.33.0: tagged maps)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM: lora_name keys the hash
    medium: str | None
    lora_name: str | None
    # One entry per block hash: the untagged extra keys (lora name, (mm id, offset) pairs,
    # cache salt, prompt-embeds digests); the LoRA path of the real key is not published.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


KVCacheEventType = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[KVCacheEventType]


# ---- the legacy layout: the same events as tagged arrays ------------------------------------


class _LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _LegacyBlockStored(_LegacyEvent, tag="BlockStored"):
    # Every declared field is written in the array layout; later releases appended fields:
    # medium (0.10.2), lora_name (0.14.0), extra_keys (0.17.0), group_idx (0.20.0),
    # kv_cache_spec_kind / _sliding_window (0.22.0).
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _LegacyBlockRemoved(_LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None = None
    group_idx: int | None = None


class _LegacyAllBlocksCleared(_LegacyEvent, tag="AllBlocksCleared"):
    pass


class _LegacyBatch(EventBatch):
    events: list[_LegacyBlockStored | _LegacyBlockRemoved | _LegacyAllBlocksCleared]


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_legacy_decoder = msgspec.msgpack.Decoder(_LegacyBatch)
_encoder = msgspec.msgpack.Encoder()


# vLLM's extra keys nest two deep inside an entry (("mm", identifier, offset), ("lora", name,
# path)); deeper is refused, which also bounds what a hostile peer can make a batch hold.
MAX_EXTRA_KEY_DEPTH = 8


# A payload of this many bytes or more is decoded with the cyclic GC paused. msgspec builds a
# batch in one C call, holding the GIL (every other thread, the proxy's event loop included,
# waits for it), and the collections that millions of new containers set off run inside that
# call: a 14.5 MB batch of 2M (identifier, offset) pairs decodes in ~0.5-1 s paused, 2.5-4 s
# not (benchmarks/kv_batch_stall.py). vLLM's per-step batches are smaller: no change for them.
GC_PAUSE_BYTES = 1 << 20


@contextmanager
def _gc_paused(nbytes: int) -> Iterator[None]:
    """The cyclic GC paused for a decode of `nbytes` >= GC_PAUSE_BYTES, if it was enabled (so
    that it is enabled again after; a thread decoding meanwhile may find it paused, or see it
    enabled again before its own decode ends: only slower, never left off)."""
    if nbytes < GC_PAUSE_BYTES or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class MalformedBatch(ValueError):
    """A payload that is not a vLLM KV-event batch in either layout."""


def _from_legacy(batch: _LegacyBatch) -> KVEventBatch:
    events: list[KVCacheEventType] = []
    for e in batch.events:
        if isinstance(e, _LegacyBlockStored):
            events.append(
                BlockStored(
                    block_hashes=e.block_hashes,
                    parent_block_hash=e.parent_block_hash,
                    token_ids=e.token_ids,
                    block_size=e.block_size,
                    lora_id=e.lora_id,
                    medium=e.medium,
                    lora_name=e.lora_name,
                    extra_keys=e.extra_keys,
                    group_idx=e.group_idx,
                    kv_cache_spec_kind=e.kv_cache_spec_kind,
                    kv_cache_spec_sliding_window=e.kv_cache_spec_sliding_window,
                )
            )
        elif isinstance(e, _LegacyBlockRemoved):
            events.append(
                BlockRemoved(block_hashes=e.block_hashes, medium=e.medium, group_idx=e.group_idx)
            )
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=batch.ts, events=events, data_parallel_rank=batch.data_parallel_rank)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one published batch (either layout); raises MalformedBatch naming the problem.

    Any bad payload raises MalformedBatch and nothing else: a wrong schema, truncated bytes,
    nesting deeper than msgspec's recursion guard (RecursionError, even in fields skipped as
    unknown), or `extra_keys` nested deeper than MAX_EXTRA_KEY_DEPTH (what is kept of a batch
    has a bounded depth, so nothing downstream recurses without end on a peer's data). A
    payload of GC_PAUSE_BYTES or more is decoded with the cyclic GC paused (process-wide, for
    that one C call).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise MalformedBatch(f"payload must be bytes, got {type(payload).__name__}")
    try:
        with _gc_paused(len(payload)):
            batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        batch = _decode_legacy(payload, exc)
    except Exception as exc:  # RecursionError and the like: a peer's bytes never escape as such
        raise MalformedBatch(f"not a vLLM KV-event batch: {type(exc).__name__}: {exc}") from None
    _check_extra_keys(batch)
    return batch


def _decode_legacy(payload: bytes | bytearray | memoryview, first: Exception) -> KVEventBatch:
    try:
        with _gc_paused(len(payload)):
            legacy = _legacy_decoder.decode(payload)
        return _from_legacy(legacy)
    except msgspec.DecodeError:
        raise MalformedBatch(f"not a vLLM KV-event batch: {first}") from None
    except Exception as exc:
        raise MalformedBatch(f"not a vLLM KV-event batch: {type(exc).__name__}: {exc}") from None


_CONTAINERS = frozenset((list, tuple, dict))


def _check_extra_keys(batch: KVEventBatch) -> None:
    """Refuse `extra_keys` entries nested deeper than MAX_EXTRA_KEY_DEPTH (the one field of
    free shape, `Any`, a batch keeps). vLLM's items are scalars or flat tuples: one type test
    per element, the full walk only where a container holds a container (or is a map)."""
    for i, e in enumerate(batch.events):
        keys = getattr(e, "extra_keys", None)
        if not keys:
            continue
        for entry in keys:
            if not entry:
                continue
            for item in entry:  # the entry is level 1, a container item level 2
                kind = type(item)
                if kind not in _CONTAINERS:
                    continue
                if kind is not dict:
                    for x in item:
                        if type(x) in _CONTAINERS:
                            break
                    else:
                        continue  # flat: depth 2
                if _depth(item) > MAX_EXTRA_KEY_DEPTH - 1:
                    raise MalformedBatch(
                        f"events[{i}].extra_keys nested deeper than {MAX_EXTRA_KEY_DEPTH} levels"
                    )


def _depth(value: Any) -> int:
    """Container depth of `value` (a list is 1), iteratively: no recursion on peer data; stops
    counting past MAX_EXTRA_KEY_DEPTH."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if d > deepest:
            deepest = d
            if d > MAX_EXTRA_KEY_DEPTH:
                return d
        for x in (*v.keys(), *v.values()) if isinstance(v, dict) else v:
            if type(x) in _CONTAINERS:
                stack.append((x, d + 1))
    return deepest


def encode_batch(batch: KVEventBatch) -> bytes:
    """vLLM's encoding of a batch (msgspec msgpack), e.g. for test publishers."""
    return _encoder.encode(batch)


def to_builtins(batch: KVEventBatch) -> Any:
    """The batch as JSON builtins (tuples as lists, bytes as base64), as the fixtures hold it."""
    return msgspec.json.decode(msgspec.json.encode(batch))

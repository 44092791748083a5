"""Encoder-cache events: what changes in a vLLM P's encoder cache, on vLLM's KV-event wire.

vLLM publishes no encoder-cache events; `mmreuse.integrations.vllm.EventfulEncoderCacheManager`
does, with vLLM's own `ZmqEventPublisher`: frames `(topic, 8-byte big-endian seq, payload)`, a
replay ROUTER answering from a sequence number, bind and connect modes as for KV events. The
payload is a msgpack array `[ts, events, data_parallel_rank]` (as `EventBatch`), each event a
msgpack map tagged by `"type"`:

- `EncoderCacheStored {identifier, num_embeds}`: an entry allocated (its embedding is computed
  or loaded in the step that scheduled it), referenced by the request that allocated it;
- `EncoderCacheFreeable {identifiers}`: no running request references them any more (still
  cached, evicted first when space is needed, oldest first);
- `EncoderCacheReferenced {identifiers}`: a freeable entry in use again (a cache hit);
- `EncoderCacheEvicted {identifiers}`: removed to make space;
- `EncoderCacheCleared {}`: everything dropped (`reset`, e.g. new weights).

Identifiers are vLLM's `mm_feature.identifier` (the request's uuid, or the processor's hash).
vLLM's encoder cache is not scoped by cache salt: an entry serves any request naming it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .wire import MalformedBatch


class EncoderCacheEvent(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Base class of the encoder-cache events."""


class EncoderCacheStored(EncoderCacheEvent):
    identifier: str
    num_embeds: int


class EncoderCacheFreeable(EncoderCacheEvent):
    identifiers: list[str]


class EncoderCacheReferenced(EncoderCacheEvent):
    identifiers: list[str]


class EncoderCacheEvicted(EncoderCacheEvent):
    identifiers: list[str]


class EncoderCacheCleared(EncoderCacheEvent):
    pass


EncoderCacheEventType = (
    EncoderCacheStored
    | EncoderCacheFreeable
    | EncoderCacheReferenced
    | EncoderCacheEvicted
    | EncoderCacheCleared
)


class EncoderCacheEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's events (vLLM's `EventBatch` layout, so vLLM's publisher can send it)."""

    ts: float
    events: list[EncoderCacheEventType]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(EncoderCacheEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_ec_batch(payload: bytes) -> EncoderCacheEventBatch:
    """Decode one payload; anything that is not a well-formed batch raises MalformedBatch."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise MalformedBatch(f"payload must be bytes, got {type(payload).__name__}")
    try:
        batch = _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise MalformedBatch(f"not an encoder-cache event batch: {e}") from None
    for event in batch.events:
        if isinstance(event, EncoderCacheStored) and event.num_embeds < 1:
            raise MalformedBatch(f"EncoderCacheStored.num_embeds = {event.num_embeds} < 1")
    return batch


def encode_ec_batch(batch: EncoderCacheEventBatch) -> bytes:
    """The payload vLLM's publisher sends for `batch` (msgpack)."""
    return _encoder.encode(batch)


def apply_ec_batch(state: dict[str, list[Any]], batch: EncoderCacheEventBatch) -> None:
    """Fold a batch into `state`: identifier -> [num_embeds, freeable] (what the events say P's
    encoder cache holds). Used to check the events against vLLM's real manager."""
    for e in batch.events:
        if isinstance(e, EncoderCacheStored):
            state[e.identifier] = [e.num_embeds, False]
        elif isinstance(e, EncoderCacheFreeable):
            for i in e.identifiers:
                if i in state:
                    state[i][1] = True
        elif isinstance(e, EncoderCacheReferenced):
            for i in e.identifiers:
                if i in state:
                    state[i][1] = False
        elif isinstance(e, EncoderCacheEvicted):
            for i in e.identifiers:
                state.pop(i, None)
        elif isinstance(e, EncoderCacheCleared):
            state.clear()

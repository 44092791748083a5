"""A live view of vLLM instances from their KV events: wire format, index, ZMQ event stream."""

from typing import TYPE_CHECKING

from ..metrics import Metrics
from .hashcheck import HashCheckStatus, HashConfigCheck
from .index import RemoteKVIndex
from .wire import (
    LEGACY_LAYOUT_VERSIONS,
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    MalformedBatch,
    decode_batch,
    encode_batch,
    to_builtins,
)

if TYPE_CHECKING:
    from .ec_sink import EncoderCacheSink
    from .kv_sink import KVIndexSink
    from .replay import END_SEQ
    from .stream import EventSink, EventStream, StreamDied, StreamLimits

_LAZY = {
    "END_SEQ": "replay",
    "EventSink": "stream",
    "EventStream": "stream",
    "StreamDied": "stream",
    "StreamLimits": "stream",
    "KVIndexSink": "kv_sink",
    "EncoderCacheSink": "ec_sink",
}


def __getattr__(name: str) -> object:
    """The stream and its sinks load on first use: they need pyzmq (`mmreuse[events]`), the
    wire format and the index do not."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "END_SEQ",
    "LEGACY_LAYOUT_VERSIONS",
    "MEDIUM_CPU",
    "MEDIUM_GPU",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EncoderCacheSink",
    "EventSink",
    "EventStream",
    "HashCheckStatus",
    "HashConfigCheck",
    "KVCacheEvent",
    "KVEventBatch",
    "KVIndexSink",
    "MalformedBatch",
    "Metrics",
    "RemoteKVIndex",
    "StreamDied",
    "StreamLimits",
    "decode_batch",
    "encode_batch",
    "to_builtins",
]

"""A live view of vLLM instances from their KV events: wire format, index, ZMQ subscriber."""

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
    from .subscriber import END_SEQ, KVEventSubscriber


def __getattr__(name: str) -> object:
    """`KVEventSubscriber` and `END_SEQ` load on first use: they need pyzmq (`mmreuse[events]`),
    the wire format and the index do not."""
    if name in ("KVEventSubscriber", "END_SEQ"):
        from . import subscriber

        return getattr(subscriber, name)
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
    "HashCheckStatus",
    "HashConfigCheck",
    "KVCacheEvent",
    "KVEventBatch",
    "KVEventSubscriber",
    "MalformedBatch",
    "Metrics",
    "RemoteKVIndex",
    "decode_batch",
    "encode_batch",
    "to_builtins",
]

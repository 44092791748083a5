"""A live view of vLLM instances from their KV events: wire format, index, ZMQ subscriber."""

from .index import RemoteKVIndex
from .metrics import Metrics
from .subscriber import END_SEQ, KVEventSubscriber
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

__all__ = [
    "END_SEQ", "LEGACY_LAYOUT_VERSIONS", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE",
    "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVCacheEvent", "KVEventBatch",
    "KVEventSubscriber", "MalformedBatch", "Metrics", "RemoteKVIndex", "decode_batch",
    "encode_batch", "to_builtins",
]

"""vLLM's prefix-cache block hashes, byte for byte, for several vLLM generations."""

from ..occurrence import MMOccurrence
from .functions import HASH_FUNCTIONS, get_hash_fn
from .hasher import (
    DEFAULT_NONE_HASH_SEED,
    BlockHash,
    BlockHasher,
    RequestHasher,
    fast_path_available,
    to_event_id,
)
from .schemes import DEFAULT_SCHEME, SCHEMES, HashScheme, get_scheme

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "DEFAULT_SCHEME",
    "HASH_FUNCTIONS",
    "SCHEMES",
    "BlockHash",
    "BlockHasher",
    "HashScheme",
    "MMOccurrence",
    "RequestHasher",
    "fast_path_available",
    "get_hash_fn",
    "get_scheme",
    "to_event_id",
]

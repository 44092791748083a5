"""Embeddings in the Mooncake Store: their keys, their object format, and calls into a store
that may be slow, down or hostile, each bounded in time.

Keys and objects are vLLM's own (`mooncake_store_embedding` in vLLM 0.32 and 0.33), so a
deployment can move between mmreuse's EC connector and vLLM's store backend:

    key    = f"{namespace}@id:{identifier}"
    object = struct "<IIQQ" (magic 0x4D4F4F4E, dtype code, tokens, hidden) + the raw 2-D tensor

`StoreCalls` runs every call on one thread of its own and waits at most `timeout` for it: a
master that stalls or has gone makes a call a miss, counted by reason, and the store is then
left alone for `backoff` seconds (every call a miss at once) instead of stalling vLLM's
scheduler step after step. Nothing here imports vLLM or Mooncake.
"""

from __future__ import annotations

import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, TypeVar

from .validate import check_float, check_int, check_str, fail_value

__all__ = [
    "DTYPE_CODES",
    "HEADER",
    "LOAD_MISS_LOG",
    "MAGIC",
    "UNAVAILABLE_LOG",
    "StoreCalls",
    "StoreObjectError",
    "StoredEmbedding",
    "embedding_key",
    "pack_embedding",
    "unpack_embedding",
]

MAGIC = 0x4D4F4F4E
HEADER = struct.Struct("<IIQQ")
# Mooncake's dtype codes (vLLM's `_MOONCAKE_DTYPE_TO_TORCH_DTYPE`), by torch dtype name
DTYPE_CODES = {"float32": 0, "float16": 11, "bfloat16": 12}
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
KEY_SEPARATOR = "@id:"
# what the connector logs when an item planned as a load is encoded by the worker instead
LOAD_MISS_LOG = "mmreuse: store miss at load"
# ... and when an item P cannot encode (an embedding reference, no media) is not in the store
UNAVAILABLE_LOG = "mmreuse: store lost a reference-only item"

T = TypeVar("T")


class StoreObjectError(ValueError):
    """An object read from the store is not an embedding of the expected shape."""


def embedding_key(namespace: str, identifier: str) -> str:
    """The store key of `identifier`'s embedding under `namespace` (vLLM's
    `make_embedding_key`)."""
    check_str("namespace", namespace, nonempty=True)
    check_str("identifier", identifier, nonempty=True)
    return f"{namespace}{KEY_SEPARATOR}{identifier}"


@dataclass(frozen=True, slots=True)
class StoredEmbedding:
    """A decoded object: the tensor's dtype (torch name), shape and raw bytes."""

    dtype: str
    tokens: int
    hidden: int
    payload: bytes


def pack_embedding(dtype: str, tokens: int, hidden: int, payload: bytes) -> bytes:
    """The store object for a contiguous (tokens, hidden) tensor of `dtype` whose bytes are
    `payload`."""
    if dtype not in DTYPE_CODES:
        fail_value("dtype", f"one of {sorted(DTYPE_CODES)}", dtype)
    check_int("tokens", tokens, 1)
    check_int("hidden", hidden, 1)
    if len(payload) != tokens * hidden * _ITEMSIZE[dtype]:
        fail_value(
            "payload", f"{tokens * hidden * _ITEMSIZE[dtype]} bytes ({tokens}x{hidden} {dtype})",
            f"{len(payload)} bytes",
        )  # fmt: skip
    return HEADER.pack(MAGIC, DTYPE_CODES[dtype], tokens, hidden) + payload


def unpack_embedding(
    data: bytes, *, tokens: int | None = None, hidden: int | None = None, dtype: str | None = None
) -> StoredEmbedding:
    """Decode an object; raises StoreObjectError when it is not one (a short or foreign
    object, an unknown dtype, a size that does not match its header) or when its `tokens`,
    `hidden` or `dtype` is not the one the caller expects (vLLM's store client refuses those
    too: `_validate_mooncake_tensor_metadata`)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise StoreObjectError(f"object must be bytes, got {type(data).__name__}")
    if len(data) < HEADER.size:
        raise StoreObjectError(f"object of {len(data)} bytes is shorter than its header")
    magic, code, n, width = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise StoreObjectError(f"object magic {magic:#x} is not {MAGIC:#x}")
    name = _DTYPE_NAMES.get(code)
    if name is None:
        raise StoreObjectError(f"object dtype code {code} is not one of {sorted(_DTYPE_NAMES)}")
    if n < 1 or width < 1:
        raise StoreObjectError(f"object shape ({n}, {width}) is empty")
    if tokens is not None and n != tokens:
        raise StoreObjectError(f"object has {n} tokens, the request expects {tokens}")
    if hidden is not None and width != hidden:
        raise StoreObjectError(f"object hidden size is {width}, the model expects {hidden}")
    if dtype is not None and name != dtype:
        raise StoreObjectError(f"object dtype is {name}, the model expects {dtype}")
    want = HEADER.size + n * width * _ITEMSIZE[name]
    if len(data) != want:
        raise StoreObjectError(f"object is {len(data)} bytes, its header says {want}")
    return StoredEmbedding(name, n, width, bytes(data[HEADER.size :]))


class StoreCalls:
    """Bounded calls into one store client (see the module docstring).

    `connect()` makes the client; it runs on the call thread too (a client's set-up blocks
    while its master is down) and is retried, at most once per `backoff`, until it succeeds.
    `call(name, fn, default)` runs `fn(client)` and returns its result, or `default` when
    there is no client, the store is backing off, a call is still stuck on the thread, `fn`
    raised, or `timeout` passed. `misses` counts those by reason.
    """

    def __init__(
        self,
        connect: Callable[[], Any],
        *,
        timeout: float = 1.0,
        backoff: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._connect = connect
        self.timeout = check_float("timeout", timeout, 0, lo_open=True)
        self.backoff = check_float("backoff", backoff, 0)
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmreuse-store")
        self._lock = threading.Lock()
        self._client: Any = None
        self._down_until = float("-inf")
        self._busy: Future[Any] | None = None
        self.misses: Counter[str] = Counter()
        self.last_error = ""

    @property
    def connected(self) -> bool:
        return self._client is not None

    def warm(self) -> None:
        """Connect now, on the call thread, without waiting (a worker mounts its segment at
        start-up, not at its first call)."""
        with self._lock:
            if self._client is None and self._busy is None:
                self._busy = self._pool.submit(self._run, lambda _client: None)

    def _run(self, fn: Callable[[Any], T]) -> T:
        if self._client is None:
            self._client = self._connect()
        return fn(self._client)

    def call(self, name: str, fn: Callable[[Any], T], default: T) -> T:
        with self._lock:
            now = self._clock()
            if self._busy is not None and not self._busy.done():
                self.misses["busy"] += 1
                return default
            if now < self._down_until:
                self.misses["backing_off"] += 1
                return default
            future = self._busy = self._pool.submit(self._run, fn)
        try:
            return future.result(timeout=self.timeout)
        except FutureTimeout:
            self._fail("timeout", f"{name}: no answer in {self.timeout} s")
        except Exception as exc:  # the client raised: a miss, never the caller's crash
            self._fail("error", f"{name}: {type(exc).__name__}: {exc}")
        return default

    def _fail(self, reason: str, message: str) -> None:
        with self._lock:
            self.misses[reason] += 1
            self.last_error = message
            self._down_until = self._clock() + self.backoff

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

"""Embeddings in the Mooncake Store: their keys, their object format, and calls into a store
that may be slow, down or hostile, each bounded in time.

Keys and objects are vLLM's own (`mooncake_store_embedding`, the same format in vLLM 0.32 -
0.34), so a deployment can move between mmreuse's EC connector and vLLM's store backend of
the same vLLM version (the namespace is not the same across versions: see the cards below):

    key    = f"{namespace}@id:{identifier}"
    object = struct "<IIQQ" (magic 0x4D4F4F4E, dtype code, tokens, hidden) + the raw 2-D tensor

`StoreCalls` runs every call on one thread of its own and waits at most `timeout` for it: a
master that stalls or has gone makes a call a miss, counted by reason, and the store is then
left alone for `backoff` seconds (every call a miss at once) instead of stalling vLLM's
scheduler step after step.

**Namespace cards.** vLLM's namespace for a model changes with its version (0.34 hashes the
multimodal config into the `@encoder:` part by another rule than 0.32 and 0.33), so two vLLM
versions sharing one store would each miss every embedding the other stores, silently.
`NamespaceCards` makes that visible: each instance keeps a card, a tiny object (its vLLM's
namespace rule, version and namespace, ~250 bytes of JSON) under

    mmreuse-card@{namespace without its @encoder: part}@rule:{rule}@t:{floor(unix time / period)}

written once per `period` (a put; the card of `period` x 3 before is removed), and looks for a
card of every other rule it knows in the time buckets around now (one `batch_is_exist`, each
`period` / 2 at most): a card of another rule written within the last one to two periods is an
instance that misses what this one stores. The key carries the time, so no card is ever
rewritten (a put, never an update of an object another client may hold a lease on) and a card
of an instance that stopped lapses by itself. Nothing here imports vLLM or Mooncake.

Anyone who reaches the master can put any bytes under a card's key (the key is predictable), so
a card counts only where it agrees with itself and its key: it decodes, its rule is its key's,
its namespace is of this model and not this instance's own (one that shares embeddings is no
conflict), and its `written` lies within one bucket of its key's and within two periods of now
(a card lapses two periods after its last write, as its key does). Any other is logged once
(a warning, per key: its key is not read again while it is looked at) and ignored, and the
look goes on to the other keys; a card that could not be read (a failed get) leaves the look
unanswered, never judged.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .validate import check_float, check_int, check_str, fail_type, fail_value, show

__all__ = [
    "CARD_PREFIX",
    "DTYPE_CODES",
    "HEADER",
    "IGNORED",
    "LOAD_MISS_LOG",
    "MAGIC",
    "TRANSFER_LOG",
    "UNAVAILABLE_LOG",
    "NamespaceCard",
    "NamespaceCards",
    "StoreCalls",
    "StoreObjectError",
    "StoredEmbedding",
    "Transfer",
    "embedding_key",
    "namespace_model",
    "pack_embedding",
    "transfer_line",
    "transfers",
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

# ... and, with the connector's `"log_transfers": true`, each put and load (`transfer_line`)
TRANSFER_LOG = "mmreuse: store transfer"
_TRANSFER = re.compile(re.escape(TRANSFER_LOG) + r": (put|get) (\S+) (\d+) bytes in ([\d.]+) ms")

# Mooncake's return codes (its ErrorCode) that a put may meet in a healthy store
OK, NO_AVAILABLE_HANDLE, OBJECT_ALREADY_EXISTS = 0, -200, -705

CARD_PREFIX = "mmreuse-card@"
CARD_MAX_BYTES = 4096
_ENCODER_PART = "@encoder:"
# why a card found under another rule's key is ignored: counted in `NamespaceCards.stats` as
# "ignored_<reason>" (once per key), and logged once per key with the text
IGNORED = {
    "undecodable": "it is not a namespace card",
    "rule_mismatch": "its rule is not its key's",
    "other_model": "its namespace is not of its key's model",
    "own_namespace": "it names this instance's own namespace (no conflict)",
    "off_bucket": "its time is not within one time bucket of its key's",
    "stale": "its time is more than two periods from now",
}
_LOGGER = logging.getLogger(__name__)

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


@dataclass(frozen=True, slots=True)
class Transfer:
    """One put (E -> the store) or get (the store -> P) the connector logged: the object's
    key and bytes, and the store call's time."""

    op: str
    key: str
    size: int
    ms: float


def transfer_line(op: str, key: str, size: int, ms: float) -> str:
    """The log line of one transfer (what `transfers` reads back)."""
    return f"{TRANSFER_LOG}: {op} {key} {size} bytes in {ms:.3f} ms"


def transfers(text: str) -> list[Transfer]:
    """Every transfer a log's `text` holds, in order."""
    return [Transfer(m[1], m[2], int(m[3]), float(m[4])) for m in _TRANSFER.finditer(text)]


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
    raised, or its timeout (`timeout`, or the call's own) passed. `misses` counts those by
    reason.
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

    def ready(self, wait: float) -> bool:
        """Wait at most `wait` seconds for the call in flight (the client's set-up, after
        `warm`) to end; whether a client is connected then."""
        with self._lock:
            busy = self._busy
        if busy is not None:
            wait_futures([busy], timeout=wait)
        return self._client is not None

    def _run(self, fn: Callable[[Any], T]) -> T:
        if self._client is None:
            self._client = self._connect()
        return fn(self._client)

    def call(
        self, name: str, fn: Callable[[Any], T], default: T, timeout: float | None = None
    ) -> T:
        wait = self.timeout if timeout is None else check_float("timeout", timeout, 0, lo_open=True)
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
            return future.result(timeout=wait)
        except FutureTimeout:
            self._fail("timeout", f"{name}: no answer in {wait} s")
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


def namespace_model(namespace: str) -> str | None:
    """What of vLLM's embedding namespace for a model every vLLM version writes alike: the
    namespace without its `@encoder:` part (the hash of the multimodal config, which vLLM 0.34
    computes by another rule than 0.33). None for a namespace without one (not vLLM's)."""
    head, sep, tail = namespace.rpartition(_ENCODER_PART)
    if not sep:
        return None
    _, at, rest = tail.partition("@")
    return head + (f"@{rest}" if at else "")


@dataclass(frozen=True, slots=True)
class NamespaceCard:
    """What an instance's card says: its vLLM's namespace rule, its vLLM version, the
    namespace it keys embeddings by, and when it wrote the card (unix seconds)."""

    rule: str
    vllm: str
    namespace: str
    written: float = 0.0

    def pack(self) -> bytes:
        fields = {"mmreuse_card": 1, "rule": self.rule, "vllm": self.vllm}
        fields |= {"namespace": self.namespace, "written": round(self.written, 3)}
        return json.dumps(fields, sort_keys=True).encode()

    @staticmethod
    def unpack(data: Any) -> NamespaceCard:
        """Decode a card; StoreObjectError when `data` is not one."""
        if not isinstance(data, (bytes, bytearray, memoryview)) or not data:
            raise StoreObjectError("card is empty or not bytes")
        if len(data) > CARD_MAX_BYTES:
            raise StoreObjectError(f"card of {len(data)} bytes is over {CARD_MAX_BYTES}")
        try:
            obj = json.loads(bytes(data))
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            raise StoreObjectError(f"card is not JSON: {type(exc).__name__}") from None
        if not isinstance(obj, dict) or obj.get("mmreuse_card") != 1:
            raise StoreObjectError("object is not a namespace card")
        rule, vllm, namespace, written = (
            obj.get(k) for k in ("rule", "vllm", "namespace", "written")
        )
        if not (isinstance(rule, str) and isinstance(vllm, str) and isinstance(namespace, str)):
            raise StoreObjectError("card lacks its rule, vllm or namespace")
        if not isinstance(written, (int, float)) or isinstance(written, bool):
            raise StoreObjectError("card lacks its time")
        try:
            seconds = float(written)  # an int too large for a float raises
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds):
            raise StoreObjectError("card's time is not a finite number of seconds")
        return NamespaceCard(rule, vllm, namespace, seconds)


def _said(text: str, limit: int = 300) -> str:
    """`text` as a card said it, quoted and cut (a namespace is ~150 characters; a card's up
    to 4 KB)."""
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


class NamespaceCards:
    """One instance's namespace card in a store, and the look for cards of other namespace
    rules for the same model (see the module docstring). `card` is this instance's (its
    `written` is set at each write); `rules`, every rule to look for (its own is left out);
    `period`, the card's time bucket in seconds; `clock`, unix time; `logger`, where an
    ignored card is logged. Every call goes through `calls` (bounded; a failed one is an
    unanswered look or an unwritten card, never a raise).
    """

    def __init__(
        self,
        calls: StoreCalls,
        card: NamespaceCard,
        rules: Iterable[str],
        *,
        period: float = 60.0,
        clock: Callable[[], float] = time.time,
        logger: logging.Logger = _LOGGER,
    ) -> None:
        model = namespace_model(card.namespace)
        if model is None:
            fail_value(
                "card.namespace", "a vLLM embedding namespace (with @encoder:)", card.namespace
            )
        self.calls = calls
        self.card = card
        self.model = model
        self.others = tuple(sorted(set(rules) - {card.rule}))
        self.period = check_float("period", period, 0, lo_open=True)
        self.clock = clock
        if not isinstance(logger, logging.Logger):
            fail_type("logger", "a logging.Logger", logger)
        self.logger = logger
        self._written: int | None = None  # the time bucket this instance last wrote a card in
        self._ignored: dict[str, str] = {}  # key -> reason, of the keys looked at last
        self._due = float("-inf")
        self.stats: Counter[str] = Counter()

    def key(self, rule: str, bucket: int) -> str:
        return f"{CARD_PREFIX}{self.model}@rule:{rule}@t:{bucket}"

    def _bucket(self, now: float) -> int:
        return math.floor(now / self.period)

    def find_other(self) -> tuple[bool, NamespaceCard | None]:
        """(whether the store answered, a fresh card of another rule or None). A card that does
        not count (the module docstring) is ignored and the look goes on to the next key; one
        that could not be read makes the look unanswered unless a later key holds a card."""
        if not self.others:
            return True, None
        now = self.clock()
        bucket = self._bucket(now)
        # the next bucket too: a writer whose clock runs ahead by up to a period
        found = [
            (r, b, self.key(r, b)) for r in self.others for b in (bucket + 1, bucket, bucket - 1)
        ]
        keys = [k for _, _, k in found]
        self._ignored = {k: self._ignored[k] for k in keys if k in self._ignored}
        self.stats["looks"] += 1
        states: Any = self.calls.call("batch_is_exist", lambda s: s.batch_is_exist(keys), [])
        if not isinstance(states, list) or len(states) != len(keys):
            self.stats["unanswered"] += 1
            return False, None
        answered = True
        for (rule, key_bucket, key), state in zip(found, states, strict=True):
            if state != 1 or key in self._ignored:
                continue
            data = self._get(key)
            if data is None or data == b"":  # Mooncake's get answers b"" when it fails
                self.stats["unread"] += 1
                answered = False
                continue
            card, reason, detail = self._judge(data, rule, key_bucket, now)
            if reason is None:
                self.stats["found"] += 1
                return True, card
            self._ignored[key] = reason
            self.stats[f"ignored_{reason}"] += 1
            self.logger.warning(
                "mmreuse: the namespace card under %s is ignored: %s (%s)",
                key, IGNORED[reason], detail,
            )  # fmt: skip
        return answered, None

    def _get(self, key: str) -> Any:
        """The object under `key`, or None where the call failed."""
        return self.calls.call("get", lambda s: s.get(key), None)

    def _judge(
        self, data: Any, rule: str, bucket: int, now: float
    ) -> tuple[NamespaceCard | None, str | None, str]:
        """(the card, why it does not count or None, what it says) for `data` found under
        the key of `rule` and `bucket`."""
        try:
            card = NamespaceCard.unpack(data)
        except StoreObjectError as exc:
            return None, "undecodable", str(exc)
        says = (
            f"rule {show(card.rule)}, vLLM {show(card.vllm)}, namespace {_said(card.namespace)}, "
            f"written {card.written}"
        )
        if card.rule != rule:
            return card, "rule_mismatch", says
        if namespace_model(card.namespace) != self.model:
            return card, "other_model", says
        if card.namespace == self.card.namespace:
            return card, "own_namespace", says
        if abs(self._bucket(card.written) - bucket) > 1:
            return card, "off_bucket", says
        if abs(now - card.written) > 2 * self.period:
            return card, "stale", says
        return card, None, says

    def write(self) -> bool:
        """Put this instance's card for the current time bucket (once a bucket; a card of the
        same rule already there is as good) and remove this rule's card of three buckets
        before. Whether the store holds one for this bucket now."""
        now = self.clock()
        bucket = self._bucket(now)
        if self._written == bucket:
            return True
        key, data = self.key(self.card.rule, bucket), replace(self.card, written=now).pack()
        rc = self.calls.call("put", lambda s: s.put(key, data), None)
        if rc not in (OK, OBJECT_ALREADY_EXISTS):
            self.stats["unwritten"] += 1
            return False
        self.stats["written"] += 1
        self._written = bucket
        old = self.key(self.card.rule, bucket - 3)
        self.calls.call("remove", lambda s: s.remove(old), None)
        return True

    def due(self) -> bool:
        """Whether `refresh` is due (half a period after the last)."""
        return self.clock() >= self._due

    def start(self) -> tuple[bool, NamespaceCard | None]:
        """At an instance's start: look for another rule's card (`find_other`); write this
        instance's only where the store answered and holds none (a refused instance leaves
        no card)."""
        self._due = self.clock() + self.period / 2
        answered, other = self.find_other()
        if answered and other is None:
            self.write()
        return answered, other

    def refresh(self) -> tuple[bool, NamespaceCard | None]:
        """While the instance runs: look for another rule's card, then write this
        instance's (whatever was found: the other instance then finds this one's too)."""
        self._due = self.clock() + self.period / 2
        answered, other = self.find_other()
        self.write()
        return answered, other

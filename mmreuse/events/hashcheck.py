"""Does the proxy hash like P? Re-hash what P's `BlockStored` events publish and compare.

The EPD proxy hashes requests with P's configuration (hash algorithm, PYTHONHASHSEED, block
size) and looks the hashes up in a view fed by P's KV events; a configuration that differs
makes every lookup miss, silently. vLLM 0.31 - 0.33 publish each block's token ids, parent and
untagged extra keys (`to_event_extra_keys`: an mm key as `(identifier, offset)`, a cache salt as
a bare str on block 0, a LoRA name as a bare str, a prompt-embeds digest as bytes), so
`HashConfigCheck` re-tags those keys, re-hashes the blocks with the proxy's `BlockHasher` and
counts blocks verified, mismatched, or unverifiable (LoRA: its path is not published; a parent
it has not verified itself; shapes vLLM never publishes). It judges only what it can prove.

Only chains rooted at NONE_HASH are verified (an event with no parent, or a parent this check
verified): the seed enters the hash only through NONE_HASH, so a block re-hashed from P's own
digest would verify under a wrong seed. Bounded against a hostile publisher: observe() costs
O(size of the event), memory is at most `max_known` remembered digests, nothing raises.
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import cachetools

from ..blockhash import to_event_id
from ..errors import InvalidArgument
from ..hashing.hasher import MAX_TOKEN_ID, BlockHasher, fresh_str
from ..validate import check_int, check_str, fail_type, show
from .wire import AllBlocksCleared, BlockRemoved, BlockStored

__all__ = ["HashCheckStatus", "HashConfigCheck"]

_EVENT_ID_END = 1 << 64
_ALGO_OF_DIGEST_SIZE = {32: "sha256*", 16: "xxhash*"}
_EMBEDS_DIGEST_BYTES = 32  # vLLM keys prompt embeds by their SHA-256

# Why blocks could not be judged (keys of HashCheckStatus.unverifiable_reasons).
MALFORMED = "malformed event"
TOKEN_COUNT = "token count is not blocks x block_size"
EXTRA_KEYS = "extra keys not re-taggable"
NO_EXTRA_KEYS = "extra keys not published"
LORA = "LoRA (its path is not published)"
UNKNOWN_PARENT = "unknown parent"
TOKEN_IDS = "token ids not valid (type or range)"
COARSER_BLOCK = "coarser KV block with extra keys"
AFTER_MISMATCH = "after a mismatch in the chain"

_CAUSES = (
    "P's --prefix-caching-hash-algo, PYTHONHASHSEED or block size differs from the proxy's "
    "--hash-algo/--hash-seed/--block-size"
)


@dataclass(frozen=True, slots=True)
class HashCheckStatus:
    """What the check found so far, in blocks (verified + mismatches + unverifiable = blocks
    observed; an event whose blocks cannot be counted counts as one)."""

    instance: str
    verified: int
    mismatches: int
    unverifiable: int
    first_mismatch: str | None
    # (reason, blocks), most frequent first: why blocks went unjudged.
    unverifiable_reasons: tuple[tuple[str, int], ...] = field(default=())

    @property
    def ok(self) -> bool:
        """No block contradicted the proxy's configuration (says nothing if none verified)."""
        return self.mismatches == 0


class _Bad(Exception):
    """A shape vLLM never publishes: the rest of the event goes unjudged, for `reason`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class _Done(Exception):
    """The event is judged (counted in its _Outcome): nothing more to look at."""


class _Outcome:
    """One event's verdicts, computed outside the lock and applied under it."""

    __slots__ = ("first", "mismatches", "remember", "unverifiable", "verified")

    def __init__(self) -> None:
        self.verified = 0
        self.mismatches = 0
        self.first: str | None = None
        self.unverifiable: Counter[str] = Counter()
        self.remember: list[tuple[int, bytes]] = []

    def mismatch(self, message: str, rest: int) -> None:
        self.mismatches += 1
        if self.first is None:
            self.first = message
        if rest > 0:
            self.unverifiable[AFTER_MISMATCH] += rest


def _published_hash(h: Any) -> int | bytes | None:
    """A well-formed published hash (an event id, or digest bytes of a vLLM size), else None."""
    if type(h) is int:
        return h if 0 <= h < _EVENT_ID_END else None
    if type(h) is bytes and len(h) in _ALGO_OF_DIGEST_SIZE:
        return h
    return None


def _int_list(value: Any) -> list[int] | None:
    """`value` (a list or tuple of exact ints) as a list, else None."""
    if type(value) is not list and type(value) is not tuple:
        return None
    for t in value:
        if type(t) is not int:
            return None
    return list(value)


class HashConfigCheck:
    """Verifies P's configuration from its `BlockStored` events (see the module docstring).

    Args:
        hasher: the proxy's `BlockHasher`, of a scheme with tagged keys (vllm-0.33), the one
            whose published keys can be re-tagged.
        instance: P's name, for the messages.
        max_known: how many verified digests are remembered (LRU) to follow parent chains.

    Thread-safe: a subscriber thread calls `observe`, the proxy reads `status`.
    """

    def __init__(
        self, hasher: BlockHasher, *, instance: str = "default", max_known: int = 65536
    ) -> None:
        if not isinstance(hasher, BlockHasher):
            fail_type("hasher", "a BlockHasher", hasher)
        s = hasher.scheme
        if (s.mm_key, s.salt_key, s.lora_key, s.embeds_key) != ("tagged",) * 4:
            raise InvalidArgument(
                f"hasher.scheme must tag its extra keys (vllm-0.33), got {s.name!r}: vLLM "
                f"0.31 - 0.33 publish the keys untagged and HashConfigCheck re-tags them; "
                f"vLLM {s.vllm_versions} publishes different shapes"
            )
        self.instance = check_str("instance", instance, nonempty=True)
        self.max_known = check_int("max_known", max_known, 1)
        self._h = hasher
        self._lock = threading.Lock()
        self._known: cachetools.LRUCache[int, bytes] = cachetools.LRUCache(self.max_known)
        self._generation = 0
        self._verified = 0
        self._mismatches = 0
        self._first: str | None = None
        self._unverifiable: Counter[str] = Counter()
        self._config = (
            f"hash_fn={hasher.hash_fn!r}, seed={hasher.seed!r}, block_size={hasher.block_size}"
            + (f", lookahead={hasher.lookahead}" if hasher.lookahead else "")
        )

    # ---- read side ----------------------------------------------------------------------------

    @property
    def status(self) -> HashCheckStatus:
        """A consistent snapshot of the counts."""
        with self._lock:
            return HashCheckStatus(
                instance=self.instance,
                verified=self._verified,
                mismatches=self._mismatches,
                unverifiable=sum(self._unverifiable.values()),
                first_mismatch=self._first,
                unverifiable_reasons=tuple(self._unverifiable.most_common()),
            )

    @property
    def num_known(self) -> int:
        """Verified digests remembered now (at most `max_known`)."""
        with self._lock:
            return len(self._known)

    def reset(self) -> None:
        """Forget everything (after a publisher restart); an observe() in flight is dropped."""
        with self._lock:
            self._generation += 1
            self._known.clear()
            self._verified = self._mismatches = 0
            self._first = None
            self._unverifiable.clear()

    # ---- write side ---------------------------------------------------------------------------

    def observe(self, event: Any) -> None:
        """Judge one event (in publication order). BlockRemoved / AllBlocksCleared are ignored;
        whatever a BlockStored holds is counted, never raised on (a peer's data); anything else
        raises InvalidArgumentType (a caller's error)."""
        if isinstance(event, (BlockRemoved, AllBlocksCleared)):
            return
        if not isinstance(event, BlockStored):
            fail_type("event", "a KV cache event (BlockStored)", event)
        with self._lock:
            generation = self._generation
        out = _Outcome()
        with contextlib.suppress(_Done):
            self._judge(event, out)
        with self._lock:
            if generation != self._generation:
                return  # reset() while this event was hashed: it belongs to the old publisher
            self._verified += out.verified
            self._mismatches += out.mismatches
            if self._first is None:
                self._first = out.first
            self._unverifiable.update(out.unverifiable)
            for eid, digest in out.remember:
                self._known[eid] = digest

    def _lookup(self, eid: int) -> bytes | None:
        with self._lock:
            return self._known.get(eid)

    def _judge(self, e: BlockStored, out: _Outcome) -> None:
        h = self._h
        hashes = e.block_hashes
        if type(hashes) is not list and type(hashes) is not tuple:
            out.unverifiable[MALFORMED] += 1
            return
        n = len(hashes)
        if n == 0:
            return
        published = []
        for x in hashes:
            p = _published_hash(x)
            if p is None:
                out.unverifiable[MALFORMED] += n
                return
            published.append(p)
        bs = e.block_size
        if type(bs) is not int or bs < 1:
            out.unverifiable[MALFORMED] += n
            return

        # Evidence that needs no re-hashing: the digest size, the block size, lookahead.
        for p in published:
            if type(p) is bytes and len(p) != h.digest_size:
                out.mismatch(
                    f"{self._who()}: P publishes {len(p)}-byte block hashes "
                    f"({_ALGO_OF_DIGEST_SIZE[len(p)]}), the proxy hashes with {self._config} "
                    f"({h.digest_size} bytes): P's --prefix-caching-hash-algo differs from the "
                    "proxy's --hash-algo",
                    n - 1,
                )
                return
        sub = 1  # blocks of the proxy's size per published block (a coarser KV group: > 1)
        if bs != h.block_size:
            if bs % h.block_size:
                out.mismatch(
                    f"{self._who()}: P publishes block_size {bs}, the proxy hashes with "
                    f"{self._config}: P's block size differs from the proxy's --block-size",
                    n - 1,
                )
                return
            sub = bs // h.block_size
        lookahead = self._lookahead(e, n, out)

        tokens = e.token_ids
        if type(tokens) is not list and type(tokens) is not tuple:
            out.unverifiable[MALFORMED] += n
            return
        if len(tokens) != n * bs:  # skipped null blocks (sliding window, Mamba), or garbage
            out.unverifiable[TOKEN_COUNT] += n
            return
        keys = e.extra_keys
        if keys is None:
            out.unverifiable[NO_EXTRA_KEYS] += n
            return
        if (type(keys) is not list and type(keys) is not tuple) or len(keys) != n:
            out.unverifiable[MALFORMED] += n
            return
        if e.lora_name is not None:
            out.unverifiable[LORA if type(e.lora_name) is str else MALFORMED] += n
            return

        parent_hash = e.parent_block_hash
        parent: bytes | None = None
        if parent_hash is not None:
            pp = _published_hash(parent_hash)
            if pp is None:
                out.unverifiable[MALFORMED] += n
                return
            parent = self._lookup(to_event_id(pp))
            if parent is None or (type(pp) is bytes and pp != parent):
                out.unverifiable[UNKNOWN_PARENT] += n
                return

        for i in range(n):
            try:
                if sub > 1:
                    if keys[i] is not None:
                        raise _Bad(COARSER_BLOCK)
                    row = None if lookahead is None else lookahead[i]
                    digest = self._hash_coarse(parent, tokens[i * bs : (i + 1) * bs], row)
                    last_keys = None
                else:
                    extra = self._retag(keys[i], first=parent_hash is None and i == 0)
                    last_keys = extra
                    if lookahead is not None:
                        extra = (extra, *lookahead[i])
                    digest = self._hash(parent, tokens[i * bs : (i + 1) * bs], extra)
            except _Bad as bad:
                out.unverifiable[bad.reason] += n - i
                return
            p = published[i]
            if digest == p if type(p) is bytes else to_event_id(digest) == p:
                out.verified += 1
                out.remember.append((to_event_id(digest), digest))
                parent = digest
                continue
            out.mismatch(self._mismatch_message(e, i, digest, p, sub, last_keys), n - i - 1)
            return

    def _lookahead(self, e: BlockStored, n: int, out: _Outcome) -> list[list[int]] | None:
        """The event's lookahead tokens per block (None: the proxy hashes without any). Raises
        _Done where that already judged the event: a lookahead mismatch, or a malformed list."""
        la = self._h.lookahead
        lt = e.lookahead_token_ids
        if lt is None:
            if not la:
                return None
            out.mismatch(
                f"{self._who()}: P publishes no lookahead tokens, the proxy hashes with "
                f"{self._config}: P's num_hash_lookahead_tokens (EAGLE) differs",
                n - 1,
            )
            raise _Done
        if (type(lt) is not list and type(lt) is not tuple) or len(lt) != n:
            out.unverifiable[MALFORMED] += n
            raise _Done
        rows: list[list[int]] = []
        for row in lt:
            r = _int_list(row)
            if not r or len(r) != len(rows[0] if rows else r):
                out.unverifiable[MALFORMED] += n
                raise _Done
            rows.append(r)
        if len(rows[0]) != la:
            out.mismatch(
                f"{self._who()}: P publishes {len(rows[0])} lookahead tokens per block, the "
                f"proxy hashes with {self._config}: P's num_hash_lookahead_tokens (EAGLE) differs",
                n - 1,
            )
            raise _Done
        if not self._h.allow_any_token_id:
            for r in rows:
                for t in r:
                    if not 0 <= t <= MAX_TOKEN_ID:
                        out.unverifiable[TOKEN_IDS] += n
                        raise _Done
        return rows

    def _retag(self, entry: Any, *, first: bool) -> tuple | None:
        """vLLM's tagged keys for one published entry: (id, off) -> ("mm", id, off), a str on
        request block 0 -> ("cache_salt", s), 32 bytes -> ("prompt_embeds", d), in vLLM's order
        (mm keys by offset, then the salt, then the digest). Raises _Bad for anything else."""
        if entry is None:
            return None
        if type(entry) is not list and type(entry) is not tuple:
            raise _Bad(EXTRA_KEYS)
        h = self._h
        window = h.block_size + h.lookahead  # the tokens an entry's keys may start in
        if not entry or len(entry) > window + 2:
            raise _Bad(EXTRA_KEYS)
        cbor = h.hash_fn.endswith("_cbor")
        out: list[tuple] = []
        stage = 0  # 0: mm keys, 1: after the salt, 2: after the embeds digest
        prev_off: int | None = None
        for k in entry:
            kind = type(k)
            if (kind is list or kind is tuple) and stage == 0 and len(k) == 2:
                ident, off = k
                if type(ident) is not str or type(off) is not int or off >= window:
                    raise _Bad(EXTRA_KEYS)
                if (prev_off is not None and off <= prev_off) or (first and off < 0):
                    raise _Bad(EXTRA_KEYS)  # vLLM's items are sorted and non-overlapping
                if off < -MAX_TOKEN_ID or (cbor and not _utf8(ident)):
                    raise _Bad(EXTRA_KEYS)
                prev_off = off
                out.append(("mm", fresh_str(ident), off))
            elif kind is str and first and stage == 0 and k and (not cbor or _utf8(k)):
                stage = 1
                out.append(("cache_salt", fresh_str(k)))
            elif kind is bytes and stage < 2 and len(k) == _EMBEDS_DIGEST_BYTES:
                stage = 2
                out.append(("prompt_embeds", k))
            else:
                raise _Bad(EXTRA_KEYS)
        return tuple(out)

    def _hash(self, parent: bytes | None, tokens: Any, extra: tuple | None) -> bytes:
        try:
            return self._h.hash_block(parent, tokens, extra)
        except InvalidArgument:
            raise _Bad(TOKEN_IDS) from None

    def _hash_coarse(self, parent: bytes | None, tokens: Any, row: list[int] | None) -> bytes:
        """A published block of several proxy blocks without keys (a hybrid model's coarser KV
        group: vLLM publishes the hash at its last hash-block boundary, and the lookahead tokens
        after the whole block; those of the inner blocks are the block's own next tokens)."""
        h = self._h
        bs, la = h.block_size, h.lookahead
        if _int_list(tokens) is None:
            raise _Bad(TOKEN_IDS)  # checked before any is hashed as another block's lookahead
        ext = tokens if row is None else [*tokens, *row]
        for j in range(0, len(tokens), bs):
            extra = (None, *ext[j + bs : j + bs + la]) if la else None
            parent = self._hash(parent, tokens[j : j + bs], extra)
        assert parent is not None  # tokens holds >= 1 block
        return parent

    # ---- messages -----------------------------------------------------------------------------

    def _who(self) -> str:
        return f"HashConfigCheck {show(self.instance)}"

    def _mismatch_message(
        self, e: BlockStored, i: int, digest: bytes, p: int | bytes, sub: int, keys: Any
    ) -> str:
        parent = "none (chain start)" if e.parent_block_hash is None else "verified earlier"
        shape = (
            f"; P's block_size {e.block_size} re-hashed as {sub} blocks of the proxy's"
            if sub > 1
            else ""
        )
        scheme = (
            f", or P's vLLM keys multimodal / salt / embeds blocks unlike scheme "
            f"{self._h.scheme.name!r} (vLLM {self._h.scheme.vllm_versions})"
            if keys is not None
            else ""
        )
        return (
            f"{self._who()}: block {i} of a BlockStored event (parent: {parent}): the proxy "
            f"computed event id {to_event_id(digest)}, P published event id {to_event_id(p)}; "
            f"the proxy hashes with {self._config}{shape}; likely {_CAUSES}{scheme}"
        )


def _utf8(s: str) -> bool:
    """Whether CBOR can encode `s` (a lone surrogate cannot be hashed with *_cbor)."""
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True

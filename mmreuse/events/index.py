"""RemoteKVIndex: one vLLM instance's resident block hashes, per medium, fed by its KV events."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .._table import HashTable
from ..blockhash import ExternalBlockHash, check_block_hashes, to_event_id, to_event_ids
from ..demand_query import MAX_IDENT_CHARS
from ..errors import InvalidArgument
from ..kvview import PrefixMatch
from ..validate import check_int, check_str, fail_type, show
from .identifiers import entry_identifiers
from .wire import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

# Longest medium name accepted: vLLM's are "GPU", "CPU", connector names; each one becomes a
# table here (and a Prometheus label value in the subscriber).
MAX_MEDIUM_CHARS = 64

# Most extra-key items one published block may carry (vLLM's: a LoRA name, the mm keys of the
# items overlapping the block, a cache salt, a prompt-embeds digest). More makes the medium's
# identifiers unknown (see `identifiers_known`), never a silent skip. It is also the default
# bound on a block's distinct identifiers (`RemoteKVIndex.max_identifiers_per_block`).
MAX_EXTRA_KEYS_PER_BLOCK = 256

# Why extra keys were not followed (`RemoteKVIndex.identifier_skips`). An identifier longer
# than MAX_IDENT_CHARS is not followed and `may_hold` answers True for it; the others make the
# medium's identifiers unknown until the next reset.
SKIP_LONG_IDENT = "identifier too long"
SKIP_NOT_PUBLISHED = "extra keys not published"
SKIP_MALFORMED = "extra keys malformed"
SKIP_SNAPSHOT = "loaded from a snapshot"

# How much of a batch `RemoteKVIndex.apply` does per hold of the view's lock: SLICE_WORK
# blocks, and the extra-key items of blocks naming several (each a few dict operations), give
# or take a block's items and a window of SLICE_WORK blocks between checks. Between two slices
# a reader waiting for the lock (the proxy's request path) takes it, so it waits for a slice
# (a few milliseconds at most), never for a whole batch.
SLICE_WORK = 2048
# The longest a pausing writer waits for the reader it lets in, and how often a reader waiting
# for the lock says so again (a pause may have let another reader in first).
HANDOFF_S = 0.005


class _ViewLock:
    """A RemoteKVIndex's lock. Readers and short writers take it with `with`; `apply` takes it
    (`take`) for a batch and `pause`s between two slices of it, where a reader that found it
    held takes it first (with a plain Lock, a holder releasing and re-taking it at once would
    win every time: its waiters are not served in order)."""

    __slots__ = ("_lock", "_taken", "_wanted")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wanted = False  # a reader waits for the lock
        self._taken = threading.Event()  # set by a reader that waited, once it has the lock

    def __enter__(self) -> None:
        lock = self._lock
        if lock.acquire(blocking=False):
            return
        self._wanted = True
        while not lock.acquire(timeout=HANDOFF_S):
            self._wanted = True  # again: a pause may have let another reader in instead
        self._wanted = False  # served (another reader still waiting says so again)
        self._taken.set()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()

    def take(self) -> None:
        """The writer's acquire (never asks for a pause)."""
        self._lock.acquire()

    def release(self) -> None:
        self._lock.release()

    def pause(self) -> None:
        """Between two slices, the lock held: if a reader waits, let it in, then take it back."""
        if not self._wanted:
            return
        self._wanted = False
        self._taken.clear()
        self._lock.release()
        self._taken.wait(HANDOFF_S)
        self._lock.acquire()


class RemoteKVIndex:
    """The block hashes an instance holds, as its KV events tell (per medium: GPU, CPU, ...).

    Hashes are keyed by their 64-bit event id (`mmreuse.blockhash.to_event_id`'s rule, applied
    in C): ints from events as they are, digest bytes (from events with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0, or from `mmreuse.hashing`) by their low 64 bits,
    big-endian. A hash stored by several blocks is counted once per block, so it stays until its
    last BlockRemoved. Thread-safe: a subscriber thread applies while others read.

    Caveat: with vLLM's per-request `kv_cache_report_mode="full"`, reused prefix blocks are
    re-announced with BlockStored but never removed twice; such counts only ever over-report,
    which P's consume-time validation catches (a late fallback, never a wrong skip).

    Bounded against a hostile publisher: each medium is a table, so at most `max_media`
    distinct media (names of at most MAX_MEDIUM_CHARS) are held between resets (`clear`,
    AllBlocksCleared); a batch that would exceed that is refused whole.

    Identifiers: per medium, which mm identifiers some held block carries (`may_hold`), read
    off BlockStored's `extra_keys` (vLLM 0.33.0's `to_event_extra_keys`: per block None or a
    tuple of untagged keys, an mm key being `(identifier, offset)`; LoRA names, cache salts and
    prompt-embeds digests are the other items, and are ignored). A held hash carries the
    identifiers of every store of it since it was last absent; it drops them when its count
    reaches zero, so an identifier counts the held hashes carrying it. A block naming more than
    `max_identifiers_per_block` distinct ones (a block of `block_size` tokens overlaps at most
    that many items: pass P's block size where known) makes the medium's identifiers unknown.
    Memory: only hashes that carry an identifier are remembered; a block naming what the
    block before it named shares its tuple, and a medium keeps one string per identifier.

    Readers never wait for a whole batch: `apply` holds the lock for a slice of it at a time
    (SLICE_WORK) and hands it to a waiting reader in between, so a reader may see a batch in
    part: every event before some block applied, nothing after it (the hashes and identifiers
    of a block together), a state P went through, as if the rest had not arrived yet.

    Implements `mmreuse.kvview.KVView` (`match_prefix`, on the GPU medium).
    """

    def __init__(
        self,
        instance: str = "default",
        *,
        max_media: int = 8,
        track_identifiers: bool = False,
        max_identifiers_per_block: int = MAX_EXTRA_KEYS_PER_BLOCK,
    ) -> None:
        self.instance = check_str("instance", instance, nonempty=True)
        self.max_media = check_int("max_media", max_media, 1)
        if not isinstance(track_identifiers, bool):
            fail_type("track_identifiers", "a bool", track_identifiers)
        # Opt-in: following identifiers costs about 0.5-1 us per block that carries one
        # (benchmarks/test_bench_events.py), for a query no caller makes yet (issue 31).
        self.track_identifiers = track_identifiers
        self.max_identifiers_per_block = check_int(
            "max_identifiers_per_block", max_identifiers_per_block, 1, MAX_EXTRA_KEYS_PER_BLOCK
        )
        self._media: dict[str, HashTable] = {}
        # Per medium: event id -> the identifiers that held hash carries (only hashes that
        # carry any), identifier -> how many held hashes carry it (never 0: deleted), and
        # identifier -> itself (the one string object the medium keeps of it).
        self._carried: dict[str, dict[int, tuple[str, ...]]] = {}
        self._ident_counts: dict[str, dict[str, int]] = {}
        self._names: dict[str, dict[str, str]] = {}
        # Media whose identifiers are not known until the next reset (`identifiers_known`).
        self._ids_unknown: set[str] = set()
        self._skips: dict[str, int] = {}
        # Readers take `_lock`; whoever changes the index holds `_writing` too, `apply` for a
        # whole batch (so that the batch's check holds for all its slices).
        self._lock = _ViewLock()
        self._writing = threading.Lock()

    def _table(self, medium: str | None) -> HashTable:
        key = MEDIUM_GPU if medium is None else medium
        table = self._media.get(key)
        if table is None:
            table = self._media[key] = HashTable()
        return table

    def apply(self, batch: KVEventBatch) -> int:
        """Apply a decoded batch, whole or not at all; returns the number of events applied.

        Raises InvalidArgument (a ValueError; InvalidArgumentType for a wrong type) and changes
        nothing if any hash is not bytes >= 8 long or an int in [0, 2**64) (negative ints too),
        an event is of another type, a medium is not a str (or None: GPU) of at most
        MAX_MEDIUM_CHARS, or the batch would leave more than `max_media` media. Readers may see
        it in part meanwhile (the class doc), never a refused one.
        """
        if not isinstance(batch, KVEventBatch):
            fail_type("batch", "a KVEventBatch", batch)
        events = batch.events
        with self._writing:
            self._check_events(events)  # before any change: reads what only writers change
            lock = self._lock
            lock.take()
            try:
                budget = SLICE_WORK
                last: tuple[str, ...] = ()  # the last block's identifiers (shared with the next)
                track = self.track_identifiers
                for e in events:
                    if isinstance(e, BlockStored):
                        hashes = e.block_hashes
                        n = len(hashes)
                        if n and track:
                            budget, last = self._store(e, budget, last)
                        elif n < budget:  # the usual event: within the slice
                            self._table(e.medium).add(hashes, 1)
                            budget -= n + 1
                        else:
                            budget = self._add_hashes(self._table(e.medium), hashes, 0, budget)
                    elif isinstance(e, BlockRemoved):
                        budget = self._apply_removed(e, budget)
                    elif isinstance(e, AllBlocksCleared):
                        self._media.clear()
                        self._forget_identifiers()
                        budget -= 1
                    if budget <= 0:
                        lock.pause()
                        budget = SLICE_WORK
            finally:
                lock.release()
        return len(events)

    def _add_hashes(
        self, table: HashTable, hashes: list[ExternalBlockHash], lo: int, budget: int
    ) -> int:
        """Count `hashes[lo:]` held, `budget` of them at a time, pausing whenever it is spent;
        returns the budget left."""
        n = len(hashes)
        if not lo and n < budget:  # the usual event: within the slice
            table.add(hashes, 1)
            return budget - n - 1
        while True:
            hi = min(n, lo + max(budget, 1))
            table.add(hashes if hi - lo == n else hashes[lo:hi], 1)
            budget -= hi - lo
            lo = hi
            if budget <= 0:
                self._lock.pause()
                budget = SLICE_WORK
            if lo >= n:
                return budget

    def _apply_removed(self, e: BlockRemoved, budget: int) -> int:
        """A BlockRemoved (validated), `budget` hashes at a time, pausing whenever it is spent;
        returns the budget left."""
        key = MEDIUM_GPU if e.medium is None else e.medium
        hashes = e.block_hashes
        n = len(hashes)
        table = self._media.get(key)
        if table is None:  # nothing held there (a BlockRemoved creates no table)
            return budget - 1
        if n < budget:  # the usual event: within the slice
            gone = table.add(hashes, -1)  # hashes no block holds now
            if gone and self.track_identifiers:
                carried = self._carried.get(key)
                if carried:
                    self._release_identifiers(key, carried, table, hashes, gone)
            return budget - n - 1
        lo = 0
        while True:
            hi = min(n, lo + max(budget, 1))
            piece = hashes[lo:hi]
            gone = table.add(piece, -1)
            if gone and self.track_identifiers:
                carried = self._carried.get(key)
                if carried:
                    self._release_identifiers(key, carried, table, piece, gone)
            budget -= hi - lo
            lo = hi
            if budget <= 0:
                self._lock.pause()
                budget = SLICE_WORK
            if lo >= n:
                return budget

    # ---- identifiers ---------------------------------------------------------------------

    def _skip(self, reason: str, n: int = 1) -> None:
        self._skips[reason] = self._skips.get(reason, 0) + n

    def _unknown(self, medium: str, reason: str, n: int) -> None:
        """`medium`'s identifiers cannot be followed any more: forget them until a reset."""
        self._skip(reason, n)
        self._ids_unknown.add(medium)
        self._carried.pop(medium, None)
        self._ident_counts.pop(medium, None)
        self._names.pop(medium, None)

    def _forget_identifiers(self) -> None:
        self._carried.clear()
        self._ident_counts.clear()
        self._names.clear()
        self._ids_unknown.clear()

    def _store(
        self, e: BlockStored, budget: int, last: tuple[str, ...]
    ) -> tuple[int, tuple[str, ...]]:
        """A BlockStored (validated, some hashes) where identifiers are followed: its blocks'
        identifiers and hashes, a slice at a time (`budget` blocks and extra-key items, then
        the slice's hashes, then a pause). Returns the budget left and the last block's
        identifiers (the previous block's, `last`, are shared where equal: an item spans many
        blocks). Never raises on any `extra_keys`: junk is counted in `identifier_skips`.
        Linear in the items: a dict per block, not a scan."""
        medium = MEDIUM_GPU if e.medium is None else e.medium
        table = self._table(e.medium)
        hashes, keys = e.block_hashes, e.extra_keys
        n = len(hashes)
        if medium in self._ids_unknown:
            return self._add_hashes(table, hashes, 0, budget), last
        if keys is None:  # vLLM < 0.17, an offloading connector's medium: nothing to follow
            self._unknown(medium, SKIP_NOT_PUBLISHED, n)
            return self._add_hashes(table, hashes, 0, budget), last
        if (type(keys) is not list and type(keys) is not tuple) or len(keys) != n:
            self._unknown(medium, SKIP_MALFORMED, n)
            return self._add_hashes(table, hashes, 0, budget), last
        if keys.count(None) == n:  # text only: the common case, one C call
            return self._add_hashes(table, hashes, 0, budget), last
        bound = self.max_identifiers_per_block
        carried = self._carried.get(medium)
        if carried is None:  # the medium's three maps come and go together
            carried = self._carried[medium] = {}
            self._ident_counts[medium], self._names[medium] = {}, {}
        counts, names = self._ident_counts[medium], self._names[medium]
        # The slice ends at block `limit` (blocks count 1, the items of an entry of several
        # each 1 too: checked there, and at each window of SLICE_WORK blocks).
        lo = 0  # the first block whose hash is not counted yet
        limit = budget
        idents: tuple[str, ...]
        for w in range(0, n, SLICE_WORK):  # a C call for the window's ids
            if w >= limit:  # the slice is spent: its hashes, then a waiting reader's turn
                table.add(hashes[lo:w], 1)
                self._lock.pause()
                lo, limit = w, w + SLICE_WORK
            part = keys if n <= SLICE_WORK else keys[w : w + SLICE_WORK]
            lim = limit - w  # `limit`, within the window
            ids: list[int] | None = None
            for j, entry in enumerate(part):
                if entry is None:
                    continue
                kind = type(entry)
                m = len(entry) if kind is list or kind is tuple else MAX_EXTRA_KEYS_PER_BLOCK + 1
                if m == 1:  # a block (vLLM's usual: one mm key): the window counts it
                    k = entry[0]
                else:  # items to count (or junk): the slice may end before them
                    if m > MAX_EXTRA_KEYS_PER_BLOCK:
                        self._unknown(medium, SKIP_MALFORMED, 1)
                        return self._add_hashes(table, hashes, lo, w + lim - lo), last
                    if j >= lim:
                        table.add(hashes[lo : w + j], 1)
                        self._lock.pause()
                        lo, lim = w + j, j + SLICE_WORK
                    lim -= m
                    k = None
                if (
                    (type(k) is list or type(k) is tuple)  # vLLM's usual entry: one mm key
                    and len(k) == 2
                    and type(k[0]) is str
                    and type(k[1]) is int
                    and len(last) == 1
                    and k[0] == last[0]
                ):
                    idents = last  # same identifier as the previous block: checked already
                else:
                    found = self._block_identifiers(entry, names)
                    if found is None:
                        self._unknown(medium, SKIP_MALFORMED, 1)
                        return self._add_hashes(table, hashes, lo, w + lim - lo), last
                    if not found:
                        continue
                    idents = last = last if found == last else found
                if ids is None:  # validated already
                    ids = to_event_ids(hashes if n <= SLICE_WORK else hashes[w : w + SLICE_WORK])
                eid = ids[j]
                held = carried.get(eid)
                if held is None:
                    carried[eid] = idents
                    for ident in idents:
                        counts[ident] = counts.get(ident, 0) + 1
                    continue
                if held is idents or held == idents:  # stored again (vLLM's: the same keys)
                    continue
                have = set(held)
                extra = [x for x in idents if x not in have]
                if not extra:
                    continue
                if len(held) + len(extra) > bound:  # a peer naming ever new ones
                    self._unknown(medium, SKIP_MALFORMED, 1)
                    return self._add_hashes(table, hashes, lo, w + lim - lo), last
                carried[eid] = held + tuple(extra)  # the union
                for ident in extra:
                    counts[ident] = counts.get(ident, 0) + 1
            limit = w + lim
        table.add(hashes if not lo else hashes[lo:], 1)
        return limit - n - 1, last

    def _block_identifiers(
        self, entry: list[Any] | tuple[Any, ...], names: dict[str, str]
    ) -> tuple[str, ...] | None:
        """`entry_identifiers` of a stored block, as the medium's strings (`names`: one object
        per identifier counted, the block's about to be), the long ones counted in
        `identifier_skips`; None if malformed or over `max_identifiers_per_block`."""
        if len(entry) == 1:  # one mm key (vLLM's usual entry), the first block of its item
            k = entry[0]
            if (type(k) is list or type(k) is tuple) and len(k) == 2 and type(k[1]) is int:
                ident = k[0]
                if type(ident) is str and 0 < len(ident) <= MAX_IDENT_CHARS:
                    return (names.setdefault(ident, ident),)
        found = entry_identifiers(entry)
        if found is None or len(found[0]) > self.max_identifiers_per_block:
            return None
        idents, long = found
        if long:
            self._skip(SKIP_LONG_IDENT, long)
        return tuple(map(names.setdefault, idents, idents))

    def _release_identifiers(
        self,
        medium: str,
        carried: dict[int, tuple[str, ...]],
        table: HashTable,
        hashes: list[ExternalBlockHash],
        gone: int,
    ) -> None:
        """After removing `hashes` left `gone` of them unheld: those that carried identifiers
        drop them."""
        ids = to_event_ids(hashes)  # one C call; validated already
        hit = carried.keys() & ids
        if not hit:
            return
        all_gone = gone == len(ids)  # then every hash of the event left: no lookups
        counts = self._ident_counts[medium]
        names = self._names[medium]
        for eid in hit:
            if not all_gone and table.get(eid) is not None:
                continue  # another block still holds it
            for ident in carried.pop(eid):
                left = counts[ident] - 1
                if left:
                    counts[ident] = left
                else:
                    del counts[ident]
                    names.pop(ident, None)

    def _check_events(self, events: Any) -> None:
        """Every hash and medium of a batch, and the media it leaves, before anything changes."""
        if not isinstance(events, (list, tuple)):
            fail_type("batch.events", "a list of KV events", events)
        probe, held = HashTable(1), self._media
        media: set[str] | None = None  # the media after the batch, once it adds or clears any
        for e in events:  # exact event types, str media: one pass (the rest: one by one below)
            cls = type(e)
            if cls is BlockStored or cls is BlockRemoved:
                probe.add(e.block_hashes, 0)
                medium = e.medium
                if medium is None:
                    medium = MEDIUM_GPU
                elif type(medium) is not str:
                    break
                if cls is BlockStored and medium not in (held if media is None else media):
                    if len(medium) > MAX_MEDIUM_CHARS:
                        break
                    if media is None:
                        media = set(held)
                    media.add(medium)
            elif cls is AllBlocksCleared:
                media = set()
            else:
                break
        else:
            if media is not None and len(media) > self.max_media:
                self._refuse_media(media)
            return
        self._check_each_event(events)

    def _refuse_media(self, media: set[str]) -> None:
        raise InvalidArgument(
            f"batch names {len(media)} media, more than max_media={self.max_media}: "
            f"{show(sorted(media))}"
        )

    def _check_each_event(self, events: list[Any] | tuple[Any, ...]) -> None:
        """`_check_events` one event at a time, naming the first one refused."""
        probe = HashTable(1)
        media: set[str] | None = None  # the media after the batch, once it adds or clears any
        for i, e in enumerate(events):
            if isinstance(e, (BlockStored, BlockRemoved)):
                probe.add(e.block_hashes, 0)
                medium = e.medium
                if medium is not None and type(medium) is not str:
                    fail_type(f"batch.events[{i}].medium", "a str or None", medium)
                key = MEDIUM_GPU if medium is None else medium
                if isinstance(e, BlockRemoved) or key in (self._media if media is None else media):
                    continue  # a BlockRemoved creates no table
                if len(key) > MAX_MEDIUM_CHARS:
                    raise InvalidArgument(
                        f"batch.events[{i}].medium must be at most {MAX_MEDIUM_CHARS} "
                        f"characters, got {show(key)}"
                    )
                if media is None:
                    media = set(self._media)
                media.add(key)
            elif isinstance(e, AllBlocksCleared):
                media = set()
            else:
                fail_type(
                    f"batch.events[{i}]", "a BlockStored, BlockRemoved or AllBlocksCleared", e
                )
        if media is not None and len(media) > self.max_media:
            self._refuse_media(media)

    @staticmethod
    def _hash_list(block_hashes: Sequence[ExternalBlockHash]) -> Sequence[ExternalBlockHash]:
        if isinstance(block_hashes, (str, bytes, bytearray)) or not isinstance(
            block_hashes, Sequence
        ):
            fail_type("block_hashes", "a sequence of block hashes", block_hashes)
        return block_hashes if isinstance(block_hashes, (list, tuple)) else list(block_hashes)

    def longest_prefix(
        self, block_hashes: Sequence[ExternalBlockHash], medium: str = MEDIUM_GPU
    ) -> int:
        """How many leading hashes of a request are held (what vLLM's prefix cache would hit,
        up to the events not received yet, before its num_tokens-1 cap: see kv_coverage).
        Every hash is validated, those after the first miss too."""
        hashes = self._hash_list(block_hashes)
        check_str("medium", medium)
        with self._lock:
            table = self._media.get(medium)
            if table is not None:
                return table.prefix(hashes)[0]
        check_block_hashes(hashes)  # nothing held there: still validate
        return 0

    def match_prefix(self, block_hashes: Sequence[ExternalBlockHash]) -> PrefixMatch:
        """`KVView.match_prefix`: `longest_prefix` on the GPU medium; no proof (events carry
        hashes, not block generations)."""
        return PrefixMatch(self.longest_prefix(block_hashes, MEDIUM_GPU))

    def contains(self, block_hash: ExternalBlockHash, medium: str = MEDIUM_GPU) -> bool:
        check_str("medium", medium)
        with self._lock:
            table = self._media.get(medium)
            if table is not None:
                return table.get(block_hash) is not None
        to_event_id(block_hash)  # nothing held there: still validate
        return False

    def size(self, medium: str = MEDIUM_GPU) -> int:
        """Distinct hashes held on `medium`."""
        check_str("medium", medium)
        with self._lock:
            table = self._media.get(medium)
            return 0 if table is None else table.live

    def media(self) -> tuple[str, ...]:
        with self._lock:
            return tuple(sorted(m for m, t in self._media.items() if t.live))

    def load(
        self,
        block_ids: Sequence[int],
        counts: Sequence[int],
        medium: str = MEDIUM_GPU,
        identifiers: Mapping[int, Sequence[str]] | None = None,
    ) -> None:
        """Replace everything with a snapshot (`demand_query.KVSnapshot`): `block_ids[i]` (an
        event id) held by `counts[i]` blocks on `medium`.

        `identifiers`: the mm identifiers each held block carries, for the ids that carry any
        (P followed them: `medium`'s identifiers are then known, as if every event had been
        applied from 0); None when the snapshot carries none (an older P, or one that did not
        follow them: unknown until the next reset, as `identifiers_known` says).

        Refused whole (InvalidArgument naming the field; nothing changes) if the lengths differ,
        an id repeats or is not an event id, a count is not an int >= 1, or `identifiers` names
        a block not in `block_ids` (or one twice), or gives a block other than 1 to
        `max_identifiers_per_block` distinct non-empty str identifiers of at most
        MAX_IDENT_CHARS.
        """
        check_str("medium", medium, nonempty=True)
        if len(medium) > MAX_MEDIUM_CHARS:
            raise InvalidArgument(f"medium must be at most {MAX_MEDIUM_CHARS} characters")
        ids = to_event_ids(list(block_ids), "block_ids")
        values = list(counts)
        if len(values) != len(ids):
            raise InvalidArgument(f"{len(ids)} block_ids but {len(values)} counts")
        if values and (set(map(type, values)) != {int} or min(values) < 1):  # in C, then name it
            for i, n in enumerate(values):
                if type(n) is not int or n < 1:
                    raise InvalidArgument(f"counts[{i}] must be an int >= 1, got {show(n)}")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("block_ids repeat an id (a snapshot names each once)")
        names: dict[str, str] = {}
        carried = None if identifiers is None else self._check_carried(identifiers, ids, names)
        table = HashTable(2 * len(ids))
        table.put_many(ids, values)
        idents: dict[str, int] = {}
        for held in (carried or {}).values():
            for ident in held:
                idents[ident] = idents.get(ident, 0) + 1
        with self._writing, self._lock:
            self._media = {medium: table} if ids else {}
            self._forget_identifiers()
            if not ids:
                return
            if carried is None or not self.track_identifiers:
                # which blocks carry what is unknown (an older P's snapshot, or not followed)
                self._ids_unknown.add(medium)
                self._skip(SKIP_SNAPSHOT, len(ids))
                return
            if carried:
                self._carried[medium] = carried
                self._ident_counts[medium] = idents
                self._names[medium] = names

    def _check_carried(
        self, identifiers: Mapping[int, Sequence[str]], ids: list[int], names: dict[str, str]
    ) -> dict[int, tuple[str, ...]]:
        """`load`'s `identifiers`, checked against its block ids: event id -> identifiers (one
        string object per identifier, kept in `names`)."""
        if not isinstance(identifiers, Mapping):
            fail_type("identifiers", "a mapping of block id to identifiers, or None", identifiers)
        if len(identifiers) > len(ids):
            raise InvalidArgument(
                f"identifiers names {len(identifiers)} blocks, more than the {len(ids)} block_ids"
            )
        held = set(ids)
        bound = self.max_identifiers_per_block
        carried: dict[int, tuple[str, ...]] = {}
        for key, idents in identifiers.items():
            eid = to_event_id(key, "identifiers (a block id)")
            if eid not in held:
                raise InvalidArgument(f"identifiers names block {show(key)}, not in block_ids")
            if eid in carried:
                raise InvalidArgument(f"identifiers names block {show(key)} twice")
            field = f"identifiers[{show(key)}]"
            if type(idents) is not list and type(idents) is not tuple:
                fail_type(field, "a list of identifiers", idents)
            if not 1 <= len(idents) <= bound:
                raise InvalidArgument(
                    f"{field} has {len(idents)} identifiers, not 1 to "
                    f"max_identifiers_per_block={bound}"
                )
            for ident in idents:
                if type(ident) is not str or not 1 <= len(ident) <= MAX_IDENT_CHARS:
                    raise InvalidArgument(
                        f"{field} holds {show(ident)}, not a non-empty str of at most "
                        f"{MAX_IDENT_CHARS} characters"
                    )
            if len(set(idents)) != len(idents):
                raise InvalidArgument(f"{field} repeats an identifier: {show(idents)}")
            carried[eid] = tuple([names.setdefault(x, x) for x in idents])
        return carried

    def carriers(self, medium: str = MEDIUM_GPU) -> dict[int, tuple[str, ...]] | None:
        """Every held event id on `medium` that carries identifiers, and which (a copy: what a
        snapshot gives `load`); None where they are not known (`identifiers_known` False)."""
        check_str("medium", medium)
        if not self.track_identifiers:
            return None
        with self._lock:
            if medium in self._ids_unknown:
                return None
            return dict(self._carried.get(medium, {}))

    def counts(self, medium: str = MEDIUM_GPU) -> dict[int, int]:
        """Every event id held on `medium` and how many blocks hold it (for checks and tests)."""
        check_str("medium", medium)
        with self._lock:
            table = self._media.get(medium)
            if table is None:
                return {}
            live = table.vals > 0
            return dict(zip(table.keys[live].tolist(), table.vals[live].tolist(), strict=True))

    def may_hold(self, identifier: str, medium: str = MEDIUM_GPU) -> bool:
        """Whether some held block on `medium` may carry mm `identifier` in its extra keys.

        False means no block this index holds carries it: that P's prefix cache provably has
        none of it only if the caller has checked that the view is complete (no gap, no missed
        batch, a subscriber that is live: the index cannot know); otherwise it may still be
        cached. True where unknown: `identifiers_known(medium)` False (after a `load` without
        identifiers, a store without extra keys, malformed ones), or an identifier longer than
        MAX_IDENT_CHARS (never followed). Like the hashes, it can over-report (see the class's caveat), never under.
        """
        check_str("identifier", identifier)
        check_str("medium", medium)
        if len(identifier) > MAX_IDENT_CHARS:
            return True
        if not self.track_identifiers:
            return True
        with self._lock:
            if medium in self._ids_unknown:
                return True
            counts = self._ident_counts.get(medium)
            return counts is not None and identifier in counts

    def identifiers_known(self, medium: str = MEDIUM_GPU) -> bool:
        """Whether `may_hold(..., medium)` can answer False: not after a `load` without
        identifiers (an older P's snapshot, or one not following them), a BlockStored without `extra_keys` (vLLM < 0.17, offloading media)
        or with malformed ones, until the next `clear` or AllBlocksCleared."""
        check_str("medium", medium)
        if not self.track_identifiers:
            return False
        with self._lock:
            return medium not in self._ids_unknown

    def identifiers(self, medium: str = MEDIUM_GPU) -> dict[str, int]:
        """Every followed identifier on `medium` and how many held hashes carry it (for checks
        and tests; empty where `identifiers_known` is False)."""
        check_str("medium", medium)
        with self._lock:
            return dict(self._ident_counts.get(medium, {}))

    def identifier_skips(self) -> dict[str, int]:
        """How many blocks (or identifiers, for SKIP_LONG_IDENT) were not followed, by reason,
        since construction."""
        with self._lock:
            return dict(self._skips)

    def clear(self) -> None:
        """Forget everything (AllBlocksCleared, a publisher restart, an unrecoverable gap)."""
        with self._writing, self._lock:
            self._media.clear()
            self._forget_identifiers()

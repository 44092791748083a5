"""`mmreuse.integrations.snapshots`: snapshots held for their chunks, paced while the cache
changes, and served from any number of answer threads (no vLLM: a cache of its own)."""

from __future__ import annotations

import subprocess
import sys
import threading

import zmq

from mmreuse.demand_query import (
    MAX_RETRY_AFTER_S,
    DemandError,
    ECSnapshot,
    ECSnapshotQuery,
    decode_answer,
    decode_query,
    encode,
)
from mmreuse.integrations import snapshots
from mmreuse.integrations.control import ControlServer
from mmreuse.integrations.snapshots import ECSnapshots


class Cache:
    """An encoder cache as `EventfulEncoderCacheManager` keeps it, reduced to what a snapshot
    reads: entries changed under a lock, each change published as one batch."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.entries: dict[str, int] = {}
        self.published = 0
        self.pending = False
        self.takes = 0
        self.history: dict[int, list[tuple[str, int, bool]]] = {}  # stamp -> what it held

    def change(self, n: int) -> None:
        with self.lock:
            self.entries[f"img-{n}"] = n % 7 + 1
            if len(self.entries) > 5:
                self.entries.pop(next(iter(self.entries)))
            self.published += 1

    def take(self) -> tuple[int, list[tuple[str, int, bool]]]:
        with self.lock:
            self.takes += 1
            self.pending = False
            held = [(h, n, False) for h, n in self.entries.items()]
            self.history[self.published] = held
            return self.published, held

    def settled(self) -> int | None:
        with self.lock:
            return None if self.pending else self.published

    def snapshots(self) -> ECSnapshots:
        return ECSnapshots(self.take, self.settled, self.lock)


def read_all(ask, sid: str) -> ECSnapshot | DemandError:
    """Every chunk of snapshot `sid`, as one ECSnapshot (or the first error)."""
    first = ask(ECSnapshotQuery(sid))
    if isinstance(first, DemandError):
        return first
    entries = list(first.entries)
    while len(entries) < first.total:
        chunk = ask(ECSnapshotQuery(sid, len(entries)))
        if isinstance(chunk, DemandError):
            return chunk
        assert (chunk.stamp, chunk.total) == (first.stamp, first.total)
        entries += chunk.entries
    return ECSnapshot(sid, first.stamp, first.incarnation, first.total, 0, entries)


def test_unchanged_cache_shares_one_snapshot_and_a_changing_one_is_paced(monkeypatch):
    monkeypatch.setattr(snapshots, "SNAPSHOT_MIN_INTERVAL_S", 1000.0)
    cache = Cache()
    for n in range(3):
        cache.change(n)
    served = cache.snapshots()
    served.chunk = 2
    first = read_all(served.answer, "a")
    assert isinstance(first, ECSnapshot) and first.stamp == 3 and first.total == 3
    # nothing published since: the same copy, not taken again (the engine's lock untouched)
    again = read_all(served.answer, "b")
    assert isinstance(again, ECSnapshot) and again.entries == first.entries
    assert cache.takes == 1
    # published since, within the interval: refused, saying why; a held one keeps serving
    cache.change(3)
    limited = served.answer(ECSnapshotQuery("c"))
    assert isinstance(limited, DemandError)
    assert limited.error == (
        "snapshot: one per 1000.0 s while the encoder cache changes; ask again"
    )
    assert limited.retry_after_s == MAX_RETRY_AFTER_S  # when to ask: the wire's bound at most
    assert isinstance(served.answer(ECSnapshotQuery("b", 2)), ECSnapshot)
    # events pending (recorded, not yet published): changed too
    cache.pending = True
    assert isinstance(served.answer(ECSnapshotQuery("d")), DemandError)
    # past the interval: a fresh one, true as of the last batch
    monkeypatch.setattr(snapshots, "SNAPSHOT_MIN_INTERVAL_S", 0.0)
    fresh = read_all(served.answer, "e")
    assert isinstance(fresh, ECSnapshot) and fresh.stamp == 4 and cache.takes == 2
    assert [e.identifier for e in fresh.entries] == list(cache.entries)


def test_snapshot_no_longer_held_or_past_its_end_says_so():
    served = Cache().snapshots()
    gone = served.answer(ECSnapshotQuery("never", 1))
    assert isinstance(gone, DemandError) and "no longer held" in gone.error
    assert isinstance(served.answer(ECSnapshotQuery("x")), ECSnapshot)
    past = served.answer(ECSnapshotQuery("x", 5))
    assert isinstance(past, DemandError) and past.error == "snapshot: offset 5 > total 0"


def test_two_answer_threads_serve_the_same_snapshots(monkeypatch):
    """A process with both a demand and an encoder-cache snapshot endpoint answers
    ECSnapshotQuery from two ControlServer threads over the same `ECSnapshots`, while the cache
    changes: every snapshot read whole is the cache as of its stamp, nothing fails."""
    monkeypatch.setattr(snapshots, "SNAPSHOT_MIN_INTERVAL_S", 0.0)
    cache = Cache()
    served = cache.snapshots()
    served.chunk = 2

    def handle(payload: bytes) -> bytes:
        query = decode_query(payload)
        assert isinstance(query, ECSnapshotQuery)
        return encode(served.answer(query))

    servers = [ControlServer(f"inproc://h9-ec-{i}", handle).start() for i in range(2)]
    stop = threading.Event()
    results: list[list[ECSnapshot | DemandError]] = [[], []]
    failures: list[BaseException] = []

    def mutate() -> None:
        n = 0
        while not stop.is_set():
            cache.change(n)
            n += 1

    def client(i: int) -> None:
        try:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"inproc://h9-ec-{i}")

            def ask(query: ECSnapshotQuery) -> ECSnapshot | DemandError:
                sock.send(encode(query))
                assert sock.poll(15_000), "no answer"
                return decode_answer(sock.recv())

            for k in range(150):
                results[i].append(read_all(ask, f"{i}-{k}"))
            sock.close(0)
        except BaseException as e:  # reported by the test's thread
            failures.append(e)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(2)]
    writer = threading.Thread(target=mutate)
    writer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    writer.join(timeout=15)
    for server in servers:
        server.stop()
    assert not failures, failures
    whole = [r for rs in results for r in rs if isinstance(r, ECSnapshot)]
    assert len(results[0]) == len(results[1]) == 150 and whole
    for snap in whole:  # each one the cache as of its stamp, whichever thread took it
        assert [(e.identifier, e.num_embeds, e.freeable) for e in snap.entries] == cache.history[
            snap.stamp
        ]
    errors = [r.error for rs in results for r in rs if isinstance(r, DemandError)]
    # the only refusal: a snapshot the other thread's newer ones pushed out between its chunks
    assert all("no longer held" in e for e in errors), errors


def test_the_oldest_held_snapshot_goes_first():
    served = Cache().snapshots()
    for k in range(snapshots.SNAPSHOTS_KEPT + 1):
        assert isinstance(served.answer(ECSnapshotQuery(f"s{k}")), ECSnapshot)
    gone = served.answer(ECSnapshotQuery("s0", 0))
    assert isinstance(gone, ECSnapshot)  # offset 0 opens it again
    pushed = served.answer(ECSnapshotQuery("s1", 1))  # s0 (again) and s2 came after it
    assert isinstance(pushed, DemandError) and "no longer held" in pushed.error


def test_the_shared_pieces_load_neither_vllm_nor_torch():
    code = (
        "import sys, mmreuse.integrations.snapshots, mmreuse.integrations.control; "
        "print([m for m in ('vllm', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

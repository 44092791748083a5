"""`EncoderCacheEventSubscriber`: a P's or an E's encoder-cache events (`mmreuse.events.ec_wire`,
as `EventfulEncoderCacheManager` publishes them) into `EmbeddingAvailability`: a P's entries are
its P-local ones (with their freeable flag), an E's are what that E serves without a forward
(freeable or not: it holds them), the same for every proxy replica that follows its events.

The same socket modes, bounds, gap / replay / resync rules as `KVEventSubscriber` (it is one,
with another payload and another view): a batch applies whole or not at all, a gap the replay
cannot fill or a malformed batch forgets everything known of the instance (it then relearns
from the next events: a false "not cached", never a false "cached"). vLLM's encoder cache is
not scoped by cache salt, so the entries are recorded without a tenant (`cache_salt=None`).

Its snapshot (`SNAPSHOT_KIND` "ec") is bounded by what the view can hold, not by the KV
subscriber's block bound (4M entries of up to 1 KB identifiers, ~4.6 GB): at most
`max_snapshot_entries` entries (default: the sink's `max_entries`, `--e-cache-items` in the
proxy; more would be dropped by the view anyway), refused at the first chunk from its `total`,
and `max_snapshot_bytes` of answers in all (`mmreuse_kv_event_snapshots_total{outcome="bound"}`).

The view it feeds is anything with `EmbeddingAvailability`'s `update_p`, `update_e` and
`forget_instance` (`AvailabilitySink`): `mmreuse.events` does not import
`mmreuse.availability` (nor the reverse).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from ..validate import check_int, check_str, fail_type, fail_value
from .ec_wire import (
    EncoderCacheCleared,
    EncoderCacheEvicted,
    EncoderCacheFreeable,
    EncoderCacheReferenced,
    EncoderCacheStored,
    decode_ec_batch,
)
from .index import RemoteKVIndex
from .subscriber import KVEventSubscriber

SIDES = ("p", "e")  # whose encoder cache: a P's (P-local reuse) or an E's (E-side reuse)
# A snapshot's entries where the sink says nothing of its bound (EmbeddingAvailability does:
# `max_entries`): the proxy's --e-cache-items default.
DEFAULT_SNAPSHOT_ENTRIES = 4096
# Its answers in all, by default: 4,096 entries of 1,024-character identifiers as UTF-8 with
# their msgpack framing (~17 MB) fit; a sink holding more entries is bounded at this.
DEFAULT_SNAPSHOT_BYTES = 64 << 20


class AvailabilitySink(Protocol):
    """What this subscriber feeds: encoder-cache entries (`EmbeddingAvailability`)."""

    def update_p(
        self,
        instance: str,
        *,
        added: Mapping[str, int] | None = None,
        removed: Iterable[str] = (),
        freeable: Iterable[str] = (),
        referenced: Iterable[str] = (),
    ) -> None: ...

    def update_e(
        self, instance: str, *, added: Iterable[str] = (), removed: Iterable[str] = ()
    ) -> None: ...

    def forget_instance(self, kind: str, name: str) -> None: ...


def _snapshot_entries(availability: object, given: int | None) -> int:
    """The entries an encoder-cache snapshot may have: `given`, else what the view holds (the
    sink's `max_entries`), else DEFAULT_SNAPSHOT_ENTRIES."""
    if given is not None:
        return check_int("max_snapshot_entries", given, 0)
    held = getattr(availability, "max_entries", None)
    if isinstance(held, int) and not isinstance(held, bool) and held >= 0:
        return held
    return DEFAULT_SNAPSHOT_ENTRIES


class EncoderCacheEventSubscriber(KVEventSubscriber):
    """SUB on an instance's encoder-cache events, DEALER to its replay socket, into
    `availability`: `side` "p", P-local entries of `instance` with their freeable flag; "e",
    E-side entries of `instance` (E serves them without a forward).

    `max_snapshot_entries` (default: `availability.max_entries`, else 4,096) and
    `max_snapshot_bytes` (default 64 MiB) bound its snapshot (module doc); the KV subscriber's
    `max_snapshot_blocks` is refused here.
    """

    EVENTS = "encoder_cache"
    SNAPSHOT_KIND = "ec"

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        availability: AvailabilitySink,
        instance: str,
        topic: str = "",
        side: str = "p",
        max_snapshot_entries: int | None = None,
        max_snapshot_bytes: int = DEFAULT_SNAPSHOT_BYTES,
        **kwargs: Any,
    ) -> None:
        if side not in SIDES:
            fail_value("side", f"one of {SIDES}", side)
        if not all(
            callable(getattr(availability, m, None))
            for m in ("update_p", "update_e", "forget_instance")
        ):
            fail_type("availability", "an EmbeddingAvailability", availability)
        self.availability, self.side = availability, side
        self.instance = check_str("instance", instance, nonempty=True)
        if "index" in kwargs or "max_media" in kwargs:
            fail_type("index", "nothing: this subscriber feeds an EmbeddingAvailability", kwargs)
        if "max_snapshot_blocks" in kwargs:
            fail_type(
                "max_snapshot_blocks",
                "nothing: an encoder-cache snapshot is bounded by max_snapshot_entries",
                kwargs["max_snapshot_blocks"],
            )
        entries = _snapshot_entries(availability, max_snapshot_entries)
        bytes_bound = check_int("max_snapshot_bytes", max_snapshot_bytes, 1)
        # The base class labels its metrics by its index's instance; this index stays empty.
        super().__init__(
            endpoint,
            replay_endpoint,
            topic,
            RemoteKVIndex(instance),
            max_snapshot_blocks=entries,
            **kwargs,
        )
        self.max_snapshot_bytes = bytes_bound

    def _decode_apply(self, payload: bytes) -> Any:
        batch = decode_ec_batch(payload)  # MalformedBatch (a ValueError): nothing applied
        name, avail = self.instance, self.availability
        if self.side == "e":
            for e in batch.events:
                if isinstance(e, EncoderCacheStored):
                    avail.update_e(name, added=[e.identifier])
                elif isinstance(e, EncoderCacheEvicted):
                    avail.update_e(name, removed=e.identifiers)
                elif isinstance(e, EncoderCacheCleared):
                    avail.forget_instance("e", name)
            return batch  # freeable or referenced again, E holds it all the same
        for e in batch.events:
            if isinstance(e, EncoderCacheStored):
                avail.update_p(name, added={e.identifier: e.num_embeds})
            elif isinstance(e, EncoderCacheFreeable):
                avail.update_p(name, freeable=e.identifiers)
            elif isinstance(e, EncoderCacheReferenced):
                avail.update_p(name, referenced=e.identifiers)
            elif isinstance(e, EncoderCacheEvicted):
                avail.update_p(name, removed=e.identifiers)
            elif isinstance(e, EncoderCacheCleared):
                avail.forget_instance("p", name)
        return batch

    def _reset_view(self) -> None:
        self.availability.forget_instance(self.side, self.instance)

    def _load_snapshot(self, snap: Any) -> None:
        """The encoder cache in place of what is known of it (freeable entries in order)."""
        added: dict[str, int] = {}
        for e in snap.entries:
            if e.identifier in added:
                raise ValueError(f"the snapshot names {e.identifier!r} twice")
            added[e.identifier] = e.num_embeds
        name, avail = self.instance, self.availability
        avail.forget_instance(self.side, name)
        if self.side == "e":
            avail.update_e(name, added=list(added))
            return
        avail.update_p(
            name, added=added, freeable=[e.identifier for e in snap.entries if e.freeable]
        )

    def _clears(self, batch: Any) -> bool:
        return any(type(e) is EncoderCacheCleared for e in batch.events)

    def _update_gauges(self) -> None:
        pass  # EmbeddingAvailability keeps its own gauge (availability_entries)

    def longest_prefix(self, block_hashes: Any, medium: str = "GPU") -> int:
        raise TypeError("an encoder-cache subscriber has no KV view")

    def match_prefix(self, block_hashes: Any) -> Any:
        raise TypeError("an encoder-cache subscriber has no KV view")

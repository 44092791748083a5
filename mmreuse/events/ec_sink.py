"""`EncoderCacheSink`: a P's or an E's encoder-cache events (`mmreuse.events.ec_wire`, as
`EventfulEncoderCacheManager` publishes them), as an `EventStream` delivers them, into
`EmbeddingAvailability`: a P's entries are
its P-local ones (with their freeable flag), an E's are what that E serves without a forward
(freeable or not: it holds them), the same for every proxy replica that follows its events.

The same socket modes, bounds, gap / replay / resync rules as the KV view (one `EventStream`,
with another payload and another sink): a batch applies whole or not at all, a gap the replay
cannot fill or a malformed batch forgets everything known of the instance (it then relearns
from the next events: a false "not cached", never a false "cached"). vLLM's encoder cache is
not scoped by cache salt, so the entries are recorded without a tenant (`cache_salt=None`).

Its snapshot (`snapshot_kind` "ec") is bounded by what the view can hold, not by the KV
view's block bound (4M entries of up to 1 KB identifiers, ~4.6 GB): at most `snapshot_items`
entries (the availability's `max_entries`, `--e-cache-items` in the proxy; more would be
dropped by the view anyway), refused at the first chunk from its `total`, and `snapshot_bytes`
(64 MiB) of answers in all (`mmreuse_kv_event_snapshots_total{outcome="bound"}`);
`StreamLimits.max_snapshot_items` / `max_snapshot_bytes` override both.

The view it feeds is anything with `EmbeddingAvailability`'s `update_p`, `update_e` and
`forget_instance` (`AvailabilityView`): `mmreuse.events` does not import
`mmreuse.availability` (nor the reverse).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from ..errors import InvalidArgument
from ..metrics import Metrics
from ..validate import check_callable, check_str, fail_type, fail_value
from .ec_wire import (
    EncoderCacheCleared,
    EncoderCacheEventBatch,
    EncoderCacheEvicted,
    EncoderCacheFreeable,
    EncoderCacheReferenced,
    EncoderCacheStored,
    decode_ec_batch,
)
from .snapshot import Snapshot

SIDES = ("p", "e")  # whose encoder cache: a P's (P-local reuse) or an E's (E-side reuse)
# A snapshot's entries where the sink says nothing of its bound (EmbeddingAvailability does:
# `max_entries`): the proxy's --e-cache-items default.
DEFAULT_SNAPSHOT_ENTRIES = 4096
# Its answers in all, by default: 4,096 entries of 1,024-character identifiers as UTF-8 with
# their msgpack framing (~17 MB) fit; a sink holding more entries is bounded at this.
DEFAULT_SNAPSHOT_BYTES = 64 << 20


class AvailabilityView(Protocol):
    """What an EncoderCacheSink feeds: encoder-cache entries (`EmbeddingAvailability`)."""

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


def _snapshot_entries(availability: object) -> int:
    """The entries an encoder-cache snapshot may have: what the view holds (the availability's
    `max_entries`), else DEFAULT_SNAPSHOT_ENTRIES."""
    held = getattr(availability, "max_entries", None)
    if isinstance(held, int) and not isinstance(held, bool) and held >= 0:
        return held
    return DEFAULT_SNAPSHOT_ENTRIES


class EncoderCacheSink:
    """An `EventSink` into `availability`: `side` "p", the P-local entries of `instance` with
    their freeable flag; "e", the E-side entries of `instance` (E serves them without a
    forward). Its snapshot bounds: module doc."""

    events = "encoder_cache"
    snapshot_kind = "ec"

    def __init__(self, availability: AvailabilityView, *, instance: str, side: str = "p") -> None:
        if side not in SIDES:
            fail_value("side", f"one of {SIDES}", side)
        if not all(
            callable(getattr(availability, m, None))
            for m in ("update_p", "update_e", "forget_instance")
        ):
            fail_type("availability", "an EmbeddingAvailability", availability)
        self.availability, self.side = availability, side
        self.instance = check_str("instance", instance, nonempty=True)
        self.snapshot_items = _snapshot_entries(availability)
        self.snapshot_bytes: int | None = DEFAULT_SNAPSHOT_BYTES
        self._attached = False

    def attach(self, check: Callable[[], None]) -> None:
        check_callable("check", check)
        if self._attached:
            raise InvalidArgument(
                f"the EncoderCacheSink of {self.instance!r} is already fed by a stream: two "
                "streams into one view would interleave two publishers' batches"
            )
        self._attached = True

    def apply(self, payload: bytes) -> EncoderCacheEventBatch:
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

    def reset(self) -> None:
        self.availability.forget_instance(self.side, self.instance)

    def load(self, snap: Snapshot) -> None:
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

    def clears(self, batch: Any) -> bool:
        return any(type(e) is EncoderCacheCleared for e in batch.events)

    def update_gauges(self, metrics: Metrics) -> None:
        """Nothing here: EmbeddingAvailability keeps its own gauge (availability_entries)."""

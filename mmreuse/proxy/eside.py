"""What E holds, per identifier: the proxy's one home for its E side, chosen once from the
configuration.

- `events`: E's own encoder-cache events (`--e-cache-events-endpoints`): each E's cache as its
  events tell, recorded without a tenant (vLLM's encoder cache is not scoped by cache salt);
  every replica that follows them sees the same.
- `sent`: what this process sent to E, per tenant, as one location (vLLM's example encoders
  share one EC store); replicas each know only their own sends.
- `none`: eager plans nothing on the E side.

Either way a miss costs only an encode: an item E holds but the side does not know of is
planned `e_compute`, and E still gets it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..availability import EmbeddingAvailability
from .config import ProxyConfig
from .metrics import ProxyMetrics
from .views import EncoderView

SENT_LOCATION = "E"  # the E side as one location under `sent`


class ESide:
    """The E side of one proxy process: `kind`, its E views (under `events`), `cached()`."""

    def __init__(
        self,
        config: ProxyConfig,
        availability: EmbeddingAvailability,
        metrics: ProxyMetrics | None,
    ) -> None:
        """`metrics`: the E views' (None: no E views are made, as for a planner alone)."""
        planned = config.planning.policy.reads_view or config.planning.policy.asks_p
        self.kind = "none" if not planned else "events" if config.e_events else "sent"
        self._availability = availability
        self.views: list[EncoderView] = (
            [
                EncoderView(f"E{i}", e, availability=availability, metrics=metrics)
                for i, e in enumerate(config.encoders)
            ]
            if self.kind == "events" and metrics is not None
            else []
        )
        self._locations: Sequence[str] = (
            [f"E{i}" for i in range(len(config.encoders))]
            if self.kind == "events"
            else [SENT_LOCATION]
        )

    def cached(self, identifiers: Iterable[str], cache_salt: str | None = None) -> frozenset[str]:
        """Which of `identifiers` E serves without an encoder forward, for a request of this
        salt (its events are untenanted; what this process sent is per tenant)."""
        if self.kind == "none":
            return frozenset()
        salt = None if self.kind == "events" else cache_salt
        return self._availability.e_holds(self._locations, identifiers, cache_salt=salt)

    def sent(self, identifiers: Sequence[str], cache_salt: str | None) -> None:
        """E was sent these (held from now on under `sent`; E's events say so under `events`)."""
        if self.kind == "sent" and identifiers:
            self._availability.update_e(SENT_LOCATION, added=identifiers, cache_salt=cache_salt)

    def health(self) -> str | None:
        """/health's `e_side`: events (every replica sees the same), per-replica, or None."""
        return {"events": "events", "sent": "per-replica", "none": None}[self.kind]


__all__ = ["SENT_LOCATION", "ESide"]

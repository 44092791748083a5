"""How the simulator accounts for every multimodal occurrence (the rules docs/findings.md uses).

P accounts for a request when it admits it, from two `compute_demand` answers on its true state
at that instant (KV prefix cache, encoder cache, external store), both with the same coverage C:

- `demand`: with what E delivered for this request in P's encoder cache; what P acts on.
- `would`: without those deliveries, and with every identifier this request's own encoder
  forwards delivered counted as absent from the external store (E writes each forward there, so
  that copy exists only because of the forward; one that was there before is excluded too, which
  can only undercount redundancy). `would` is what P needed had E done nothing for this request.

Which occurrence accounts for an identifier: its first occurrence in the request, unless that
one is covered (`KV_COVERED` or `NO_EMBEDS`) and a later, non-duplicate (`dedup_of is None`)
occurrence is not: then that first uncovered one, since it is the one P consumes an embedding
for. Every other occurrence of the identifier lands in `dedup`.

The accounting occurrence lands in exactly one bucket (so buckets sum to `occurrences`):
- `forward`: E ran the encoder for it (delivered by a forward, or a late fallback's forward);
- `kv`: P's KV covers its embed positions (or it has none), nothing was delivered;
- `p_embedding`: P's encoder cache held it;
- `external`: P loaded it from the external store (an `external_loads`);
- `e_cache`: E served it from its cache (delivered, or a late fallback's cache hit);
- `dedup`: another occurrence of the same identifier in the request accounts for it.
A delivery wins over what P would otherwise have used: a delivered item is in P's encoder cache.

Counters next to the buckets:
- `redundant_forwards`: delivered forwards of items `would` did not need from E: KV-covered,
  or in P's encoder cache (never for the external store: `would` leaves forwarded items out);
- `late_fallbacks`: items P needed from E at admission that nobody sent (the policy skipped
  them on stale or early information): P fetches them then (E's cache, else a forward);
- `wrong_skips`: accounting occurrences that `demand` finds uncovered and needing E
  (`E_CACHED` / `E_COMPUTE`) yet that were consumed with no embedding in hand (not delivered,
  not fetched). P's re-check at admission makes this 0 by construction, whatever the policy
  skipped; the count guards that invariant.
A request "needs encoding" (TTFT split) if it got a forward `would` needed, or a late
fallback's forward; every other request is "served by reuse".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from ..demand import Klass, OccurrenceDecision


class Bucket(StrEnum):
    """Where one occurrence's embedding came from (its value is the JSON / table name)."""

    FORWARD = "forward"
    KV = "kv"
    P_EMBEDDING = "p_embedding"
    EXTERNAL = "external"
    E_CACHE = "e_cache"
    DEDUP = "dedup"


class Delivery(StrEnum):
    """How E produced an embedding it sends P (or P fetched in a late fallback)."""

    FORWARD = "forward"
    E_CACHE = "e_cache"

    @property
    def bucket(self) -> Bucket:
        return _DELIVERY_BUCKET[self]


_DELIVERY_BUCKET = {Delivery.FORWARD: Bucket.FORWARD, Delivery.E_CACHE: Bucket.E_CACHE}

BUCKETS: tuple[str, ...] = tuple(b.value for b in Bucket)
COVERED = (Klass.KV_COVERED, Klass.NO_EMBEDS)  # P never touches the encoder for these
NEEDS_E = (Klass.E_CACHED, Klass.E_COMPUTE)


def accounting_occurrences(decisions: Sequence[OccurrenceDecision]) -> dict[str, int]:
    """identifier -> the index of the occurrence that accounts for it (the rule above)."""
    primary: dict[str, int] = {}
    for d in decisions:
        current = primary.get(d.identifier)
        if current is None or (
            d.dedup_of is None and d.klass not in COVERED and decisions[current].klass in COVERED
        ):
            primary[d.identifier] = d.index
    return primary


def needed_from_e(decisions: Sequence[OccurrenceDecision]) -> set[str]:
    """Identifiers whose accounting-relevant (non-duplicate, uncovered) class needs E."""
    return {
        d.identifier
        for d in decisions
        if d.dedup_of is None and d.klass not in COVERED and d.klass in NEEDS_E
    }


@dataclass(slots=True)
class PolicyResult:
    """What one policy's run counted (see the module docstring); `summarize` reports it."""

    policy: str
    requests: int = 0
    occurrences: int = 0
    buckets: dict[str, int] = field(default_factory=lambda: dict.fromkeys(Bucket, 0))
    redundant_forwards: int = 0
    e_requests: int = 0
    transfers: int = 0
    transfer_bytes: int = 0
    external_loads: int = 0
    late_fallbacks: int = 0
    wrong_skips: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    ttft_encode_ms: list[float] = field(default_factory=list)
    ttft_reuse_ms: list[float] = field(default_factory=list)

"""How every multimodal occurrence is accounted for: the rules docs/findings.md uses, in one
function (`account_request`) that the simulator and bench-cluster both call, so that the two
agree by construction.

P accounts for a request when it admits it. The simulator computes two `compute_demand` answers
on P's true state at that instant (KV prefix cache, encoder cache, external store), both with
the same coverage C (bench-cluster reads P's own at admission, its admission records):

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
- `partial_coverage`: accounting occurrences P's prefix cache covered in part (leading embed
  positions cached, the tail not): uncovered, so they need their whole embedding like any
  other; counted because they are where a coverage check that rounds the wrong way would skip;
- `wrong_skips`: accounting occurrences that `demand` finds uncovered and needing E
  (`E_CACHED` / `E_COMPUTE`) yet that were consumed with no embedding in hand (not delivered,
  not fetched). P's re-check at admission makes this 0 by construction, whatever the policy
  skipped; the count guards that invariant.
A request "needs encoding" (TTFT split) if it got a forward `would` needed, or a late
fallback's forward; every other request is "served by reuse".
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from .demand import DemandResult, ItemClass


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

Occurrences = Sequence[tuple[str, ItemClass]]  # (identifier, class) per occurrence, vLLM's order


def occurrences_of(demand: DemandResult) -> list[tuple[str, ItemClass]]:
    """A demand's (identifier, class) per occurrence: what `account_request` reads."""
    return [(d.identifier, d.item_class) for d in demand.decisions]


def accounting_occurrences(occurrences: Occurrences) -> dict[str, int]:
    """identifier -> the index of the occurrence that accounts for it (the rule above)."""
    primary: dict[str, int] = {}
    classes: list[ItemClass] = []
    for i, (ident, cls) in enumerate(occurrences):
        classes.append(cls)
        current = primary.get(ident)
        if current is None or (
            cls is not ItemClass.DUPLICATE and not cls.covered and classes[current].covered
        ):
            primary[ident] = i
    return primary


def needed_from_e(occurrences: Occurrences) -> set[str]:
    """Identifiers whose accounting-relevant (non-duplicate, uncovered) class needs E."""
    return {ident for ident, cls in occurrences if cls.needs_e}


@dataclass(slots=True)
class RequestAccount:
    """One request's accounting (`account_request`).

    Attributes:
        buckets: per occurrence (vLLM's order), where its embedding came from (`dedup` for
            every occurrence but the one accounting for its identifier).
        needs_encoding: it got a forward `would` needed, or a late fallback's forward (the
            TTFT split: else it was served by reuse).
    """

    buckets: list[Bucket] = field(default_factory=list)
    needs_encoding: bool = False
    redundant_forwards: int = 0
    late_fallbacks: int = 0
    wrong_skips: int = 0
    external_loads: int = 0
    partial_coverage: int = 0


def account_request(
    occurrences: Occurrences,
    *,
    delivered: Mapping[str, Delivery],
    would_need_e: Collection[str],
    late: Callable[[int, str, ItemClass], Delivery | None],
    on_external: Callable[[int, str], None] | None = None,
    partial: Collection[int] = (),
) -> RequestAccount:
    """Account for one request's occurrences at P's admission (the module's rules).

    Args:
        occurrences: (identifier, class) per occurrence, vLLM's order: the classes of P's plan
            at admission with what E delivered in hand (the simulator's `demand`, or P's
            admission record).
        delivered: identifier -> how E produced what it delivered for this request.
        would_need_e: identifiers `would` needed from E (what P needed had E done nothing).
        late: called, in order, for an accounting occurrence P needed from E that nobody
            delivered: how P got it late (E's cache or a forward), or None if it did not (a
            wrong skip).
        on_external: called, in order, for an accounting occurrence P loads from the store.
        partial: indexes of the occurrences P's prefix cache covers in part.
    """
    acct = RequestAccount()
    primary = accounting_occurrences(occurrences)
    buckets = acct.buckets
    for i, (ident, cls) in enumerate(occurrences):
        if primary[ident] != i:
            buckets.append(Bucket.DEDUP)
            continue
        if i in partial:
            acct.partial_coverage += 1
        how = delivered.get(ident)
        if how is not None:  # a delivery wins: it is in P's encoder cache
            bucket = how.bucket
            if how is Delivery.FORWARD:
                if ident in would_need_e:
                    acct.needs_encoding = True
                else:
                    acct.redundant_forwards += 1
        elif cls.covered:
            bucket = Bucket.KV
        elif cls is ItemClass.P_LOCAL:
            bucket = Bucket.P_EMBEDDING
        elif cls is ItemClass.P_EXTERNAL:
            bucket = Bucket.EXTERNAL
            acct.external_loads += 1
            if on_external is not None:
                on_external(i, ident)
        else:  # P needs it and nobody sent it: fetched now, or consumed without it
            got = late(i, ident, cls)
            if got is None:
                acct.wrong_skips += 1
                bucket = Bucket.E_CACHE if cls is ItemClass.E_CACHED else Bucket.FORWARD
            else:
                acct.late_fallbacks += 1
                bucket = got.bucket
                acct.needs_encoding |= got is Delivery.FORWARD
        buckets.append(bucket)
    return acct


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
    partial_coverage: int = 0
    ttft_ms: list[float] = field(default_factory=list)
    ttft_encode_ms: list[float] = field(default_factory=list)
    ttft_reuse_ms: list[float] = field(default_factory=list)

    def add(self, acct: RequestAccount) -> None:
        """Count one request's occurrences (its TTFT is added when it is known)."""
        self.occurrences += len(acct.buckets)
        buckets = self.buckets
        for b in acct.buckets:
            buckets[b] += 1
        self.redundant_forwards += acct.redundant_forwards
        self.late_fallbacks += acct.late_fallbacks
        self.wrong_skips += acct.wrong_skips
        self.external_loads += acct.external_loads
        self.partial_coverage += acct.partial_coverage

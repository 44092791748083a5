"""bench-cluster's accounting: where each occurrence's embedding came from, per request, from
what the real cluster did (the simulator's buckets and rules, `mmreuse.accounting`). The runs
themselves are driven by `mmreuse.cluster.bench_drive`, the command by `bench_run`.

P's admission record (`DemandScheduler` with `admission_records`: each item's class at
admission, with the C vLLM admitted it with, whatever the policy) joined with the proxy's
decision (which items E got; the proxy runs in this process, its `after_decide` hook records
it). A delivery wins:
- `forward`: E got the identifier for the first time in the run (E's store is empty at the
  start and keeps what it wrote), or P encoded the item itself;
- `e_cache`: E got it again (its store or encoder cache serves it, no forward);
- otherwise P's class: `kv` (`kv_covered`, `no_embeds`), `p_embedding` (`p_local`),
  `external` (P loaded it from the store), `dedup` (`duplicate`).
`redundant_forwards`: E forwards of items P then found `kv_covered` or `p_local`;
`late_fallbacks`: items P encoded itself that the policy had kept from E; `wrong_skips`: failed
requests with skipped items (0 when P's own order serves what was skipped). E's real forwards
(its iteration log, `e_forwards_probe`) are reported next to the attributed ones. Latencies are
CPU-scale on the tiny local model: the counts are real, the milliseconds are not a GPU's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..accounting import Bucket, Delivery, PolicyResult, account_request
from ..decision import parse_policy
from ..demand import ItemClass
from .classes import Observed

if TYPE_CHECKING:  # simchat loads the simulator, and so torch: attribution needs neither
    from .simchat import ChatRequest

REFERENCE = "reference"  # bench-cluster's name for vLLM's reference proxy, run as a policy
STREAM_ERROR = -2  # a request answered 200 whose stream then failed or broke off


@dataclass(slots=True)
class RequestOutcome:
    """One request as the client and the cluster saw it."""

    rid: int
    status: int = 0
    ttft_ms: float | None = None
    decision: Any = None
    records: list[Any] = field(default_factory=list)  # P's admission records
    e_records: list[Any] = field(default_factory=list)  # E's, one per sub-request it admitted
    text: str = ""  # the streamed answer


def _e_sent(req: ChatRequest, out: RequestOutcome) -> tuple[set[str], dict[str, Delivery] | None]:
    """What E was sent for this request, and how it produced each item when E's own records
    say (None: no E records to go by). E's records are the truth under any proxy (the
    reference's included): an item E encoded is a forward, one its encoder cache or the store
    served is not."""
    if out.e_records:
        how: dict[str, Delivery] = {}
        for rec in out.e_records:
            for i, item in enumerate(rec.items):
                if i in rec.encoded:
                    how[item.identifier] = Delivery.FORWARD
                else:
                    how.setdefault(item.identifier, Delivery.E_CACHE)
        return set(how), how
    decision = out.decision
    if decision is not None:
        return {req.uuids[i] for i in decision.dispatch.e_items}, None
    return set(), None


def observe(req: ChatRequest, out: RequestOutcome) -> Observed:
    """One request's outcome as `mmreuse.cluster.classes` reads it: its TTFT (None unless
    answered), its items, how many items E got for it (E's own records where it keeps them,
    else the proxy's decision), and the proxy's render of it (None: not rendered)."""
    if out.e_records:
        e_items = sum(len(rec.items) for rec in out.e_records)
    elif out.decision is not None:
        e_items = len(out.decision.dispatch.e_items)
    else:
        e_items = 0
    render_s = out.decision.trace.render_s if out.decision is not None else 0.0
    return Observed(
        ttft_ms=out.ttft_ms if out.status == 200 else None,
        items=len(req.uuids),
        e_items=e_items,
        render_ms=render_s * 1e3 if render_s else None,
    )


def attribute(
    policy: str, requests: Sequence[ChatRequest], outcomes: Sequence[RequestOutcome]
) -> PolicyResult:
    """The simulator's accounting (`mmreuse.accounting.account_request`, the same function)
    from what the real cluster did (the module docstring). `policy` "reference" is vLLM's
    reference proxy (it sends E every item)."""
    reference = policy == REFERENCE
    e_at_once = True if reference else parse_policy(policy).e_at_once
    r = PolicyResult(policy if reference else parse_policy(policy).value)
    sent_before: set[str] = set()
    for req, out in zip(requests, outcomes, strict=True):
        r.requests += 1
        sent, how = _e_sent(req, out)
        rec = out.records[0] if out.records else None
        needs_encoding = False
        if rec is None:  # no record (a failed request): count its items as unknown forwards
            r.occurrences += len(req.uuids)
            r.buckets[Bucket.FORWARD] += len(req.uuids)
        else:
            acct = account_request(**_record_account(rec, sent, sent_before, how))
            r.add(acct)
            needs_encoding = acct.needs_encoding
        sent_before |= sent
        # E requests and transfers as the simulator counts them: one per client request that
        # E was asked for something (opportunistic and the reference ask for everything), and
        # one per request E delivered something for
        if sent or (e_at_once and req.uuids):
            r.e_requests += 1
        if sent:
            r.transfers += 1
        decision = out.decision
        if out.status != 200 and decision is not None and decision.dispatch.raw_items:
            r.wrong_skips += 1
        if out.ttft_ms is not None and out.status == 200:
            r.ttft_ms.append(out.ttft_ms)
            (r.ttft_encode_ms if needs_encoding else r.ttft_reuse_ms).append(out.ttft_ms)
    return r


def _record_account(
    rec: Any, sent: set[str], sent_before: set[str], how: dict[str, Delivery] | None = None
) -> dict[str, Any]:
    """`account_request`'s arguments from P's admission record and what E was sent.

    How E produced a delivery: E's own record (`how`) where there is one; else the first time
    E gets an identifier in the run is a forward (E's store starts empty and keeps what it
    wrote, as ECExampleConnector's does) and later ones its store serves. `would`: P's class
    at admission, where a delivered item's `p_external` is the copy E just wrote (the
    simulator's `would` leaves forwarded items out of the store): an E need. A late fallback
    is an item P encoded itself that nobody delivered.
    """
    occurrences = [(item.identifier, item.item_class) for item in rec.items]
    delivered = {
        ident: how[ident]
        if how is not None and ident in how
        else (Delivery.E_CACHE if ident in sent_before else Delivery.FORWARD)
        for ident, _ in occurrences
        if ident in sent
    }
    would_need_e = {
        ident for ident, cls in occurrences if cls.needs_e or cls is ItemClass.P_EXTERNAL
    }
    encoded = {rec.items[i].identifier for i in rec.encoded}

    def late(i: int, ident: str, cls: ItemClass) -> Delivery | None:
        return Delivery.FORWARD if ident in encoded else None

    return {
        "occurrences": occurrences,
        "delivered": delivered,
        "would_need_e": would_need_e,
        "late": late,
        "partial": {i for i, item in enumerate(rec.items) if item.partial},
    }


__all__ = ["REFERENCE", "STREAM_ERROR", "RequestOutcome", "attribute", "observe"]

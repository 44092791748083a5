"""Admission records (`"admission_records": true`): what P did with every request it admitted,
its items' classes at the lookup that admitted it (`demand_query.AdmissionRecord`), kept in a
ring that `RecordsQuery` reads.

A preempted request that resumes is not recorded again: vLLM 0.34 (and 0.33 on Model Runner V2)
lists it among the new requests, 0.33 on V1 among the resumed ones; its record stays the one of
its first admission (and, while that prefill is not done, gets the items encoded for it).
"""

from __future__ import annotations

import collections
import logging
import weakref
from collections.abc import Mapping
from typing import Any

from ...demand_query import (
    DEMAND_ID_KEY,
    AdmissionRecord,
    AdmissionRecords,
    RecordItem,
    RecordsQuery,
    record_items,
)
from .engine_state import occurrences_from_request, plan_at

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["MAX_RECORDS", "AdmissionLog"]

MAX_RECORDS = 65536  # admission records kept (a ring: RecordsQuery says how many were lost)


def demand_id_of(request: Any) -> str | None:
    """The demand query's id a request carries (`vllm_xargs.mmreuse_demand_id`), if any."""
    extra = getattr(getattr(request, "sampling_params", None), "extra_args", None) or {}
    demand_id = extra.get(DEMAND_ID_KEY) if isinstance(extra, dict) else None
    return demand_id if isinstance(demand_id, str) else None


class AdmissionLog:
    """The records of one P. `engine`: vLLM's scheduler (read for its encoder cache and EC
    connector at each lookup); `enabled`: whether P records at all."""

    def __init__(self, engine: Any, enabled: bool) -> None:
        self._engine = engine
        self.enabled = enabled
        self._records: collections.deque[AdmissionRecord] = collections.deque(maxlen=MAX_RECORDS)
        self._next = 0
        self._admitting: dict[str, list[RecordItem]] = {}  # the record's items, at the lookup
        self._prefilling: dict[str, AdmissionRecord] = {}  # admitted, prefill not done
        # the requests recorded, by id (the Request itself, held weakly: gone with it)
        self._recorded: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self.checked: dict[str, bool] = {}  # admitted this step: its proof held

    def note_lookup(self, request: Any, hit: int) -> None:
        """The classes of `request`'s items at this lookup (kept if it is admitted now). A
        request already recorded is resuming after a preemption: nothing new."""
        rid = request.request_id
        held = self._recorded.get(rid)
        if held is not None and held is request:
            self._admitting.pop(rid, None)
            return
        try:
            c = min(hit, request.num_tokens - 1)
            occs = occurrences_from_request(request)
            demand = plan_at(self._engine, occs, request.num_tokens, c)
        except Exception:  # a record is never worth a scheduling step
            logger.exception("mmreuse: admission of %s not recorded", request.request_id)
            return
        self._admitting[rid] = record_items(demand)

    def record(self, output: Any, requests: Mapping[str, Any]) -> None:
        """The requests `output` (a SchedulerOutput) admits, recorded; the items it encodes for
        a prefill in progress, added to its record."""
        for new in getattr(output, "scheduled_new_reqs", ()):
            noted = self._admitting.pop(new.req_id, None)
            request = requests.get(new.req_id)
            if noted is None or request is None:
                continue
            rec = AdmissionRecord(
                seq=self._next,
                request_id=new.req_id,
                num_prompt_tokens=request.num_prompt_tokens,
                num_computed_tokens=int(new.num_computed_tokens),
                items=noted,
                demand_id=demand_id_of(request),
                proof_valid=self.checked.pop(new.req_id, None),
            )
            self._next += 1
            self._records.append(rec)
            self._prefilling[new.req_id] = rec
            self._recorded[new.req_id] = request
        for req_id, inputs in getattr(output, "scheduled_encoder_inputs", {}).items():
            open_rec = self._prefilling.get(req_id)
            if open_rec is not None:
                open_rec.encoded = sorted(set(open_rec.encoded) | set(inputs))
        for req_id in list(self._prefilling):
            request = requests.get(req_id)
            if request is None or request.num_computed_tokens >= request.num_prompt_tokens:
                del self._prefilling[req_id]

    def forget(self, request_id: str) -> None:
        """A finished request: nothing of it is pending any more."""
        self._admitting.pop(request_id, None)
        self._prefilling.pop(request_id, None)

    def since(self, query: RecordsQuery) -> AdmissionRecords:
        """The records from `query.since` on (at most `query.limit`)."""
        held = self._records
        first = held[0].seq if held else self._next
        start = max(query.since, first)
        out = [r for r in held if r.seq >= start][: query.limit]
        nxt = out[-1].seq + 1 if out else max(start, min(query.since, self._next))
        dropped = max(0, first - query.since) if query.since < first else 0
        return AdmissionRecords(query.id, out, nxt, dropped, self.enabled)

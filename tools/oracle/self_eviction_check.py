"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout): rule S, what vLLM's
real Scheduler does when a request's own encoder-cache allocations evict an entry a later item
of the same request would have reused (docs/demand-semantics.md §1.8).

P's encoder cache holds exactly two freeable images, C then D (oldest first), and no free slot.
A request with a new image X followed by C or D is admitted: X's allocation evicts the oldest
freeable entry. Printed as one JSON line per case: the items vLLM's scheduler encodes for the
request, and what `compute_demand` says without and with the cache's space (rule S).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demand_scheduler_check import (
    BLOCK,
    PAD,
    make_scheduler,
    request,
    runner_output,
    tiny_model_dir,
)

from mmreuse.integrations.vllm import (
    availability_from_engine,
    encoder_cache_space,
    occurrences_from_request,
)
from mmreuse.plan import GivenCoverage, plan_admission

IMAGE = 16  # embeds per image; the encoder cache holds two


def prompt(items: list[str], salt: int) -> tuple[list[int], list[tuple[str, int, int]]]:
    tokens = [1, 2, 3 + salt]
    placed = []
    for ident in items:
        placed.append((ident, len(tokens), IMAGE))
        tokens += [PAD] * IMAGE
    return [*tokens, 5, 6, 7], placed


def run_to_end(s: Scheduler, req) -> list[int]:
    """Add `req`, step until it finishes; the items vLLM encoded for it."""
    s.add_request(req)
    encoded: set[int] = set()
    for _ in range(20):
        out = s.schedule()
        encoded |= set(out.scheduled_encoder_inputs.get(req.request_id, ()))
        s.update_from_output(out, runner_output(out))
        if not s.has_requests():
            break
    return sorted(encoded)


def case(second: str) -> dict:
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    s = make_scheduler(Scheduler, tiny_model_dir(), num_blocks=64, cache_size=2 * IMAGE)
    first = run_to_end(s, request("r0", *prompt(["C", "D"], 0), hasher))
    ecm = s.encoder_cache_manager
    before = {"freeable": list(ecm.freeable), "free": ecm.num_free_slots}
    r1 = request("r1", *prompt(["X", second], 1), hasher)
    occs = occurrences_from_request(r1)
    avail = availability_from_engine(ecm, None, [o.identifier for o in occs])
    plans = {}
    for name, space in (("without_rule_s", None), ("rule_s", encoder_cache_space(ecm))):
        demand = plan_admission(
            num_prompt_tokens=r1.num_tokens,
            occurrences=occs,
            availability=avail,
            coverage=GivenCoverage(0),
            encoder_cache=space,
        ).demand
        plans[name] = {
            "classes": [d.klass.value for d in demand.decisions],
            "needs_encoder": [d.index for d in demand.decisions if d.klass.needs_e],
            "self_evicted": list(demand.self_evicted),
        }
    return {
        "case": f"X then {second}",
        "first_request_encoded": first,
        "cache_before": before,
        "vllm_encoded": run_to_end(s, r1),
        **plans,
    }


if __name__ == "__main__":
    for second in ("C", "D"):
        print(json.dumps(case(second)))

"""Instructions per call of `compute_demand` (1, 8 and 64 occurrences), of `plan_admission`
(C looked up, `lookup`, or given, `given`) and of the `index` decision (32k tokens, 16 images,
half the view), under valgrind's callgrind: figures the machine's load does not move, for A/B
between two trees.

Every figure runs once (set-up and warm-up), then `EXTRA[figure]` more calls of the one named;
the run named `none` makes only the first calls. Per call = (I(figure) - I(none)) / EXTRA, from
the main thread's count (`--separate-threads=yes`: OpenBLAS's idle workers spin at random):

    cd TREE && PYTHONHASHSEED=0 PYTHONPATH=TREE valgrind --tool=callgrind \\
        --separate-threads=yes --callgrind-out-file=/tmp/cg.FIG.out \\
        .venv/bin/python benchmarks/decision_instructions.py FIG     # FIG: none cd1 cd8 cd64 lookup given index

It reuses the tree's own benchmark set-ups (`test_bench_demand.make_request`,
`test_bench_proxy`'s `planner` fixture and `_decide`); the `plan_admission` calls are written
for both of its signatures (keywords before issue 33, a coverage record since), so that a tree
from before runs the same calls.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import test_bench_demand as bench_demand
import test_bench_proxy as bench_proxy

from mmreuse import compute_demand, plan
from mmreuse.demand import Availability
from mmreuse.kvview import PrefixMatch
from mmreuse.occurrence import MMOccurrence

EXTRA = {"cd1": 2000, "cd8": 1000, "cd64": 300, "lookup": 2000, "given": 2000, "index": 30}


class _HalfView:
    """A KVView holding the first half of any request's blocks."""

    def match_prefix(self, block_hashes):
        return PrefixMatch(len(block_hashes) // 2, None)


def plan_calls() -> dict:
    """plan_admission for 3,000 tokens with 2 images: C looked up from 187 given hashes (half
    held), or given."""
    n, view, avail = 3000, _HalfView(), Availability()
    occs = [MMOccurrence(identifier=f"img{i}", offset=100 + 700 * i, length=576) for i in range(2)]
    hashes = tuple(range(1, n // 16 + 1))
    common = {"num_prompt_tokens": n, "occurrences": occs, "availability": avail}
    if hasattr(plan, "KVLookup"):  # since issue 33
        return {
            "lookup": lambda: plan.plan_admission(
                **common, coverage=plan.KVLookup(view, block_hashes=hashes, block_size=16)
            ),
            "given": lambda: plan.plan_admission(**common, coverage=plan.GivenCoverage(1000)),
        }
    lookup = {"view": view, "block_hashes": hashes, "block_size": 16}
    given = {"num_computed_tokens": 1000}
    return {
        "lookup": lambda: plan.plan_admission(**common, **lookup),
        "given": lambda: plan.plan_admission(**common, **given),
    }


def main(which: str) -> None:
    if which != "none" and which not in EXTRA:
        raise SystemExit(f"figure must be none or one of {sorted(EXTRA)}, got {which!r}")
    calls = {}
    for k in (1, 8, 64):
        occs, n, c, avail = bench_demand.make_request(k)
        calls[f"cd{k}"] = lambda o=occs, n=n, c=c, a=avail: compute_demand(o, n, c, a)
    planner, rendered, req = bench_proxy.planner.__wrapped__(SimpleNamespace(param=0.5))
    items = req["messages"][0]["content"][::2]
    calls["index"] = lambda: bench_proxy._decide(planner, rendered, items)
    calls.update(plan_calls())
    for f in calls.values():
        f()
    if which != "none":
        for _ in range(EXTRA[which]):
            calls[which]()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "none")

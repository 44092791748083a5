"""mmreuse: avoid redundant encoder work in multimodal Encoder/Prefill/Decode serving.

The top level is the core a caller plans with: `BlockHasher` (vLLM-exact block hashes;
`mmreuse.hashing`, the hash types in `mmreuse.blockhash`), `MMOccurrence`, `compute_demand`
and `kv_coverage` over an `Availability` (`mmreuse.demand`), and `plan_admission`
(`mmreuse.plan`). Around it, each in its own package: the live view of P and E from their
events (`mmreuse.events`, `mmreuse.availability`), the EPD proxy (`mmreuse.proxy`), the
plug-ins loaded into vLLM (`mmreuse.integrations`), the simulator (`mmreuse.sim`) and the
real-cluster harness (`mmreuse.cluster`); `mmreuse` on the command line (`mmreuse.cli`).
"""

from ._version import __version__
from .demand import (
    Availability,
    DemandResult,
    EncoderCacheSpace,
    ItemClass,
    OccurrenceDecision,
    compute_demand,
    kv_coverage,
)
from .hashing import BlockHasher, to_event_id
from .occurrence import MMOccurrence
from .plan import AdmissionPlan, plan_admission

__all__ = [
    "AdmissionPlan",
    "Availability",
    "BlockHasher",
    "DemandResult",
    "EncoderCacheSpace",
    "ItemClass",
    "MMOccurrence",
    "OccurrenceDecision",
    "__version__",
    "compute_demand",
    "kv_coverage",
    "plan_admission",
    "to_event_id",
]

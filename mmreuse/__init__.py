"""mmreuse: avoid redundant encoder work in multimodal Encoder/Prefill/Decode serving.

Parts: `mmreuse.hashing` (vLLM-exact block hashes), residency, demand and the simulator.
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

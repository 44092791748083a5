"""mmreuse: avoid redundant encoder work in multimodal Encoder/Prefill/Decode serving.

The top level holds the core: vLLM-exact block hashes (`mmreuse.hashing`), `compute_demand` and
admission plans. Around it: the live view of P and E from their events (`mmreuse.events`,
`mmreuse.availability`), the EPD proxy (`mmreuse.proxy`), the plug-ins loaded into vLLM
(`mmreuse.integrations`), the simulator (`mmreuse.sim`) and the real-cluster harness
(`mmreuse.cluster`); `mmreuse` on the command line (`mmreuse.cli`).
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

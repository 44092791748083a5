"""mmreuse: avoid redundant encoder work in multimodal Encoder/Prefill/Decode serving.

Parts: `mmreuse.hashing` (vLLM-exact block hashes), residency, demand and the simulator.
"""

from .hashing import BlockHasher, to_event_id
from .occurrence import MMOccurrence

__version__ = "0.1.0"

__all__ = ["BlockHasher", "MMOccurrence", "to_event_id", "__version__"]

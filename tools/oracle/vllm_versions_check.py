"""Run in a vLLM venv (PYTHONPATH = the mmreuse checkout): the plug-ins' start-up checks
against the real vLLM they run in (tests/integrations/test_vllm_versions.py runs it in each
oracle venv: 0.33.0, 0.34.0).

    python tools/oracle/vllm_versions_check.py SCENARIO

Prints one JSON line. Scenarios (each in its own process: they patch vLLM):
- `as-is`: the running vLLM's schedulers pass DemandScheduler's check; what it logged; the
  fast hasher's scheme; every public scheduler method locked or known read-only; its
  EncoderCacheManager passes EventfulEncoderCacheManager's check (`ec`).
- `new-method`: a public method added to vLLM's Scheduler: DemandScheduler refuses to start
  (before vLLM's __init__ runs), naming it; with the config override and with the environment
  override it gets past the check (to vLLM's __init__, which the stand-in config fails).
- `version:X`: vllm.__version__ faked to X: what DemandScheduler, the fast hasher's
  `register()` and `fast_request_block_hasher` do, and which scheme the hashes are.
- `ec-version:X`, `ec-new-method`, `ec-new-init`: EventfulEncoderCacheManager on a vLLM
  whose version is faked to X, whose EncoderCacheManager has a public method more, or whose
  EncoderCacheManager.__init__ takes another argument (its create_manager passing it): what
  `create_manager` gives vLLM (vLLM's own manager publishing nothing, or the plug-in's,
  publishing) without, with the config and with the environment override; what it logged.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from types import SimpleNamespace

import vllm
from vllm.v1.core import kv_cache_utils as K
from vllm.v1.core.sched.scheduler import Scheduler

from mmreuse.errors import InvalidArgument
from mmreuse.integrations import vllm_hasher, vllm_versions
from mmreuse.integrations.demand.scheduler import _LOCKED, AsyncDemandScheduler, DemandScheduler


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


LOG = _Lines()
for name in (
    vllm_versions.logger.name,
    vllm_hasher.logger.name,
    "vllm.mmreuse.integrations.vllm_ec",
):
    logging.getLogger(name).addHandler(LOG)
    logging.getLogger(name).setLevel(logging.DEBUG)


def config(ours: dict | None = None, async_: bool = False) -> SimpleNamespace:
    """Enough of a VllmConfig for DemandScheduler's check (vLLM's __init__ then fails on it)."""
    return SimpleNamespace(
        additional_config={"mmreuse": ours or {}},
        scheduler_config=SimpleNamespace(async_scheduling=async_),
    )


def construct(cfg: SimpleNamespace) -> dict:
    """What DemandScheduler(cfg) does: refused by the check, or past it (into vLLM's
    __init__, which fails on the stand-in config with something that is not ours)."""
    try:
        DemandScheduler(cfg)
    except InvalidArgument as exc:
        return {"outcome": "refused", "error": str(exc)}
    except Exception as exc:
        return {"outcome": "past_check", "error": f"{type(exc).__name__}: {exc}"}
    return {"outcome": "constructed"}


def as_is() -> dict:
    locked = set(_LOCKED)
    surfaces = {
        vllm_versions.scheduler_kind(c): vllm_versions.scheduler_surface(c)
        for c in (DemandScheduler, AsyncDemandScheduler)
    }
    public = {n for s in surfaces.values() for n in s if not n.startswith("_")}
    return {
        "version": vllm.__version__,
        "checked": [
            vllm_versions.check_running_scheduler(c, False, _LOCKED)
            for c in (DemandScheduler, AsyncDemandScheduler)
        ],
        "problems": {
            k: vllm_versions.check_scheduler(vllm.__version__, s, _LOCKED, k)
            for k, s in surfaces.items()
        },
        "loose": sorted(public - locked - set(vllm_versions.UNLOCKED)),
        "locked_and_unlocked": sorted(locked & set(vllm_versions.UNLOCKED)),
        "locked_not_wrapped": sorted(
            n for n in _LOCKED if hasattr(Scheduler, n) and n not in vars(DemandScheduler)
        ),
        "scheme": vllm_hasher._running_scheme().name,
        "ec_problems": vllm_versions.check_encoder_cache(vllm.__version__, ec_surface()),
        "ec": ec_manager(),
        "log": LOG.lines,
    }


def ec_surface() -> dict[str, str]:
    from mmreuse.integrations.vllm_ec import EventfulEncoderCacheManager

    manager = EventfulEncoderCacheManager(cache_size=1)
    return vllm_versions.encoder_cache_surface(
        EventfulEncoderCacheManager, manager._vllm_attributes
    )


def new_method() -> dict:
    def drain_everything(self, budget, *, force=False):  # state-changing, say
        return None

    Scheduler.drain_everything = drain_everything  # type: ignore[attr-defined]
    out: dict = {"version": vllm.__version__, "refused": construct(config())}
    out["config_override"] = construct(config({"allow_unverified_vllm": True}))
    os.environ[vllm_versions.ALLOW_ENV] = "1"
    out["env_override"] = construct(config())
    out["log"] = LOG.lines
    return out


def faked_version(version: str) -> dict:
    vllm.__version__ = version
    out: dict = {"scheduler": construct(config())}
    before = K.get_request_block_hasher
    try:
        vllm_hasher.register()
        out["register"] = {"outcome": "registered"}
    except InvalidArgument as exc:
        out["register"] = {"outcome": "refused", "error": str(exc)}
    out["register"]["replaced"] = K.get_request_block_hasher is not before
    out["hashes"] = hashes_scheme()
    # a DemandScheduler started with the config override: its query hasher follows it
    out["scheduler_overridden"] = construct(config({"allow_unverified_vllm": True}))
    out["hashes_overridden"] = hashes_scheme()
    out["log"] = LOG.lines
    return out


def hashes_scheme() -> dict:
    """The scheme `fast_request_block_hasher` hashed with: its hashes of a request with two
    images, and of one with a LoRA adapter too, next to mmreuse's BlockHasher under each
    scheme (or its refusal)."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    from mmreuse.hashing import SCHEMES, BlockHasher, MMOccurrence

    K.init_none_hash(sha256)
    try:
        ours = vllm_hasher.fast_request_block_hasher(16, sha256)
    except InvalidArgument as exc:
        return {"outcome": "refused", "error": str(exc)}
    tokens = [(7 * i) % 1000 for i in range(100)]
    spans = [(5, 20), (40, 30)]
    mm = [MMOccurrence(f"img{k}", o, n) for k, (o, n) in enumerate(spans)]
    seed = os.environ.get("PYTHONHASHSEED")
    out: dict = {"outcome": "hashed"}
    for case, lora in (("schemes", None), ("lora_schemes", ("ad", 7, "/p/ad"))):
        feats = [
            MultiModalFeatureSpec(
                data=None,
                modality="image",
                identifier="".join(list(m.identifier)),  # fresh objects, as after the wire
                mm_position=PlaceholderRange(m.offset, m.length),
            )
            for m in mm
        ]
        req = Request(
            request_id="r",
            prompt_token_ids=tokens,
            sampling_params=SamplingParams(max_tokens=4),
            pooling_params=None,
            mm_features=feats,
            lora_request=LoRARequest(*lora) if lora else None,
            block_hasher=ours,
        )
        got = [h.hex() for h in req.block_hashes]
        keys = {"lora_name": lora[0], "lora_int_id": lora[1], "lora_path": lora[2]} if lora else {}
        out[case] = [
            name
            for name in SCHEMES
            if got
            == [
                h.hex()
                for h in BlockHasher("sha256", 16, seed=seed, scheme=name).hash_prompt(
                    tokens, mm=mm, **keys
                )
            ]
        ]
    out["fast"], out["vllm"] = vllm_hasher.STATS["fast"], vllm_hasher.STATS["vllm"]
    return out


def ec_manager(ours: dict | None = None) -> dict:
    """What EventfulEncoderCacheManager.create_manager gives vLLM (P's settings `ours`, an
    events endpoint among them): which class, whether it publishes, and that it works."""
    import socket

    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
    from vllm.v1.request import Request

    from mmreuse.integrations.vllm_ec import EventfulEncoderCacheManager

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    cfg = SimpleNamespace(
        additional_config={"mmreuse": {"encoder_cache_events_endpoint": f"tcp://*:{port}",
                                       **(ours or {})}},
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )  # fmt: skip
    try:
        m = EventfulEncoderCacheManager.create_manager(cache_size=32, vllm_config=cfg)
    except Exception as exc:
        return {"outcome": "raised", "error": f"{type(exc).__name__}: {exc}"}
    feat = MultiModalFeatureSpec(
        data=None, modality="image", identifier="img", mm_position=PlaceholderRange(2, 8)
    )
    req = Request("r", [1] * 16, SamplingParams(max_tokens=1), None, mm_features=[feat])
    ok = m.can_allocate(req, 0, 100, 0)  # the manager works as vLLM's: a hit after allocate
    m.allocate(req, 0)
    out = {
        "outcome": "created",
        "class": type(m).__name__,
        "vllms_own": type(m) is EncoderCacheManager,
        "publisher": getattr(m, "publisher", None) is not None,
        "works": ok and m.check_and_update_cache(req, 0) and "img" in m.cached,
    }
    m.get_freed_mm_hashes()
    if out["publisher"]:
        out["published"] = m.published
        m.publisher.shutdown()
    return out


def ec_scenario(scenario: str) -> dict:
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    if scenario.startswith("ec-version:"):
        vllm.__version__ = scenario.split(":", 1)[1]
    elif scenario == "ec-new-method":
        EncoderCacheManager.evict_all = lambda self, now=False: None  # type: ignore[attr-defined]
    elif scenario == "ec-new-init":
        init = EncoderCacheManager.__init__

        def new_init(self, cache_size, budget):
            init(self, cache_size)

        EncoderCacheManager.__init__ = new_init  # type: ignore[method-assign]
        EncoderCacheManager.create_manager = classmethod(  # type: ignore[method-assign]
            lambda cls, *, cache_size, vllm_config: cls(cache_size=cache_size, budget=1)
        )
    else:
        sys.exit(f"unknown scenario {scenario!r}")
    out = {"version": vllm.__version__, "plain": ec_manager()}
    out["config_override"] = ec_manager({"allow_unverified_vllm": True})
    os.environ[vllm_versions.ALLOW_ENV] = "1"
    out["env_override"] = ec_manager()
    os.environ[vllm_versions.ALLOW_ENV] = "maybe"
    out["env_mistyped"] = ec_manager()
    out["log"] = LOG.lines
    return out


def main() -> None:
    scenario = sys.argv[1]
    if scenario == "as-is":
        out = as_is()
    elif scenario == "new-method":
        out = new_method()
    elif scenario.startswith("version:"):
        out = faked_version(scenario.split(":", 1)[1])
    elif scenario.startswith("ec-"):
        out = ec_scenario(scenario)
    else:
        sys.exit(f"unknown scenario {scenario!r}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()

"""The plug-ins know their vLLM: DemandScheduler refuses a scheduler it was not verified with
(mmreuse.integrations.vllm_versions), the fast hasher picks the running vLLM's hash scheme
and refuses one it has none for (mmreuse.hashing.schemes.scheme_for_vllm).

Pure tests here (no vLLM, no torch); the oracle tests run tools/oracle/vllm_versions_check.py
in the vLLM 0.33.0 venv: the real schedulers pass, a method added to vLLM's Scheduler or a
faked version is refused, naming what differs, and the overrides get past the check."""

from __future__ import annotations

import ast
import json
import logging
import os

import pytest

from mmreuse.errors import InvalidArgument
from mmreuse.hashing.schemes import SCHEMES, scheme_for_vllm, vllm_ranges, vllm_version_key
from mmreuse.integrations import vllm_versions as V
from mmreuse.integrations.vllm_hasher import scheme_for_running_vllm
from tests.support.oracle import oracle_run
from tests.support.paths import REPO


def _locked() -> tuple[str, ...]:
    """demand.scheduler._LOCKED, read from its source (importing it needs vLLM)."""
    tree = ast.parse((REPO / "mmreuse/integrations/demand/scheduler.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LOCKED" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("no _LOCKED in demand/scheduler.py")


LOCKED = _locked()


# ---- scheme per vLLM version -----------------------------------------------------------------


@pytest.mark.parametrize(
    "version, scheme",
    [
        ("0.34.0", "vllm-0.33"),  # TokenBuffer tokens, the same keys
        ("0.34.0+cpu", "vllm-0.33"),
        ("0.34.0rc1", "vllm-0.33"),
        ("0.33.1", "vllm-0.33"),
        ("0.33.0", "vllm-0.33"),
        ("0.32.0", "vllm-0.33"),
        ("0.32.0+cpu", "vllm-0.33"),  # a local build is its release
        ("0.31.0", "vllm-0.33"),
        ("0.33", "vllm-0.33"),
        ("0.33.0rc1", "vllm-0.33"),  # before 0.33.0, after 0.32.x
        ("0.33.0.dev12+g1a2b3c", "vllm-0.33"),
        ("0.30.0", "vllm-0.30"),
        ("0.29.0", "vllm-0.30"),
        ("0.28.0", "vllm-0.28"),
        ("0.19.0", "vllm-0.28"),
        ("0.18.1", "vllm-0.18"),
        ("0.16.0", "vllm-0.11"),
        ("0.12.0.post1", "vllm-0.11"),
        ("0.11.1", "vllm-0.11"),
        ("0.11.0", "vllm-0.10"),
        ("0.10.2", "vllm-0.10"),
    ],
)
def test_each_vllm_version_gets_its_generations_scheme(version, scheme):
    assert scheme_for_vllm(version).name == scheme
    assert scheme_for_running_vllm(version, environ={}).name == scheme


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_every_scheme_range_is_its_own_and_matches_its_text(name):
    s = SCHEMES[name]
    assert s.vllm_versions.startswith(f"{s.vllm_min} - {s.vllm_max}")
    assert scheme_for_vllm(s.vllm_min) is s and scheme_for_vllm(s.vllm_max) is s
    for other in SCHEMES.values():  # the ranges do not overlap
        if other is not s:
            assert not (
                vllm_version_key(other.vllm_min)
                <= vllm_version_key(s.vllm_min)
                <= vllm_version_key(other.vllm_max)
            )


@pytest.mark.parametrize(
    "version, nearest",
    [
        ("0.35.0", "vllm-0.33"),
        ("0.34.1", "vllm-0.33"),
        ("0.34.0.post1", "vllm-0.33"),
        ("0.35.0.dev3+gabc", "vllm-0.33"),
        ("0.31.0rc1", "vllm-0.30"),  # before the first 0.33-scheme release: not known
        ("0.10.1", "vllm-0.10"),
        ("0.9.2", "vllm-0.10"),
    ],
)
def test_a_version_in_no_range_is_refused_naming_it(version, nearest):
    with pytest.raises(InvalidArgument) as err:
        scheme_for_vllm(version)
    msg = str(err.value)
    assert msg.startswith("vllm_version must be") and repr(version) in msg
    assert "vllm-0.33: 0.31.0 - 0.34.0" in msg and "vllm-0.10: 0.10.2 - 0.11.0" in msg
    assert scheme_for_vllm(version, nearest=True).name == nearest


@pytest.mark.parametrize("bad", ["banana", "", "0.33.0 foo", "1!0.33.0", None, 33, b"0.33.0"])
def test_a_malformed_version_is_refused(bad):
    with pytest.raises(InvalidArgument, match=r"^vllm_version must be a version string"):
        scheme_for_vllm(bad)


def test_version_order_is_pep_440s():
    order = ["1.0.dev1", "1.0a1", "1.0rc1.dev1", "1.0rc1", "1.0", "1.0.post1.dev1", "1.0.post1"]
    keys = [vllm_version_key(v) for v in order]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert vllm_version_key("0.32.0+cpu") == vllm_version_key("0.32.0") == vllm_version_key("0.32")
    assert vllm_version_key("0.9.0") < vllm_version_key("0.10.0")  # numeric, not text


def test_the_fast_hasher_refuses_an_unknown_vllm_unless_told(caplog):
    with pytest.raises(InvalidArgument) as err:
        scheme_for_running_vllm("0.35.0", environ={})
    msg = str(err.value)
    assert msg.startswith("vllm.__version__ must be") and "got '0.35.0'" in msg
    assert vllm_ranges() in msg and "MMREUSE_ALLOW_UNVERIFIED_VLLM=1" in msg
    with caplog.at_level(logging.WARNING, logger="vllm.mmreuse.integrations.vllm_hasher"):
        got = scheme_for_running_vllm("0.35.0", environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": "1"})
    assert got.name == "vllm-0.33"
    assert any("0.35.0" in r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    with pytest.raises(InvalidArgument, match="MMREUSE_ALLOW_UNVERIFIED_VLLM must be"):
        scheme_for_running_vllm("0.35.0", environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": "maybe"})


# ---- DemandScheduler's scheduler check ---------------------------------------------------------


NEWEST = max(V.VERIFIED, key=vllm_version_key)  # an unverified vLLM is compared with it
UNVERIFIED = "0.35.0"  # the canonical vLLM no plug-in was verified with


def test_every_verified_vllm_is_recorded_for_both_schedulers():
    assert set(V.VERIFIED) == {"0.32.0", "0.33.0", "0.34.0"}
    for version, kinds in V.VERIFIED.items():
        assert set(kinds) == {"Scheduler", "AsyncScheduler"}, version
        for surface in kinds.values():
            # the methods the lock is about, and the one private method DemandScheduler hooks
            assert {"schedule", "update_from_output", "add_request", "finish_requests"} <= set(
                surface
            )
            assert "_get_local_prefix_cache_hit" in surface


def test_every_recorded_public_method_is_locked_or_known_read_only():
    assert not set(LOCKED) & set(V.UNLOCKED)
    for version, kinds in V.VERIFIED.items():
        for kind, surface in kinds.items():
            public = {n for n in surface if not n.startswith("_")}
            assert public <= set(LOCKED) | set(V.UNLOCKED), (version, kind)
    recorded = {n for kinds in V.VERIFIED.values() for s in kinds.values() for n in s}
    # nothing classified that no verified vLLM has
    assert set(V.UNLOCKED) <= recorded and set(LOCKED) <= recorded


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0", "0.32.0"])
@pytest.mark.parametrize("kind", ["Scheduler", "AsyncScheduler"])
def test_a_verified_scheduler_passes(version, kind):
    surface = V.VERIFIED[version][kind]
    assert V.check_scheduler(version, surface, LOCKED, kind) == []
    assert V.check_scheduler(version + "+cu128", surface, LOCKED, kind) == []


def test_what_differs_is_named():
    ref = V.VERIFIED["0.33.0"]["Scheduler"]
    newer = {**ref, "drain": "(self, budget)", "schedule": "(self, throttle_prefills=..., x)"}
    del newer["reset_encoder_cache"]
    problems = V.check_scheduler("0.33.0", newer, LOCKED)
    assert problems == [
        "Scheduler methods new (vs 0.33.0): drain(self, budget)",
        "Scheduler methods missing (vs 0.33.0): reset_encoder_cache",
        "Scheduler signatures differ (vs 0.33.0): schedule(self, throttle_prefills=..., x) "
        "(verified: schedule(self, throttle_prefills=...))",
        "neither locked nor known read-only: drain",
    ]
    # an unverified version is compared with the newest verified one (0.34.0's scheduler
    # surface is 0.33.0's)
    assert V.VERIFIED["0.34.0"] == V.VERIFIED["0.33.0"]
    assert V.check_scheduler(UNVERIFIED, ref, LOCKED) == [
        f"vLLM {UNVERIFIED} is not a verified version",
        f"its Scheduler's methods are {NEWEST}'s",
    ]
    assert V.check_scheduler("0.32.0", ref, LOCKED) == [
        "Scheduler methods new (vs 0.32.0): has_request(self, request_id)",
        "Scheduler signatures differ (vs 0.32.0): _get_local_prefix_cache_hit(self, request, "
        "max_cache_hit_length=...) (verified: _get_local_prefix_cache_hit(self, request))",
    ]
    # a locked method dropped from _LOCKED would run unlocked
    unlocked = tuple(n for n in LOCKED if n != "update_from_output")
    assert V.check_scheduler("0.33.0", ref, unlocked) == [
        "neither locked nor known read-only: update_from_output"
    ]


def test_the_surface_is_vllms_public_methods_and_the_private_ones_mmreuse_hooks():
    import functools

    class Interface:
        def schedule(self, budget: int, *, force: bool = False) -> None: ...
        def _helper(self) -> None: ...
        def __init__(self, a) -> None: ...

    class Sched(Interface):
        def schedule(self, budget, *, force=False): ...
        def _hooked(self, request, limit=None): ...
        def _private(self): ...
        @property
        def state(self): ...
        @functools.cached_property
        def cached(self): ...
        @staticmethod
        def make(x, *rest, **kw): ...
        @classmethod
        def build(cls, y): ...

        not_a_method = 3

    class Ours(Sched):
        __module__ = "mmreuse.integrations.fake"

        def _hooked(self, *args, **kwargs): ...
        def extra(self): ...

    assert V.scheduler_surface(Ours) == {
        "_hooked": "(self, request, limit=...)",  # vLLM's signature, not the override's
        "build": "classmethod (cls, y)",
        "cached": "property",
        "make": "staticmethod (x, *rest, **kw)",
        "schedule": "(self, budget, *, force=...)",
        "state": "property",
    }
    assert "_private" in vars(Sched) and "_private" not in V.scheduler_surface(Sched)
    assert V.scheduler_kind(Ours) == "Scheduler"
    assert V.scheduler_kind(type("AsyncScheduler", (Sched,), {})) == "AsyncScheduler"


def test_the_overrides():
    assert V.allowed(False, environ={}) is False
    assert V.allowed(True, environ={}) is True
    for on in ("1", "true", "YES", " 1 "):
        assert V.allowed(False, environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": on}) is True
    for off in ("", "0", "false", "no"):
        assert V.allowed(False, environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": off}) is False
    # a mistyped setting never gets here: read_config refuses it (tests/integrations/
    # test_plugin_config.py); a mistyped variable is refused here
    with pytest.raises(InvalidArgument, match=r"^MMREUSE_ALLOW_UNVERIFIED_VLLM must be 1 or 0, got '2'"):  # fmt: skip
        V.allowed(False, environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": "2"})


def test_the_message_is_one_line_naming_field_value_and_override():
    msg = V.unverified_message("a vLLM X", UNVERIFIED, ["a", "b"])
    assert msg == (
        f"vllm.__version__ must be a vLLM X, got '{UNVERIFIED}': a; b. To start anyway, set "
        'additional_config {"mmreuse": {"allow_unverified_vllm": true}} or '
        "MMREUSE_ALLOW_UNVERIFIED_VLLM=1"
    )
    assert V.unverified_message("Y", "1", [], anyway="publish anyway").endswith(
        ", got '1'. To publish anyway, set "
        'additional_config {"mmreuse": {"allow_unverified_vllm": true}} or '
        "MMREUSE_ALLOW_UNVERIFIED_VLLM=1"
    )


# ---- EventfulEncoderCacheManager's check -------------------------------------------------------


def test_every_verified_vllm_is_recorded_for_the_encoder_cache():
    assert set(V.EC_VERIFIED) == {"0.32.0", "0.33.0", "0.34.0"}
    for version, surface in V.EC_VERIFIED.items():
        # what the plug-in overrides, calls and reads
        overridden = {"check_and_update_cache", "can_allocate", "allocate", "free_encoder_input"}
        assert overridden | {"free", "reset", "get_freed_mm_hashes", "__init__"} <= set(surface)
        assert surface["create_manager"] == "classmethod (cls, *, cache_size, vllm_config)"
        for attr in ("cached", "freeable", "freed", "num_embeds_by_hash", "num_free_slots"):
            assert surface[attr] == "attribute", (version, attr)
    # 0.34.0 dropped get_manager_metadata (vLLM's metadata to the worker; not the plug-in's)
    assert set(V.EC_VERIFIED["0.33.0"]) - set(V.EC_VERIFIED["0.34.0"]) == {"get_manager_metadata"}
    assert set(V.EC_VERIFIED["0.34.0"]) <= set(V.EC_VERIFIED["0.33.0"])


@pytest.mark.parametrize("version", ["0.34.0", "0.33.0", "0.32.0", "0.33.0+cpu"])
def test_a_verified_encoder_cache_passes(version):
    assert V.check_encoder_cache(version, V.EC_VERIFIED[V.public_version(version)]) == []


def test_what_differs_in_the_encoder_cache_is_named():
    ref = V.EC_VERIFIED["0.34.0"]
    newer = {**ref, "evict_all": "(self)", "allocate": "(self, request, input_id, now)"}
    del newer["freeable"]
    assert V.check_encoder_cache("0.34.0", newer) == [
        "EncoderCacheManager methods new (vs 0.34.0): evict_all(self)",
        "EncoderCacheManager methods missing (vs 0.34.0): freeable",
        "EncoderCacheManager signatures differ (vs 0.34.0): allocate(self, request, input_id, "
        "now) (verified: allocate(self, request, input_id))",
    ]
    newest = max(V.EC_VERIFIED, key=vllm_version_key)
    assert V.check_encoder_cache(UNVERIFIED, V.EC_VERIFIED[newest]) == [
        f"vLLM {UNVERIFIED} is not a verified version",
        f"its EncoderCacheManager's methods are {newest}'s",
    ]
    assert V.check_encoder_cache("0.34.0", ref, verified={}) == [
        "vLLM 0.34.0 is not a verified version",
        "no EncoderCacheManager was verified",
        "EncoderCacheManager methods new: " + ", ".join(V._shown(n, f) for n, f in ref.items()),
    ]


def test_the_encoder_cache_surface_is_vllms_methods_init_and_attributes():
    class Manager:
        @classmethod
        def create_manager(cls, *, cache_size, vllm_config): ...
        def __init__(self, cache_size): ...
        def allocate(self, request, input_id): ...
        def _helper(self): ...
        def _hooked(self, x): ...

    class Ours(Manager):
        __module__ = "mmreuse.integrations.fake"

        def __init__(self, cache_size, extra=None): ...
        def allocate(self, *args): ...
        def _hooked(self, *args): ...
        def snapshot(self): ...

    got = V.encoder_cache_surface(Ours, ["cached", "_private", "allocate"])
    assert got == {
        "__init__": "(self, cache_size)",  # vLLM's, not the override's
        "_hooked": "(self, x)",
        "allocate": "(self, request, input_id)",  # a method, not the attribute of that name
        "cached": "attribute",
        "create_manager": "classmethod (cls, *, cache_size, vllm_config)",
    }


def test_the_encoder_cache_verdict_degrades_an_unverified_vllm(caplog, monkeypatch):
    monkeypatch.delenv(V.ALLOW_ENV, raising=False)
    logger = "vllm.mmreuse.integrations.vllm_versions"
    with caplog.at_level(logging.INFO, logger=logger):
        assert V.encoder_cache_verdict("0.34.0", [], False) is True
        assert V.encoder_cache_verdict(UNVERIFIED, ["a", "b"], False) is False
    info, off = caplog.records
    assert info.levelname == "INFO" and "verified with vLLM 0.34.0" in info.getMessage()
    msg = off.getMessage()
    assert off.levelname == "WARNING"
    assert "P runs vLLM's own EncoderCacheManager and publishes no encoder-cache events" in msg
    assert f"got '{UNVERIFIED}': a; b" in msg and "allow_unverified_vllm" in msg
    # the overrides: it runs, warned
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=logger):
        assert V.encoder_cache_verdict(UNVERIFIED, ["a"], True)
        monkeypatch.setenv(V.ALLOW_ENV, "1")
        assert V.encoder_cache_verdict(UNVERIFIED, ["a"], False)
    assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
    assert all("override set" in r.getMessage() for r in caplog.records)
    # a mistyped override is refused, as every mistyped setting
    monkeypatch.setenv(V.ALLOW_ENV, "maybe")
    with pytest.raises(InvalidArgument, match="MMREUSE_ALLOW_UNVERIFIED_VLLM must be 1 or 0"):
        V.encoder_cache_verdict(UNVERIFIED, ["a"], False)


# ---- against the real vLLMs (oracle venvs: 0.33.0, 0.34.0) ---------------------------------------


def _run(py, scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    env.pop(V.ALLOW_ENV, None)
    out = oracle_run(py, str(REPO / "tools/oracle/vllm_versions_check.py"), scenario, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.oracle
def test_each_oracle_vllm_passes_as_it_is(oracle_python, oracle_version):
    c = _run(oracle_python, "as-is")
    version = c["version"]
    assert version in V.VERIFIED and version in V.EC_VERIFIED
    assert oracle_version in ("custom", version)
    assert c["checked"] == [version, version]
    assert c["problems"] == {"Scheduler": [], "AsyncScheduler": []}
    assert c["loose"] == [] and c["locked_and_unlocked"] == [] and c["locked_not_wrapped"] == []
    assert c["scheme"] == "vllm-0.33"
    # EventfulEncoderCacheManager: verified, the plug-in's own manager, publishing
    assert c["ec_problems"] == []
    assert c["ec"] == {
        "outcome": "created", "class": "EventfulEncoderCacheManager", "vllms_own": False,
        "publisher": True, "works": True, "published": 1,
    }  # fmt: skip
    assert c["log"][:3] == [
        f"INFO mmreuse: DemandScheduler verified with vLLM {version} (Scheduler)",
        f"INFO mmreuse: DemandScheduler verified with vLLM {version} (AsyncScheduler)",
        f"INFO mmreuse: EventfulEncoderCacheManager verified with vLLM {version}",
    ]


@pytest.mark.oracle
def test_a_method_added_to_vllms_scheduler_is_refused_unless_overridden(oracle_python):
    c = _run(oracle_python, "new-method")
    refused = c["refused"]
    assert refused["outcome"] == "refused"  # before vLLM's __init__: the check comes first
    assert refused["error"].startswith("vllm.__version__ must be a vLLM whose Scheduler")
    version = c["version"]
    assert f"got '{version}'" in refused["error"]
    assert f"methods new (vs {version}): drain_everything(self, budget, *, force=...)" in refused["error"]  # fmt: skip
    assert "neither locked nor known read-only: drain_everything" in refused["error"]
    for how in ("config_override", "env_override"):
        assert c[how]["outcome"] == "past_check", c[how]
        assert "Scheduler.__init__()" in c[how]["error"]  # vLLM's own, on the stand-in config
    warnings = [line for line in c["log"] if line.startswith("WARNING")]
    assert len(warnings) == 2 and all("drain_everything" in w for w in warnings)


@pytest.mark.oracle
def test_a_newer_vllm_is_refused_by_the_scheduler_and_never_hashed_by_guess(oracle_python):
    """DemandScheduler refuses a vLLM it was not verified with; the fast hasher never replaces
    vLLM's hasher on it (by its own rule: `register()` refuses, or leaves vLLM's hasher in
    place, warned), and hashes nothing by a guessed scheme; both follow the override."""
    c = _run(oracle_python, f"version:{UNVERIFIED}")
    assert c["scheduler"]["outcome"] == "refused"
    err = c["scheduler"]["error"]
    assert f"got '{UNVERIFIED}': vLLM {UNVERIFIED} is not a verified version" in err
    assert f"its Scheduler's methods are {NEWEST}'s" in err  # 0.33.0's and 0.34.0's are one
    assert c["register"]["replaced"] is False
    said = c["register"].get("error") or "\n".join(c["log"])
    assert f"got '{UNVERIFIED}'" in said and vllm_ranges() in said
    hashes = c["hashes"]
    assert hashes["outcome"] == "refused" or (hashes["fast"] == 0 and hashes["vllm"] > 0), hashes
    # P started with allow_unverified_vllm: its query hasher takes the nearest scheme
    assert c["scheduler_overridden"]["outcome"] == "past_check"
    assert c["hashes_overridden"]["outcome"] == "hashed"
    assert c["hashes_overridden"]["schemes"] == ["vllm-0.33"]


@pytest.mark.oracle
def test_an_older_vllm_hashes_with_its_own_scheme(oracle_python):
    """vllm.__version__ faked (the rest is 0.33.0's code): the fast hasher keys images and
    LoRA as that generation did (0.30: `(identifier, offset)` and the adapter's name; 0.11.0:
    bare identifiers and the adapter's int id), on its fast path; the scheduler, verified with
    0.32.0 and 0.33.0 only, is refused."""
    c = _run(oracle_python, "version:0.30.0")
    assert c["register"] == {"outcome": "registered", "replaced": True}
    h = c["hashes"]
    assert h["outcome"] == "hashed" and h["fast"] == 2 and h["vllm"] == 0, h
    assert "vllm-0.30" in h["schemes"] and "vllm-0.33" not in h["schemes"], h
    assert "vllm-0.30" in h["lora_schemes"] and "vllm-0.33" not in h["lora_schemes"], h
    assert any("(vLLM 0.30.0, scheme vllm-0.30)" in line for line in c["log"])
    assert c["scheduler"]["outcome"] == "refused"
    h = _run(oracle_python, "version:0.11.0")["hashes"]
    assert h["lora_schemes"] == ["vllm-0.10"] and h["fast"] == 2, h  # the int id, fast
    same = _run(oracle_python, "version:0.33.0")
    assert same["hashes"]["schemes"] == same["hashes"]["lora_schemes"] == ["vllm-0.33"]
    assert same["scheduler"]["outcome"] == "past_check"


@pytest.mark.oracle
@pytest.mark.parametrize(
    "scenario, differs",
    [
        (f"ec-version:{UNVERIFIED}", f"vLLM {UNVERIFIED} is not a verified version"),
        (
            "ec-new-method",
            "EncoderCacheManager methods new (vs {version}): evict_all(self, now=...)",
        ),
    ],
)
def test_an_unverified_encoder_cache_gets_vllms_own_manager_unless_overridden(
    oracle_python, scenario, differs
):
    """A vLLM whose EncoderCacheManager EventfulEncoderCacheManager was not verified with
    (its version, or a method more): P starts with vLLM's own manager, publishing nothing, and
    one WARNING naming the version and what differs; with the config or the environment
    override the plug-in runs fully, warned; a mistyped override is refused."""
    c = _run(oracle_python, scenario)
    version, differs = c["version"], differs.format(version=c["version"])
    vllms_own = {"outcome": "created", "class": "EncoderCacheManager", "vllms_own": True,
                 "publisher": False, "works": True}  # fmt: skip
    assert c["plain"] == vllms_own
    for how in ("config_override", "env_override"):
        assert c[how]["class"] == "EventfulEncoderCacheManager" and c[how]["publisher"], c[how]
        assert c[how]["works"] and c[how]["published"] == 1, c[how]
    assert c["env_mistyped"]["outcome"] == "raised"
    assert "MMREUSE_ALLOW_UNVERIFIED_VLLM must be 1 or 0" in c["env_mistyped"]["error"]
    warnings = [line for line in c["log"] if line.startswith("WARNING")]
    assert len(warnings) == 3 and all(differs in w for w in warnings), warnings
    assert all(f"got '{version}'" in w for w in warnings)
    assert "publishes no encoder-cache events" in warnings[0]
    assert all("override set" in w for w in warnings[1:])


@pytest.mark.oracle
def test_an_encoder_cache_the_plug_in_cannot_build_on_is_vllms_own(oracle_python):
    """vLLM's EncoderCacheManager.__init__ takes another argument (its create_manager passing
    it): the plug-in cannot be built on it, override or not; P gets vLLM's own manager,
    warned, and starts."""
    c = _run(oracle_python, "ec-new-init")
    for how in ("plain", "config_override", "env_override", "env_mistyped"):
        assert c[how]["class"] == "EncoderCacheManager" and not c[how]["publisher"], c[how]
        assert c[how]["works"], c[how]
    warnings = [line for line in c["log"] if line.startswith("WARNING")]
    assert len(warnings) == 4 and all("cannot be built on vLLM" in w for w in warnings)
    assert "missing 1 required positional argument: 'budget'" in warnings[0]

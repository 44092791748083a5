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
import subprocess

import pytest

from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.hashing.schemes import SCHEMES, scheme_for_vllm, vllm_ranges, vllm_version_key
from mmreuse.integrations import vllm_versions as V
from mmreuse.integrations.vllm_hasher import scheme_for_running_vllm
from tests.support.paths import REPO


def _locked() -> tuple[str, ...]:
    """vllm_demand._LOCKED, read from its source (importing it needs vLLM)."""
    tree = ast.parse((REPO / "mmreuse/integrations/vllm_demand.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_LOCKED" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("no _LOCKED in vllm_demand.py")


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


def test_both_verified_vllms_are_recorded_for_both_schedulers():
    assert set(V.VERIFIED) == {"0.32.0", "0.33.0"}
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


@pytest.mark.parametrize("version", ["0.33.0", "0.32.0"])
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
    # an unverified version is compared with the newest verified one
    assert V.check_scheduler("0.34.0", ref, LOCKED) == [
        "vLLM 0.34.0 is not a verified version",
        "its Scheduler's methods are 0.33.0's",
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
    assert V.allowed({}, environ={}) is False
    assert V.allowed({"allow_unverified_vllm": True}, environ={}) is True
    assert V.allowed({"allow_unverified_vllm": False}, environ={}) is False
    for on in ("1", "true", "YES", " 1 "):
        assert V.allowed({}, environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": on}) is True
    for off in ("", "0", "false", "no"):
        assert V.allowed({}, environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": off}) is False
    with pytest.raises(InvalidArgumentType, match=r"^additional_config\['mmreuse'\]\['allow_unverified_vllm'\] must be a bool, got str 'yes'"):  # fmt: skip
        V.allowed({"allow_unverified_vllm": "yes"}, environ={})
    with pytest.raises(InvalidArgument, match=r"^MMREUSE_ALLOW_UNVERIFIED_VLLM must be 1 or 0, got '2'"):  # fmt: skip
        V.allowed({}, environ={"MMREUSE_ALLOW_UNVERIFIED_VLLM": "2"})


def test_the_message_is_one_line_naming_field_value_and_override():
    msg = V.unverified_message("a vLLM X", "0.34.0", ["a", "b"])
    assert msg == (
        "vllm.__version__ must be a vLLM X, got '0.34.0': a; b. To start anyway, set "
        'additional_config {"mmreuse": {"allow_unverified_vllm": true}} or '
        "MMREUSE_ALLOW_UNVERIFIED_VLLM=1"
    )


# ---- against the real vLLM 0.33.0 (oracle venv) ------------------------------------------------


def _run(py, scenario: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    env.pop(V.ALLOW_ENV, None)
    out = subprocess.run(
        [str(py), str(REPO / "tools/oracle/vllm_versions_check.py"), scenario],
        capture_output=True, text=True, check=True, timeout=600, env=env,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.oracle
def test_vllm_0_33_passes_as_it_is(oracle_python):
    c = _run(oracle_python, "as-is")
    assert c["version"] == "0.33.0"
    assert c["checked"] == ["0.33.0", "0.33.0"]
    assert c["problems"] == {"Scheduler": [], "AsyncScheduler": []}
    assert c["loose"] == [] and c["locked_and_unlocked"] == [] and c["locked_not_wrapped"] == []
    assert c["scheme"] == "vllm-0.33"
    assert c["log"] == [
        "INFO mmreuse: DemandScheduler verified with vLLM 0.33.0 (Scheduler)",
        "INFO mmreuse: DemandScheduler verified with vLLM 0.33.0 (AsyncScheduler)",
    ]


@pytest.mark.oracle
def test_a_method_added_to_vllms_scheduler_is_refused_unless_overridden(oracle_python):
    c = _run(oracle_python, "new-method")
    refused = c["refused"]
    assert refused["outcome"] == "refused"  # before vLLM's __init__: the check comes first
    assert refused["error"].startswith("vllm.__version__ must be a vLLM whose Scheduler")
    assert "got '0.33.0'" in refused["error"]
    assert "methods new (vs 0.33.0): drain_everything(self, budget, *, force=...)" in refused["error"]  # fmt: skip
    assert "neither locked nor known read-only: drain_everything" in refused["error"]
    for how in ("config_override", "env_override"):
        assert c[how]["outcome"] == "past_check", c[how]
        assert "Scheduler.__init__()" in c[how]["error"]  # vLLM's own, on the stand-in config
    warnings = [line for line in c["log"] if line.startswith("WARNING")]
    assert len(warnings) == 2 and all("drain_everything" in w for w in warnings)


@pytest.mark.oracle
def test_a_newer_vllm_is_refused_by_both_plug_ins(oracle_python):
    c = _run(oracle_python, "version:0.34.0")
    assert c["scheduler"]["outcome"] == "refused"
    assert "got '0.34.0': vLLM 0.34.0 is not a verified version" in c["scheduler"]["error"]
    assert "its Scheduler's methods are 0.33.0's" in c["scheduler"]["error"]
    assert c["register"]["outcome"] == "refused" and c["register"]["replaced"] is False
    assert "got '0.34.0'" in c["register"]["error"] and vllm_ranges() in c["register"]["error"]
    assert c["hashes"]["outcome"] == "refused"
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

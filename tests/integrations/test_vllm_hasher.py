"""mmreuse.integrations.vllm_hasher: the drop-in for vLLM's `get_request_block_hasher`.

The differential run is vLLM's own code in the oracle venv (tools/oracle/fast_hasher_check.py;
MMREUSE_ORACLE_PYTHON picks the venv: 0.33.0, whose `Request` keeps its token ids in a list, or
0.34.0, whose `Request` keeps them in a `TokenBuffer`, an int32 array): real `Request`s, prompt
then decode steps, the four hash functions, lookahead 0, 1, 2 and True, images, cache salt,
LoRA, negative ids; every block hash must equal vLLM's, the fast path must be the one that ran,
and a request sharing one string object between two keys (pickle memoizes it) must go to
vLLM's own hasher and still agree. `register()` is run there too, as vLLM's plug-in loader
runs it.

The rest runs here against a stand-in `vllm` (a few modules in sys.modules): how a call is
routed and counted, and that neither `register()` nor `fast_request_block_hasher` ever stops
vLLM (an unknown version, a moved hasher: a WARNING and vLLM's own hasher)."""

from __future__ import annotations

import array
import json
import logging
import subprocess
import sys
import textwrap
from types import ModuleType, SimpleNamespace

import pytest

from mmreuse import BlockHasher, MMOccurrence
from mmreuse.hashing.schemes import vllm_ranges
from mmreuse.integrations import vllm_hasher
from tests.support.oracle import oracle_json, oracle_lines
from tests.support.paths import ORACLE_TOOLS

LOGGER = "vllm.mmreuse.integrations.vllm_hasher"


# ---- against the real vLLM (the oracle venv) ---------------------------------------------------


@pytest.mark.oracle
def test_every_hash_equals_vllms_on_real_requests(oracle_python, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")  # xxhash's NONE_HASH seed, as vLLM's tests run
    counts = oracle_json(oracle_python, str(ORACLE_TOOLS / "fast_hasher_check.py"))["check"]
    assert counts["mismatch"] == 0, counts
    assert counts["blocks"] > 2000 and counts["fast"] > 300 and counts["fallback"] > 0, counts
    # the only fallback: the requests built with one identifier object twice
    assert set(counts["fallbacks"]) == {"shared_strings"}, counts
    assert counts["stats"]["fast"] > 5000, counts
    if counts["vllm"] == "0.33.0":
        assert counts["tokens"] == ["list"], counts
    else:  # 0.34 on: the Request's TokenBuffer, read in place by the fast path
        assert counts["tokens"] == ["TokenBuffer"], counts
        assert "token_type" not in counts["fallbacks"], counts


# What vLLM's plug-in loader does (`load_general_plugins` calls `register()` without a try):
# the real vLLM's engine core then builds mmreuse's hasher, which hashes a real Request on the
# fast path; with the version faked to one in no scheme's range, or with vLLM's hasher moved
# out of the engine core, register() returns, logs why, and leaves vLLM's own hasher in place.
_REGISTER = textwrap.dedent(
    """
    import json, logging, sys
    import vllm
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core import kv_cache_utils as K
    from vllm.v1.engine import core
    from vllm.v1.request import Request
    from mmreuse.integrations import vllm_hasher

    lines = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(f"{r.levelname} {r.getMessage()}")
    logging.getLogger(vllm_hasher.logger.name).addHandler(handler)
    logging.getLogger(vllm_hasher.logger.name).setLevel(logging.DEBUG)
    scenario = sys.argv[1]
    if scenario.startswith("version:"):
        vllm.__version__ = scenario.split(":", 1)[1]
    elif scenario == "moved":
        del core.get_request_block_hasher
    before = K.get_request_block_hasher
    vllm_hasher.register()
    vllm_hasher.register()  # idempotent
    out = {"replaced": K.get_request_block_hasher is not before, "log": lines}
    if scenario != "moved":
        out["core_is_ours"] = getattr(core.get_request_block_hasher, "__mmreuse_original__", None) is not None
        K.init_none_hash(sha256)
        hasher = core.get_request_block_hasher(16, sha256, 0)
        req = Request(request_id="r", prompt_token_ids=list(range(100)),
                      sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                      block_hasher=hasher)
        want = K.get_request_block_hasher.__dict__.get("__mmreuse_original__", K.get_request_block_hasher)
        ref = Request(request_id="r", prompt_token_ids=list(range(100)),
                      sampling_params=SamplingParams(max_tokens=4), pooling_params=None,
                      block_hasher=want(16, sha256, 0))
        out["equal"] = req.block_hashes == ref.block_hashes and len(req.block_hashes) == 6
        out["tokens"] = type(req._all_token_ids).__name__
    out["stats"] = dict(vllm_hasher.STATS)
    out["fallbacks"] = {k: v for k, v in vllm_hasher.fallbacks().items() if v}
    print(json.dumps(out))
    """
)


def _register_in_oracle(oracle_python, scenario: str) -> dict:
    return json.loads(oracle_lines(oracle_python, "-c", _REGISTER, scenario)[-1])


@pytest.mark.oracle
def test_register_puts_the_fast_path_in_vllms_engine_core(oracle_python):
    out = _register_in_oracle(oracle_python, "as-is")
    assert out["replaced"] and out["core_is_ours"] and out["equal"], out
    assert out["stats"] == {"fast": 1, "vllm": 0} and out["fallbacks"] == {}, out
    assert any("is mmreuse's fast path" in line for line in out["log"]), out
    assert not any(line.startswith("WARNING") for line in out["log"]), out


@pytest.mark.oracle
def test_register_on_an_unknown_vllm_keeps_vllms_hasher(oracle_python):
    out = _register_in_oracle(oracle_python, "version:0.99.0")
    assert not out["replaced"] and not out["core_is_ours"] and out["equal"], out
    warnings = [line for line in out["log"] if line.startswith("WARNING")]
    assert len(warnings) == 2, out  # one per register() call: each time vLLM's own stays
    assert "got '0.99.0'" in warnings[0] and vllm_ranges() in warnings[0], warnings
    assert "vLLM's own request block hasher stays" in warnings[0], warnings
    assert out["stats"] == {"fast": 0, "vllm": 0}, out  # vLLM's hasher itself, not ours


@pytest.mark.oracle
def test_register_when_vllm_moved_its_hasher_keeps_vllms(oracle_python):
    out = _register_in_oracle(oracle_python, "moved")
    assert not out["replaced"], out
    warnings = [line for line in out["log"] if line.startswith("WARNING")]
    assert warnings and "no longer imports get_request_block_hasher" in warnings[0], out
    assert "unexpected AttributeError" in warnings[0], out


# ---- a stand-in vLLM: routing, counting, degrading ---------------------------------------------

BLOCK = 4
NONE_HASH = BlockHasher("sha256", BLOCK, seed="0").none_hash


def _vllm_fn(name: str):
    def fn(x):  # never called: mmreuse hashes by name
        raise AssertionError("vLLM's hash function called")

    fn.__name__, fn.__module__ = name, "vllm.utils.hashing"
    return fn


class _Request(SimpleNamespace):
    """What the hasher reads of a vLLM `Request`."""

    def __init__(self, tokens, mm=(), salt=None, lora=None, embeds=None):
        feats = [
            SimpleNamespace(
                identifier="".join(list(m.identifier)),
                mm_position=SimpleNamespace(offset=m.offset, length=m.length),
                modality="image",
            )
            for m in mm
        ]
        super().__init__(
            _all_token_ids=tokens,
            block_hashes=[],
            mm_features=feats,
            cache_salt=salt,
            lora_request=lora,
            prompt_embeds=embeds,
            num_prompt_tokens=len(tokens),
        )


@pytest.fixture
def fake_vllm(monkeypatch):
    """`vllm` 0.34.0 as far as the hasher sees it; vLLM's own hasher records its calls. Also
    fresh counters and log-once state for the test."""
    calls: list = []

    def get_request_block_hasher(hash_block_size, caching_hash_fn, num_hash_lookahead_tokens=0):
        def own(request):
            calls.append(request)
            return ["vllm's own"]

        return own

    vllm = ModuleType("vllm")
    vllm.__version__ = "0.34.0"
    kcu = ModuleType("vllm.v1.core.kv_cache_utils")
    kcu.get_request_block_hasher = get_request_block_hasher
    kcu.NONE_HASH = NONE_HASH
    core = ModuleType("vllm.v1.engine.core")
    core.get_request_block_hasher = get_request_block_hasher
    mods = {
        "vllm": vllm,
        "vllm.v1": ModuleType("vllm.v1"),
        "vllm.v1.core": ModuleType("vllm.v1.core"),
        "vllm.v1.core.kv_cache_utils": kcu,
        "vllm.v1.engine": ModuleType("vllm.v1.engine"),
        "vllm.v1.engine.core": core,
    }
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.engine"):
        mods[name].__path__ = []  # packages: a missing submodule is a ModuleNotFoundError
    mods["vllm.v1.core"].kv_cache_utils = kcu
    mods["vllm.v1.engine"].core = core
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.delenv("MMREUSE_ALLOW_UNVERIFIED_VLLM", raising=False)
    monkeypatch.setattr(vllm_hasher, "STATS", {"fast": 0, "vllm": 0})
    monkeypatch.setattr(vllm_hasher, "_FALLBACKS", dict.fromkeys(vllm_hasher._REASONS, 0))
    monkeypatch.setattr(vllm_hasher, "_logged", set())
    return SimpleNamespace(vllm=vllm, kcu=kcu, core=core, calls=calls, own=get_request_block_hasher)


def _expected(tokens, mm=(), salt=None):
    return BlockHasher("sha256", BLOCK, seed="0", scheme="vllm-0.33").hash_prompt(
        list(tokens), mm=list(mm), cache_salt=salt
    )


TOKENS = [5, 9, 150_000, 0, 7, 7, 7, 1, 2, 3, 4, 5, 6, 2**31 - 1, 8, 9, 10]
MM = [MMOccurrence("img", 2, 7)]


@pytest.mark.parametrize(
    "make",
    [list, lambda t: array.array("i", t), lambda t: array.array("q", t)],
    ids=["list", "int32 array (TokenBuffer)", "int64 array"],
)
def test_a_list_or_an_int_array_takes_the_fast_path(fake_vllm, make, caplog):
    hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
    req = _Request(make(TOKENS), mm=MM, salt="s")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        got = hasher(req)
        req.block_hashes.extend(got)
        req._all_token_ids.extend([11, 12, 13])  # a decode step completes a block
        got += hasher(req)
    assert got == _expected([*TOKENS, 11, 12, 13], MM, "s")
    assert vllm_hasher.STATS == {"fast": 2, "vllm": 0} and fake_vllm.calls == []
    assert not any(vllm_hasher.fallbacks().values()) and caplog.records == []


class TokenBuffer(array.array):  # vLLM 0.34's, as far as the hasher sees it
    __slots__ = ()

    def __new__(cls, tokens=()):
        return super().__new__(cls, "i", tokens)


def test_a_token_buffer_subclass_is_read_in_place(fake_vllm):
    hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
    assert hasher(_Request(TokenBuffer(TOKENS), mm=MM)) == _expected(TOKENS, MM)
    assert vllm_hasher.STATS["fast"] == 1


@pytest.mark.parametrize(
    "tokens,shown",
    [
        (tuple(TOKENS), "a tuple"),
        (array.array("d", TOKENS), "a array of typecode 'd'"),
        (array.array("I", TOKENS), "a array of typecode 'I'"),
    ],
)
def test_another_token_container_falls_back_counted_and_logged_once(
    fake_vllm, tokens, shown, caplog
):
    hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(3):
            assert hasher(_Request(tokens)) == ["vllm's own"]
    assert vllm_hasher.fallbacks()["token_type"] == 3 and len(fake_vllm.calls) == 3
    assert vllm_hasher.STATS == {"fast": 0, "vllm": 3}
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "'token_type'" in record.getMessage() and shown in record.getMessage()


def test_a_list_holding_a_non_int_falls_back_as_token_type(fake_vllm, caplog):
    hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        assert hasher(_Request([1, 2, 3, "4"])) == ["vllm's own"]
    assert vllm_hasher.fallbacks()["token_type"] == 1
    assert "tokens[3]" in caplog.records[0].getMessage()


def test_every_reason_is_counted_and_logged_once_at_its_level(fake_vllm, caplog):
    hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
    shared = "".join(["im", "g"])
    twice = _Request(list(range(20)))
    twice.mm_features = [
        SimpleNamespace(identifier=shared, mm_position=SimpleNamespace(offset=o, length=2))
        for o in (1, 5)
    ]
    cases = {
        "prompt_embeds": _Request(list(range(20)), embeds=object()),
        "shared_strings": twice,
        "mm_features": _Request(list(range(8)), mm=[MMOccurrence("big", 4, 9)]),
        "limits": _Request([2**70] * 8),
        "not_a_request": SimpleNamespace(_all_token_ids=[1] * 8),
    }
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        for _ in range(2):
            for req in cases.values():
                assert hasher(req) == ["vllm's own"]
    counts = vllm_hasher.fallbacks()
    assert {k: v for k, v in counts.items() if v} == dict.fromkeys(cases, 2)
    assert set(counts) == set(vllm_hasher._REASONS)  # every reason, 0 included
    assert vllm_hasher.STATS == {"fast": 0, "vllm": 10}
    logged = {r.getMessage().split("'")[1]: r.levelno for r in caplog.records}
    assert len(caplog.records) == len(cases)  # once per reason
    assert logged == {
        "prompt_embeds": logging.INFO,  # expected by design
        **{k: logging.WARNING for k in cases if k != "prompt_embeds"},
    }


def test_fallbacks_is_a_copy(fake_vllm):
    counts = vllm_hasher.fallbacks()
    counts["limits"] = 99
    assert vllm_hasher.fallbacks()["limits"] == 0


def test_a_hash_function_not_vllms_is_vllms_to_hash_counted(fake_vllm, caplog):
    def sha256(x):  # same name, not vLLM's
        return b""

    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        hasher = vllm_hasher.fast_request_block_hasher(BLOCK, sha256)
        assert len(caplog.records) == 1  # when it is built, not at its first call
        hasher(_Request(list(range(8))))
        hasher(_Request(list(range(8))))
    assert vllm_hasher.fallbacks()["hash_fn"] == 2 and len(fake_vllm.calls) == 2
    [record] = caplog.records
    assert record.levelno == logging.WARNING and "'hash_fn'" in record.getMessage()


def test_an_unknown_vllm_gets_its_own_hasher_with_one_warning(fake_vllm, caplog):
    fake_vllm.vllm.__version__ = "0.99.0"
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
        assert len(caplog.records) == 1  # when it is built, not at its first call
        for _ in range(3):
            assert hasher(_Request(list(range(8)))) == ["vllm's own"]
        vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("xxhash"))  # no second warning
    assert vllm_hasher.fallbacks()["unverified_vllm"] == 3
    assert vllm_hasher.STATS == {"fast": 0, "vllm": 3}
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "got '0.99.0'" in record.getMessage() and vllm_ranges() in record.getMessage()
    assert "MMREUSE_ALLOW_UNVERIFIED_VLLM=1" in record.getMessage()


def test_an_unknown_vllm_with_the_override_hashes_as_the_nearest_scheme(
    fake_vllm, monkeypatch, caplog
):
    fake_vllm.vllm.__version__ = "0.99.0"
    monkeypatch.setenv("MMREUSE_ALLOW_UNVERIFIED_VLLM", "1")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        hasher = vllm_hasher.fast_request_block_hasher(BLOCK, _vllm_fn("sha256"))
    assert hasher(_Request(TokenBuffer(TOKENS), mm=MM)) == _expected(TOKENS, MM)
    assert vllm_hasher.STATS == {"fast": 1, "vllm": 0}
    assert any(
        r.levelno == logging.WARNING and "unverified" in r.getMessage() for r in caplog.records
    )


def test_register_replaces_vllms_hasher_in_the_engine_core(fake_vllm, caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        vllm_hasher.register()
        vllm_hasher.register()  # idempotent
    ours = fake_vllm.core.get_request_block_hasher
    assert ours is fake_vllm.kcu.get_request_block_hasher
    assert ours.__mmreuse_original__ is fake_vllm.own
    assert ours(BLOCK, _vllm_fn("sha256"))(_Request(TOKENS)) == _expected(TOKENS)
    assert [r.levelno for r in caplog.records] == [logging.INFO]
    assert "(vLLM 0.34.0, scheme vllm-0.33)" in caplog.records[0].getMessage()


@pytest.mark.parametrize("version", ["0.99.0", "0.10.1", "not-a-version"])
def test_register_on_an_unknown_vllm_warns_and_keeps_vllms_hasher(fake_vllm, version, caplog):
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        fake_vllm.vllm.__version__ = version
        vllm_hasher.register()  # never raises: vLLM's plug-in loader has no try
    assert fake_vllm.core.get_request_block_hasher is fake_vllm.own
    assert fake_vllm.kcu.get_request_block_hasher is fake_vllm.own
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert repr(version) in record.getMessage()
    assert "vLLM's own request block hasher stays" in record.getMessage()
    if version != "not-a-version":
        assert vllm_ranges() in record.getMessage()


def test_register_with_a_malformed_override_warns_and_keeps_vllms_hasher(
    fake_vllm, monkeypatch, caplog
):
    fake_vllm.vllm.__version__ = "0.99.0"
    monkeypatch.setenv("MMREUSE_ALLOW_UNVERIFIED_VLLM", "maybe")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        vllm_hasher.register()
    assert fake_vllm.core.get_request_block_hasher is fake_vllm.own
    assert "MMREUSE_ALLOW_UNVERIFIED_VLLM must be 1 or 0" in caplog.records[0].getMessage()


def test_register_with_the_override_uses_the_nearest_scheme(fake_vllm, monkeypatch, caplog):
    fake_vllm.vllm.__version__ = "0.99.0"
    monkeypatch.setenv("MMREUSE_ALLOW_UNVERIFIED_VLLM", "1")
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        vllm_hasher.register()
    assert fake_vllm.core.get_request_block_hasher.__mmreuse_original__ is fake_vllm.own
    assert "(vLLM 0.99.0, scheme vllm-0.33)" in caplog.records[-1].getMessage()


def test_register_when_vllm_moved_its_hasher_warns_with_the_cause(fake_vllm, caplog):
    del fake_vllm.core.get_request_block_hasher  # the engine core no longer imports it
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        vllm_hasher.register()
    assert fake_vllm.kcu.get_request_block_hasher is fake_vllm.own  # nothing half-replaced
    [record] = caplog.records
    assert record.levelno == logging.WARNING and record.exc_info is not None
    assert "unexpected AttributeError" in record.getMessage()
    assert "no longer imports get_request_block_hasher" in record.getMessage()
    assert "vLLM 0.34.0" in record.getMessage()


def test_register_when_vllm_is_missing_a_module_warns(fake_vllm, monkeypatch, caplog):
    monkeypatch.delattr(sys.modules["vllm.v1.engine"], "core")
    monkeypatch.delitem(sys.modules, "vllm.v1.engine.core")  # gone from vLLM: its import fails
    with caplog.at_level(logging.DEBUG, logger=LOGGER):
        vllm_hasher.register()
    assert fake_vllm.kcu.get_request_block_hasher is fake_vllm.own
    assert "unexpected ImportError" in caplog.records[0].getMessage()


# ---- no vLLM needed ----------------------------------------------------------------------------


def test_only_vllms_own_hash_functions_are_taken_over():
    def sha256(x):  # same name, not vLLM's
        return b""

    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        assert vllm_hasher._mmreuse_hash_fn(_vllm_fn(name)) == name
    assert vllm_hasher._mmreuse_hash_fn(sha256) is None
    assert vllm_hasher._mmreuse_hash_fn(print) is None


def test_importing_it_loads_neither_vllm_nor_torch():
    code = (
        "import sys, mmreuse.integrations.vllm_hasher, mmreuse.integrations.vllm, "
        "mmreuse.integrations.vllm_versions; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""mmreuse vs the real vLLM (0.33.0 and 0.34.0, through the oracle venvs) on
hypothesis-generated requests and on the golden vectors."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("torch")  # tests/support/vectors.py needs it

from tests.support.oracle import Oracle, require_oracle, token_id_bound
from tests.support.strategies import cases
from tests.support.vectors import hash_case, load_vectors

pytestmark = pytest.mark.oracle


@settings(
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ]
)
@given(data=st.data())
def test_block_hashes_equal_vllm(vllm_oracle, oracle_version, data):
    case = data.draw(cases(token_bound=token_id_bound(oracle_version) or 2**63))
    res = vllm_oracle.compute(case)
    assert "error" not in res, res
    fast = hash_case(case)
    assert fast == res["hashes"]
    assert hash_case(case, use_fast_path=False) == fast
    if case.get("steps"):
        assert res.get("matches_one_shot") is True
        assert hash_case(case, incremental=False) == fast


def test_oracle_reproduces_the_golden_vectors(vllm_oracle, oracle_version):
    """The oracle venv's vLLM answers every recorded case as the vLLM that made tests/data did,
    per-block extra keys and preimages included where recorded. vLLM 0.34.0 refuses the
    cases with token ids outside int32 (tests/data/vllm-0.34.0-vectors.json re-makes them)
    and answers every other one as 0.33.0 did."""
    vectors = load_vectors("vllm-0.33.0-vectors.json")["vectors"]
    bound = token_id_bound(oracle_version)
    debug_oracle = None
    refused = 0
    for vec in vectors:
        case, expected = vec["case"], vec["expected"]
        res = vllm_oracle.compute(case)
        if bound and any(not -bound <= t < bound for t in case.get("tokens") or []):
            assert "OverflowError" in res.get("error", ""), (vec["id"], res)
            refused += 1
            continue
        assert "error" not in res, (vec["id"], res)
        assert res["vllm_version"] == oracle_version
        assert (res["hashes"], res["none_hash"], res["num_blocks"]) == (
            expected["hashes"],
            expected["none_hash"],
            expected["num_blocks"],
        ), vec["id"]
        if case.get("steps"):
            assert res["matches_one_shot"] is True, vec["id"]
        if "blocks" in expected:
            if debug_oracle is None:
                debug_oracle = _debug_oracle(oracle_version)
            blocks = debug_oracle.compute(case)["blocks"]
            assert len(blocks) == len(expected["blocks"]), vec["id"]
            for got, want in zip(blocks, expected["blocks"], strict=True):
                assert got["preimage_verified"] is True, vec["id"]
                assert {k: got[k] for k in want if want[k] is not None} == {
                    k: v for k, v in want.items() if v is not None
                }, vec["id"]
    assert debug_oracle is not None  # the vectors do carry per-block records
    debug_oracle.close()
    assert refused == (127 if bound else 0)


def test_oracle_reproduces_its_versions_vectors(vllm_oracle, oracle_version):
    """The cases re-made for 0.34.0 within int32: 0.33.0 answers them as 0.34.0 did."""
    for vec in load_vectors("vllm-0.34.0-vectors.json")["vectors"]:
        res = vllm_oracle.compute(vec["case"])
        assert "error" not in res, (vec["id"], res)
        assert [res[k] for k in ("hashes", "none_hash", "num_blocks")] == [
            vec["expected"][k] for k in ("hashes", "none_hash", "num_blocks")
        ], vec["id"]


def _debug_oracle(version: str) -> Oracle:
    py, script = require_oracle(version)
    return Oracle(py, script, args=("--jsonl", "--debug"))


def test_oracle_reports_bad_cases(vllm_oracle):
    """A malformed case gets an error line (and the server keeps answering)."""
    res = vllm_oracle.compute({"hash_fn": "md5", "tokens": [1, 2]})
    assert "hash_fn" in res["error"]
    res = vllm_oracle.compute({"hash_fn": "xxhash", "seed": None, "tokens": [1, 2]})
    assert "os.urandom" in res["error"]
    res = vllm_oracle.compute({"tokens": [1] * 40, "mm": [{"identifier": "a", "offset": 0}]})
    assert "mm[0]" in res["error"]
    assert vllm_oracle.compute({"tokens": [1] * 16, "block_size": 16})["num_blocks"] == 1

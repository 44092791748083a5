"""mmreuse vs the real vLLM 0.33.0 (through the oracle venv) on hypothesis-generated requests."""

import pytest
from hypothesis import HealthCheck, given, settings

from .strategies import cases
from .vectors import hash_case

pytestmark = pytest.mark.oracle


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                 HealthCheck.data_too_large])
@given(case=cases())
def test_block_hashes_equal_vllm(vllm_oracle, case):
    res = vllm_oracle.compute(case)
    assert "error" not in res, res
    fast = hash_case(case)
    assert fast == res["hashes"]
    assert hash_case(case, use_fast_path=False) == fast
    if case.get("steps"):
        assert res.get("matches_one_shot") is True
        assert hash_case(case, incremental=False) == fast

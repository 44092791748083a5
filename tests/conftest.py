import os
from pathlib import Path

import pytest
from hypothesis import settings

from .oracle_client import Oracle, require_oracle

# Differential tests run thousands of examples in CI; locally fewer unless asked.
settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("MMREUSE_DIFF_EXAMPLES", "3000")),
    deadline=None,
    print_blob=True,
)
settings.register_profile("dev", max_examples=200, deadline=None, print_blob=True)
settings.load_profile(
    os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
)


@pytest.fixture(scope="session")
def vllm_oracle():
    py, script = require_oracle()
    oracle = Oracle(py, script)
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def vllm_scheduler():
    """vLLM's real Scheduler._try_schedule_encoder_inputs (tests/vllm_scheduler_oracle.py)."""
    py, _ = require_oracle()
    oracle = Oracle(py, Path(__file__).parent / "vllm_scheduler_oracle.py", args=())
    yield oracle
    oracle.close()

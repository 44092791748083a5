"""mmreuse.integrations.vllm_hasher: the drop-in for vLLM's `get_request_block_hasher`.

The differential run is vLLM 0.33.0's own code in the oracle venv
(tools/oracle/fast_hasher_check.py): real `Request`s, prompt then decode steps, the four hash
functions, lookahead 0, 1, 2 and True, images, cache salt, LoRA; every block hash must equal
vLLM's, the fast path must be the one that ran, and a request sharing one string object
between two keys (pickle memoizes it) must go to vLLM's own hasher and still agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mmreuse.integrations import vllm_hasher
from tests.support.paths import REPO


@pytest.mark.oracle
def test_every_hash_equals_vllms_on_real_requests(oracle_python):
    py = oracle_python
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    out = subprocess.run(
        [str(py), str(REPO / "tools/oracle/fast_hasher_check.py")],
        capture_output=True, text=True, check=True, timeout=600, env=env,
    )  # fmt: skip
    counts = json.loads(out.stdout.strip().splitlines()[-1])["check"]
    assert counts["mismatch"] == 0, counts
    assert counts["blocks"] > 2000 and counts["fast"] > 300 and counts["fallback"] > 0, counts


def test_only_vllms_own_hash_functions_are_taken_over():
    def sha256(x):  # same name, not vLLM's
        return b""

    fake = type(sys)("vllm.utils.hashing")
    for name in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
        fn = (lambda n: lambda x: b"")(name)
        fn.__name__, fn.__module__ = name, "vllm.utils.hashing"
        assert vllm_hasher._mmreuse_hash_fn(fn) == name
    assert vllm_hasher._mmreuse_hash_fn(sha256) is None
    assert vllm_hasher._mmreuse_hash_fn(print) is None
    assert fake.__name__ == "vllm.utils.hashing"


def test_importing_it_loads_neither_vllm_nor_torch():
    code = (
        "import sys, mmreuse.integrations.vllm_hasher, mmreuse.integrations.vllm, "
        "mmreuse.integrations.vllm_versions; "
        "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

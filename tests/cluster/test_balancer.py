"""The HAProxy config `mmreuse.cluster.balancer` writes (HAProxy itself runs in the live tier:
tests/live_proxy/test_replicas_live.py)."""

from __future__ import annotations

import pytest

from mmreuse.cluster.balancer import haproxy_config
from mmreuse.errors import InvalidArgument


def test_round_robin_over_health_checked_replicas_with_redispatch():
    cfg = haproxy_config(["http://127.0.0.1:9001", "http://127.0.0.1:9002/"], 8999)
    assert "bind 127.0.0.1:8999" in cfg and "balance roundrobin" in cfg
    assert "option httpchk GET /health" in cfg and "option redispatch 1" in cfg
    assert "server r0 127.0.0.1:9001 check" in cfg and "server r1 127.0.0.1:9002 check" in cfg


@pytest.mark.parametrize("backends", [[], ["127.0.0.1"], ["http://h:1/x"]])
def test_bad_backends_refused(backends):
    with pytest.raises(InvalidArgument, match="backends"):
        haproxy_config(backends, 8999)

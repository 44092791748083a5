"""`--uuid-policy` on the real cluster: vLLM keys E's encoder cache and the EC store by the
item's uuid, across cache salts. Tenant B sends its own image under the uuid tenant A's image
has: under `reference` E runs no encoder for it (B is served A's embedding), under `tenant` E
encodes B's own image; within a tenant, reuse is kept under both."""

from __future__ import annotations

import time

import pytest

from mmreuse.cluster.client import png_data_url, post_json
from mmreuse.cluster.proxy import proxy_process

pytestmark = pytest.mark.live


def _chat(url: str, image: str, uuid: str, salt: str) -> dict:
    part = {"type": "image_url", "image_url": {"url": image}, "uuid": uuid}
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0.0,
        "cache_salt": salt,
        "messages": [{"role": "user", "content": [part, {"type": "text", "text": "what is it?"}]}],
    }
    return post_json(url + "/v1/chat/completions", body, timeout=300)


@pytest.mark.parametrize("policy, b_forwards", [("reference", 0), ("tenant", 1)])
def test_a_forged_uuid_reaches_anothers_embedding_only_under_reference(
    cluster, proxy_flags, tmp_path, policy, b_forwards
):
    run = time.time_ns()
    shade = run % 200
    image_a = png_data_url(32, 32, (shade, 10, 200))
    image_b = png_data_url(32, 32, (10, 200, shade))  # another image, same claimed name
    shared = f"photo-{run}"
    probe = cluster.probe()
    args = [*proxy_flags(["P0"]), "--policy", "eager", "--uuid-policy", policy]
    with proxy_process(args, tmp_path / f"proxy-{policy}.log") as url:
        assert _chat(url, image_a, shared, "tenant-a")["choices"]
        before = probe.count("E0").log_inputs
        assert _chat(url, image_b, shared, "tenant-b")["choices"]  # B: no engine error either
        forged = probe.count("E0").log_inputs - before
        before = probe.count("E0").log_inputs
        assert _chat(url, image_a, shared, "tenant-a")["choices"]  # A again: honest reuse
        again = probe.count("E0").log_inputs - before
    assert forged == b_forwards, (policy, forged)  # reference: B rides on A's embedding
    assert again == 0, (policy, again)  # a tenant still finds its own embedding

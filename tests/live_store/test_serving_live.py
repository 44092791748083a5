"""The serving profile, live (issue 41): a photograph of hundreds of tokens on a P whose KV
cache is small enough to evict, until the photo's request is only partly covered (its leading
blocks still cached, the tail evicted, the image's own blocks among both). Sent again through
`mmreuse proxy --policy index`, the request gets the embedding it needs (P's admission record:
the item partial, not covered, and no wrong skip in the accounting) and its answer is the one
a cold P gives. One 1 E + 1 P cluster of `SERVING` on the Mooncake Store (a few minutes of
CI: the one live test of this profile). Skipped unless MMREUSE_LIVE=1.
"""

from __future__ import annotations

import os
import random
import time

import pytest
import zmq

from mmreuse.accounting import account_request
from mmreuse.cluster import SERVING, Cluster
from mmreuse.cluster.bench import _record_account
from mmreuse.cluster.client import post_json, render
from mmreuse.cluster.instance import BLOCK_SIZE
from mmreuse.cluster.photos import photo_url
from mmreuse.cluster.proxy import proxy_process
from mmreuse.demand_query import (
    AdmissionRecords,
    DemandAnswer,
    RecordsQuery,
    decode_answer,
    encode,
    query_for,
)
from mmreuse.proxy.metrics import sample_sum
from tests.support.live_proxy import metrics_text, proxy_args, until_complete

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]

KV_BLOCKS = 48  # 1,504 usable tokens: the photo's request (~300-1,300) and fillers evict it
FILLER_BLOCKS = 4  # each filler takes this many blocks: at most this many of the photo's go


@pytest.fixture(scope="module")
def serving(tmp_path_factory):
    small_kv = ("--num-gpu-blocks-override", str(KV_BLOCKS), "--max-model-len", "1472")
    with Cluster(
        tmp_path_factory.mktemp("serving"),
        encoders=1,
        prefills=1,
        ec_connector="mooncake",
        e_store_bytes=64 << 20,
        profile=SERVING,
        prefill_extra_args=(small_kv,),
    ) as c:
        yield c


def _body(uuid: str) -> dict:
    return {
        "model": "tiny",
        "max_tokens": 6,
        "temperature": 0,
        "return_token_ids": True,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look at this photograph."},
                    {"type": "image_url", "image_url": {"url": photo_url(0)}, "uuid": uuid},
                    {"type": "text", "text": "What is in it?"},
                ],
            }
        ],
    }


def _ask(dealer, query):
    dealer.send(encode(query))
    assert dealer.poll(30_000), "P did not answer within 30 s"
    return decode_answer(dealer.recv(), query if not isinstance(query, RecordsQuery) else None)


def _ids(reply: dict) -> list[int]:
    return list(reply["choices"][0]["token_ids"])


def test_a_partly_evicted_image_gets_its_embedding_and_the_same_answer(serving, tmp_path):
    c = serving
    p = c.instances["P0"].spec
    run = f"partial-{time.time_ns()}"
    # P alone, cold: under its own uuid nothing holds the photo, P encodes it itself
    cold = _ids(post_json(p.url + "/v1/chat/completions", _body(f"{run}-cold"), timeout=120))
    body = _body(run)
    query = query_for(render(p.url, body), f"{run}-q", remember=False)  # a probe: keeps nothing
    item = query.items[0]
    assert item.length >= 256, item  # the serving profile's photo: hundreds of tokens
    ctx = zmq.Context.instance()
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(p.demand_endpoint)
    args = [*proxy_args(c, ["P0"]), "--policy", "index"]
    try:
        with proxy_process(args, tmp_path / "proxy.log") as url:
            until_complete(url)
            first = post_json(url + "/v1/chat/completions", body, timeout=120)
            assert _ids(first) == cold
            full = _ask(dealer, query)
            assert isinstance(full, DemandAnswer) and full.num_computed_tokens > item.offset
            assert full.num_computed_tokens >= item.offset + item.length  # all of it cached
            # fillers of text straight to P, until the photo's tail is evicted
            coverage = full.num_computed_tokens
            rng = random.Random(run)
            for _ in range(2 * KV_BLOCKS // FILLER_BLOCKS):
                # token ids, so that a filler is exactly FILLER_BLOCKS blocks with its answer;
                # random ones, so that no two fillers share a block
                ids = [rng.randrange(1, 256) for _ in range(FILLER_BLOCKS * BLOCK_SIZE - 1)]
                filler = {"model": "tiny", "max_tokens": 1, "prompt": ids}
                post_json(p.url + "/v1/completions", filler, timeout=120)
                coverage = _ask(dealer, query).num_computed_tokens
                if coverage < full.num_computed_tokens:
                    break
            assert item.offset < coverage < item.offset + item.length, (coverage, item)
            since = _ask(dealer, RecordsQuery("since", since=0))
            assert isinstance(since, AdmissionRecords)
            sent_before = _sent(url)
            again = post_json(url + "/v1/chat/completions", body, timeout=120)
            assert _ids(again) == cold  # the same answer as a cold P's
            sent = {item.identifier} if _sent(url) > sent_before else set()
            time.sleep(0.5)
            records = _ask(dealer, RecordsQuery("after", since=since.next))
    finally:
        dealer.close(0)
    assert isinstance(records, AdmissionRecords)
    rec = records.records[-1]
    assert rec.num_computed_tokens == coverage  # P admitted it with the partial coverage
    (got,) = rec.items
    assert got.identifier == item.identifier and got.partial and not got.item_class.covered, got
    acct = account_request(**_record_account(rec, sent, {item.identifier}))
    assert (acct.wrong_skips, acct.partial_coverage) == (0, 1), acct


def _sent(url: str) -> float:
    """Items the proxy has sent E so far."""
    return sample_sum(metrics_text(url), "mmreuse_proxy_encoder_items_total", action="sent")

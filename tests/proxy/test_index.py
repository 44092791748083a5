"""`mmreuse proxy --policy index`: E gets only what the chosen PD still needs, decided from a
live KV view. Fake E / PD servers (tests/support/proxy_fakes.py; each PD renders requests as vLLM's
`/v1/chat/completions/render` would) and a real view: vLLM-shaped KV events (BlockStored with
token ids and untagged extra keys) from a local ZMQ publisher (tests/support/kv_publisher.py), hashed
with mmreuse's own BlockHasher, as P would publish them with PYTHONHASHSEED=0."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from mmreuse.demand_query import SnapshotQuery
from mmreuse.events.index import MAX_EXTRA_KEYS_PER_BLOCK
from mmreuse.proxy.config import parse_args
from mmreuse.proxy.server import PROXY_KEY, build_app
from tests.support.index_proxy import (
    BLOCK,
    TEXT,
    A,
    B,
    C,
    e_sent,
    embeds,
    index_proxy,
    pd_content,
    render,
    stored,
)
from tests.support.proxy_fakes import Fake, chat, img, proxy_client, sha

# ---- tests --------------------------------------------------------------------------------------


async def test_covered_image_is_not_sent_to_e():
    # PD holds the first 4 blocks of [A, B] (tokens 0-63): A at [40, 56) is covered, B at
    # [56, 72) is not. E gets only B; A reaches PD raw with its uuid (PD keys it as E would).
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        r = await s.post(chat(TEXT, img(A), img(B)))
        assert r.status == 200
        assert e_sent(s) == [sha(B)]
        content = pd_content(s)
        assert content[0] == TEXT
        assert content[1] == {**img(A), "uuid": sha(A)}
        # B was encoded, but vLLM refuses raw and embeds images in one request: B goes raw
        # with its uuid too, and PD gets E's embedding by that uuid (the EC connector).
        assert content[2] == {**img(B), "uuid": sha(B)}
        params = s.pd[0].chats()[0].body["ec_transfer_params"]
        assert [x["mm_hash"] for x in params["ec_items"]] == [sha(B)]
        assert sha(B) in params and sha(A) not in params
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 1
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 0

        # Again: A still covered; B is now held by E (sent there once): e_cached, still sent.
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B), sha(B)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 2
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_cached") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 2


async def test_uncovered_images_are_sent_and_rewritten():
    # Nothing of [A, C] is held (PD holds [B]'s prefix only): both to E, both rewritten.
    async with index_proxy() as s:
        await s.hold(0, [sha(B)], 3)
        assert (await s.post(chat(TEXT, img(A), img(C)))).status == 200
        assert e_sent(s) == [sha(A), sha(C)]
        assert len(s.e.chats()) == 1  # one encoder: the images share one sub-request
        assert pd_content(s) == [TEXT, embeds(A), embeds(C)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 2
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 0


async def test_a_duplicate_identifier_is_sent_once():
    # [C, C]: one identifier, one E item; both occurrences reference its embedding.
    async with index_proxy() as s:
        assert (await s.post(chat(TEXT, img(C), img(C)))).status == 200
        assert e_sent(s) == [sha(C)]
        assert pd_content(s) == [TEXT, embeds(C), embeds(C)]
        items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha(C)]  # one transfer
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="duplicate") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="sent") == 1
        assert s.sample("mmreuse_proxy_encoder_items_total", action="skipped") == 1


async def test_render_failure_sends_everything_to_e():
    # Render answers 403 (PD started without --enable-scale-out): no plan, E gets every item,
    # the request still succeeds, as under eager.
    async with index_proxy(renders=False) as s:
        await s.hold(0, [sha(A), sha(B)], 4)  # a view that would have covered A
        r = await s.post(chat(TEXT, img(A), img(B)))
        assert r.status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert pd_content(s) == [TEXT, embeds(A), embeds(B)]
        assert [x.path for x in s.pd[0].seen][:2] == ["/v1/models", "/v1/chat/completions/render"]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert s.sample("mmreuse_proxy_errors_total", stage="render") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="unclassified") == 2
        assert s.sample("mmreuse_proxy_requests_total", policy="index", outcome="ok") == 1
        text = await (await s.client.get("/metrics")).text()
        assert 'mmreuse_proxy_fallbacks_total{instance="PD0",kind="no_plan"} 1.0' in text


async def test_render_request_carries_the_proxys_uuids():
    # The render body: the request with every item's uuid (the client's kept, else sha256 of
    # its URL), "mm_payload": "none", and no stream / stream_options.
    body = chat(
        TEXT,
        img(A, uuid="client-a"),
        img(B),
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=9,
    )
    async with index_proxy() as s:
        await s.hold(0, [sha(B)], 3)  # P may hold B: the request is rendered (A, new, is not)
        r = await s.post(body)
        assert r.status == 200
        await r.read()
        [req] = [x for x in s.pd[0].seen if x.path == "/v1/chat/completions/render"]
        sent = req.body
        assert sent["mm_payload"] == "none"
        assert "stream" not in sent and "stream_options" not in sent
        assert sent["messages"][0]["content"] == [
            TEXT,
            img(A, uuid="client-a"),
            img(B, uuid=sha(B)),
        ]
        assert (sent["model"], sent["max_tokens"]) == ("tiny", 9)
        assert e_sent(s) == ["client-a", sha(B)]
        assert s.pd[0].chats()[0].body["stream"] is True  # decode still streams


async def test_hash_configuration_mismatch_disables_the_view():
    # P publishes hashes the proxy cannot reproduce (another PYTHONHASHSEED): /health names
    # the mismatch, the gauge counts it, and the view is not used, even for blocks it holds.
    async with index_proxy() as s:
        view = s.proxy.views[0]
        events = [stored([sha(C)], 3, seed="1"), stored([sha(A), sha(B)], 4)]
        await s.publish(
            0,
            events,
            lambda: (
                view.index.size() == 7
                and view.check is not None
                and view.check.status.mismatches > 0
            ),
        )
        assert not view.usable
        r = await s.client.get("/health")
        assert r.status == 200  # the clusters are healthy; the view is degraded
        health = (await r.json())["mmreuse"]
        assert health["status"] == "degraded"
        assert any(p.startswith("PD0: hash configuration mismatch") for p in health["problems"])
        assert health["views"]["PD0"]["usable"] is False
        assert health["views"]["PD0"]["hash_check"]["mismatches"] > 0
        assert s.sample("mmreuse_proxy_hash_config_mismatches", instance="PD0") > 0
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]  # A would be covered by the view's blocks
        assert pd_content(s) == [TEXT, embeds(A), embeds(B)]


async def test_a_matching_configuration_verifies():
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert (health["status"], health["problems"]) == ("ok", [])
        view = health["views"]["PD0"]
        assert (view["usable"], view["blocks"], view["block_size"]) == (True, 4, BLOCK)
        assert view["hash_check"]["verified"] == 4 and view["hash_check"]["mismatches"] == 0
        assert s.sample("mmreuse_proxy_hash_blocks_verified", instance="PD0") == 4
        assert s.sample("mmreuse_proxy_hash_config_mismatches", instance="PD0") == 0


async def test_affine_routing_picks_the_pd_holding_the_prefix():
    # Two PDs; only PD1's view holds blocks carrying A and B. Every request goes to PD1, chosen
    # at arrival from the identifier index (the routing RNG, which would pick PD0 for some of
    # them, is not asked), and is rendered there.
    async with index_proxy(2, flags=("--routing", "affine"), seed=3) as s:
        await s.hold(1, [sha(A), sha(B)], 4)
        for _ in range(6):
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert len(s.pd[1].chats()) == 6 and s.pd[0].chats() == []
        renders = [f for f in s.pd for x in f.seen if x.path.endswith("/render")]
        assert renders == [s.pd[1]] * 6
        assert e_sent(s) == [sha(B)] * 6  # A is covered at PD1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 6


async def test_random_routing_ignores_the_views():
    # The control for the test above: with the same RNG seed and --routing random, PD0 serves
    # some of the requests (and E then gets A too, PD0 holding nothing).
    async with index_proxy(2, seed=3) as s:
        await s.hold(1, [sha(A), sha(B)], 4)
        for _ in range(6):
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.pd[0].chats() and s.pd[1].chats()
        assert e_sent(s).count(sha(A)) == len(s.pd[0].chats())


async def test_decode_500_retry_re_encodes_everything():
    # A decode 500 re-runs the request as under eager: E gets every item, each rewritten.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        s.pd[0].fail["/v1/chat/completions"] = [500]
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B), sha(A), sha(B)]
        assert pd_content(s, k=0)[1] == {**img(A), "uuid": sha(A)}
        assert pd_content(s, k=1) == [TEXT, embeds(A), embeds(B)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="retry") == 1


@pytest.mark.parametrize("cached, short", [(0, 1), (64, 0)])
async def test_kv_short_fallback_from_the_usage(cached, short):
    # PD reports fewer cached prompt tokens than the plan counted on (64): a skipped item was
    # served by PD's own cache, connector or encoder.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        s.pd[0].usage = {"prompt_tokens": 72, "prompt_tokens_details": {"cached_tokens": cached}}
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="kv_short") == short


async def test_index_without_kv_events_sends_everything():
    # No view at all: every item is uncovered (E gets it), and /health says why.
    async with index_proxy(events=False) as s:
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert health["status"] == "degraded"
        assert health["problems"] == ["PD0: no KV events endpoint"]


async def test_text_only_request_under_index():
    async with index_proxy() as s:
        body = chat(TEXT, max_tokens=3)
        assert (await s.post(body)).status == 200
        assert s.e.chats() == []
        assert s.pd[0].chats()[0].body == body


async def test_e_p_d_under_index():
    # E + P + D: the view is P's; render goes to P; P gets the covered item raw with its uuid,
    # D gets P's kv_transfer_params.
    async with index_proxy(prefill=True) as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert s.proxy.views[0].name == "P0"
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]
        assert [x.path for x in s.pd[0].seen] == [
            "/v1/models",  # once: is the request's model a base model (not a LoRA adapter)?
            "/v1/chat/completions/render",
            "/v1/chat/completions",
        ]
        p_body = s.pd[0].chats()[0].body
        assert p_body["messages"][0]["content"][1] == {**img(A), "uuid": sha(A)}
        assert p_body["max_tokens"] == 1
        [d] = s.d[0].chats()
        assert d.body["kv_transfer_params"]["remote_engine_id"] == "p-engine"
        assert [x.path for x in s.d[0].seen] == ["/v1/chat/completions"]  # no render at D
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1


async def test_cache_salt_is_part_of_the_key():
    # P's blocks were made under cache_salt "tenant-a": only a request with that salt hits.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4, cache_salt="tenant-a")
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-b"))).status == 200
        assert e_sent(s)[2:] == [sha(A), sha(B)]
        assert (await s.post(chat(TEXT, img(A), img(B), cache_salt="tenant-a"))).status == 200
        assert e_sent(s)[4:] == [sha(B)]
        assert s.pd[0].chats()[-1].body["cache_salt"] == "tenant-a"


@pytest.mark.parametrize(
    "answer",
    [
        lambda body: [1, 2],
        lambda body: None,
        lambda body: {"token_ids": "abc"},
        lambda body: {"token_ids": [1] * 50, "features": None},  # fewer images than sent
        lambda body: {
            "token_ids": [1] * 50,
            "features": {
                "mm_hashes": {"image": ["x", "y"]},
                "mm_placeholders": {"image": [{"offset": 40, "length": 16}] * 2},  # past the end
            },
        },
    ],
)
async def test_a_garbled_render_costs_the_plan_not_the_request(answer):
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)  # P may hold both: the request waits for render
        s.pd[0].render = answer
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1


async def test_render_url_is_used_and_its_failure_costs_the_plan(fakes):
    renderer = await fakes("pd", render=render)
    async with index_proxy(renders=False, flags=("--render-url", renderer.url)) as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]
        assert [x.path for x in renderer.seen] == ["/v1/models", "/v1/chat/completions/render"]
        assert [x.path for x in s.pd[0].seen] == ["/v1/chat/completions"]
        await renderer.close()  # unreachable now
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s)[1:] == [sha(A), sha(B)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1


async def test_a_covered_occurrence_shares_the_embedding_sent_for_a_later_one():
    # [A, B, A] with [A, B]'s first 4 blocks held: A#0 is covered, A#2 ([72, 88)) is not and
    # needs E. A is sent once (for A#2); A#0 references that embedding; one transfer per item
    # sent.
    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(chat(TEXT, img(A), img(B), img(A)))).status == 200
        assert e_sent(s) == [sha(B), sha(A)]
        assert pd_content(s) == [TEXT, embeds(A), embeds(B), embeds(A)]
        items = s.pd[0].chats()[0].body["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha(B), sha(A)]
        assert s.sample("mmreuse_proxy_occurrences_total", klass="kv_covered") == 1
        assert s.sample("mmreuse_proxy_occurrences_total", klass="e_compute") == 2


async def test_affine_routing_under_eager():
    # --routing affine without --policy index: routed by the views, every item still to E.
    async with index_proxy(2, flags=("--routing", "affine", "--policy", "eager"), seed=3) as s:
        await s.hold(1, [sha(A), sha(B)], 4)
        for _ in range(4):
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert len(s.pd[1].chats()) == 4 and s.pd[0].chats() == []
        assert e_sent(s) == [sha(A), sha(B)] * 4
        assert s.sample("mmreuse_proxy_occurrences_total", klass="unclassified") == 8


async def test_block_size_learned_from_the_events():
    # Without --block-size the view takes P's from its first BlockStored event.
    async with index_proxy(block_size=None) as s:
        view = s.proxy.views[0]
        assert view.hasher is None and not view.usable
        await s.hold(0, [sha(A), sha(B)], 4)
        assert view.hasher is not None and view.hasher.block_size == BLOCK
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(B)]


async def test_the_view_bounds_a_block_s_identifiers_by_the_block_size():
    # A block of --block-size tokens overlaps at most that many items (review 3, M2); a size
    # learned from P's events is P's word, so the index keeps its default bound then.
    async with index_proxy() as s:
        assert s.proxy.views[0].index.max_identifiers_per_block == BLOCK
    async with index_proxy(block_size=None) as s:
        assert s.proxy.views[0].index.max_identifiers_per_block == MAX_EXTRA_KEYS_PER_BLOCK


async def test_a_block_size_mismatch_disables_the_view():
    async with index_proxy(block_size=2 * BLOCK) as s:
        view = s.proxy.views[0]
        await s.publish(
            0,
            [stored([sha(A), sha(B)], 4)],
            lambda: view.check is not None and view.check.status.mismatches > 0,
        )
        assert not view.usable
        health = (await (await s.client.get("/health")).json())["mmreuse"]
        assert any("block size" in p for p in health["problems"])
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]


async def test_conflicting_embed_counts_fall_back_to_eager():
    # One identifier rendered with two lengths: vLLM rejects the request, so the proxy makes no
    # plan and lets P say so, as under eager (E gets every item).
    def conflicting(body: dict[str, Any]) -> dict[str, Any]:
        out = render(body)
        out["features"]["mm_placeholders"]["image"][1]["length"] = 8
        return out

    async with index_proxy() as s:
        await s.hold(0, [sha(C)], 3)  # P may hold C: the request waits for its render
        s.pd[0].render = conflicting
        assert (await s.post(chat(TEXT, img(C), img(C)))).status == 200
        assert e_sent(s) == [sha(C), sha(C)]
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="no_plan") == 1
        assert s.sample("mmreuse_proxy_errors_total", stage="plan") == 1


class _SlowRender(Fake):
    """A PD whose render answers only after `delay_s`."""

    delay_s = 5.0

    async def handle(self, request):
        if request.path == "/v1/chat/completions/render":
            await asyncio.sleep(self.delay_s)
        return await super().handle(request)


async def test_a_render_past_its_timeout_costs_the_plan_not_the_request(fakes):
    # A render that does not answer within --render-timeout: E gets everything, as under eager,
    # and the client is answered once the timeout has passed, not when render would have.
    e = await fakes("e")
    pd = await fakes(_SlowRender("pd", render=render))
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url,
            "--policy", "index", "--render-timeout", "0.2"]  # fmt: skip
    app = build_app(parse_args(argv, env={}))
    async with proxy_client(app) as client:
        t0 = time.monotonic()
        # (processor kwargs: identifiers cannot be known without P, so the item waits for the
        # render; a new item without them would go to E at arrival, unrendered)
        body = chat(TEXT, img(A), mm_processor_kwargs={"max_pixels": 4096})
        r = await client.post("/v1/chat/completions", json=body)
        assert r.status == 200 and time.monotonic() - t0 < 3.0
        assert [p["uuid"] for x in e.chats() for p in x.body["messages"][0]["content"]] == [sha(A)]
        registry = app[PROXY_KEY].registry
        labels = {"instance": "PD0", "kind": "no_plan"}
        assert registry.get_sample_value("mmreuse_proxy_fallbacks_total", labels) == 1


async def test_a_hybrid_attention_p_turns_its_view_off_saying_why():
    # The view follows block hashes, not KV cache groups: with a second group (sliding window)
    # a block one group evicted would still count as a hit. Refused by name instead.
    import msgspec

    async with index_proxy() as s:
        await s.hold(0, [sha(A), sha(B)], 4)
        other = msgspec.structs.replace(
            stored([sha(A), sha(B)], 4), group_idx=1, kv_cache_spec_kind="sliding_window"
        )
        view = s.proxy.views[0]
        await s.publish(0, [other], lambda: view.hybrid is not None)
        assert not view.usable
        assert "KV cache group 1 (sliding_window)" in view.hybrid
        health = await (await s.client.get("/health")).json()
        assert any("hybrid-attention" in p for p in health["mmreuse"]["problems"])
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        assert e_sent(s) == [sha(A), sha(B)]  # no plan on a view that cannot be trusted


# ---- a view that knows it is incomplete (a late join) -------------------------------------------

# P cached A and B's prompt, then served five more batches, all before the proxy started; its
# replay buffer holds 2: the proxy can never learn that P holds A.
LATE = dict(before=[[stored([sha(A), sha(B)], 4)], *[[] for _ in range(5)]], buffer_steps=2)
PAIR = chat(TEXT, img(A), img(B))


async def _joined(s) -> None:
    """Until the view's subscriber receives live batches (the slow joiner: with a buffer of 2,
    a batch published before it connects may be lost for good)."""
    sub = s.proxy.views[0].stream
    await s.publish(0, [], lambda: sub.applied_seq is not None)


async def _health(s) -> dict:
    return (await (await s.client.get("/health")).json())["mmreuse"]


async def test_a_late_joined_view_is_incomplete_and_its_decisions_are_counted_blind():
    from mmreuse.events import AllBlocksCleared

    async with index_proxy(**LATE) as s:
        await _joined(s)
        await s.hold(0, [sha(C)], 3)  # what P stores now is seen: the view is usable
        view = s.proxy.views[0]
        assert view.usable and not view.complete
        health = await _health(s)
        assert health["views"]["PD0"]["complete"] is False
        assert health["e_side"] == "per-replica"  # this process's own sends only
        assert any("view incomplete" in p for p in health["problems"])
        assert (await s.post(PAIR)).status == 200
        assert e_sent(s) == [sha(A), sha(B)]  # blind: P holds A, the view cannot know
        assert s.sample("mmreuse_proxy_blind_decisions_total", instance="PD0") == 1
        assert s.sample("mmreuse_kv_event_view_complete", instance="PD0", events="kv") == 0
        # P clears its prefix cache: from then on the view is exact.
        await s.publish(0, [AllBlocksCleared()], lambda: view.complete)
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(PAIR)).status == 200
        assert e_sent(s)[2:] == [sha(B)]
        assert s.sample("mmreuse_proxy_blind_decisions_total", instance="PD0") == 1
        assert not any("view incomplete" in p for p in (await _health(s))["problems"])


async def test_an_incomplete_view_asks_p_where_it_has_a_demand_endpoint():
    from tests.support.demand_p import planned

    async with index_proxy(**LATE, demand=True) as s:
        await _joined(s)
        await s.hold(0, [sha(C)], 3)
        s.ps[0].reply = planned(64)  # P's truth: its prefix cache covers A
        assert (await s.post(PAIR)).status == 200
        asked = [q for q in s.ps[0].queries if not isinstance(q, SnapshotQuery)]
        assert len(asked) == 1 and e_sent(s) == [sha(B)]
        assert pd_content(s)[1]["uuid"] == sha(A)  # raw with its uuid: P finds it in its KV
        xargs = s.pd[0].chats()[-1].body["vllm_xargs"]
        assert xargs["mmreuse_demand_id"] == asked[0].id
        assert s.sample("mmreuse_proxy_blind_decisions_total", instance="PD0") == 0
        assert s.sample("mmreuse_kv_event_snapshots_total", instance="PD0", outcome="error") >= 1


async def test_a_late_view_bootstraps_from_ps_snapshot_and_plans_on_what_p_held():
    from mmreuse.blockhash import to_event_id
    from mmreuse.demand_query import KVSnapshot

    early = LATE["before"][0][0]
    ids = [to_event_id(h) for h in early.block_hashes]

    async with index_proxy(**LATE, demand=True) as s:

        def snapshot(q):  # P as of its last batch (the later ones are empty): A and B's blocks
            stamp = s.pubs[0].buffer[-1][0] + 1
            return KVSnapshot(q.id, stamp, "inc", len(ids), 0, 1000, ids, [1] * len(ids))

        s.ps[0].snapshot = snapshot
        view = s.proxy.views[0]
        await _joined(s)
        await s.publish(0, [], lambda: view.complete)
        assert view.usable
        assert (await s.post(PAIR)).status == 200
        assert e_sent(s) == [sha(B)]  # A is covered: what P cached before the proxy started
        assert [type(q).__name__ for q in s.ps[0].queries] == ["SnapshotQuery"]  # no asking
        assert s.sample("mmreuse_proxy_blind_decisions_total", instance="PD0") == 0
        assert s.sample("mmreuse_kv_event_snapshots_total", instance="PD0", outcome="ok") == 1

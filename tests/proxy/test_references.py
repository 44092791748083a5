"""`--held-items reference` (mmreuse/proxy/references.py): an item the chosen P holds goes to P
as E's reference kept from the request that had it encoded, not raw; the keying, the bound, and
the retry with the media when P cannot serve the reference. Fake E / PD servers and a real KV
view (tests/support/index_proxy.py)."""

from __future__ import annotations

import re

import pytest

from mmreuse.proxy.config import (
    ConfigError,
    PlanningConfig,
    ProxyConfig,
    ServingConfig,
    parse_args,
)
from mmreuse.proxy.references import HeldReferences, reference_key
from tests.proxy.test_store_loss import default_then, lost_once
from tests.support.index_proxy import TEXT, A, B, C, e_sent, embeds, index_proxy, pd_content
from tests.support.proxy_fakes import chat, img, sha

REFERENCE = ("--held-items", "reference")
URLS = {"encode_urls": ("http://e",), "decode_urls": ("http://d",)}
META = {"image_grid_thw": [[1, 4, 4]]}


def feature(uuid: str, metadata: dict | None = None, transfer_id: str | None = "t1") -> dict:
    return {
        "metadata": META if metadata is None else metadata,
        "modality": "image",
        "mm_hash": uuid,
        "transfer_id": transfer_id,
    }


# ---- HeldReferences -----------------------------------------------------------------------------


def test_kept_metadata_comes_back_without_a_transfer():
    refs = HeldReferences()
    req = {"model": "m"}
    refs.record(req, ["u0", "u1"], {0: [feature("u0")], 1: [feature("u1")]})
    assert refs.lookup(req, ["u1", "u0", "u2"], frozenset({0, 1, 2})) == {
        0: [feature("u1", transfer_id=None)],
        1: [feature("u0", transfer_id=None)],
    }


def test_the_key_holds_the_model_and_the_processor_kwargs():
    refs = HeldReferences()
    kwargs = {"mm_processor_kwargs": {"max_pixels": 1000, "min_pixels": 10}}
    refs.record({"model": "m", **kwargs}, ["u"], {0: [feature("u")]})
    assert refs.lookup({"model": "other", **kwargs}, ["u"], frozenset({0})) == {}
    assert refs.lookup({"model": "m"}, ["u"], frozenset({0})) == {}
    assert refs.lookup({"model": "m", "mm_processor_kwargs": {"max_pixels": 1}}, ["u"], {0}) == {}
    reordered = {"mm_processor_kwargs": {"min_pixels": 10, "max_pixels": 1000}}
    assert list(refs.lookup({"model": "m", **reordered}, ["u"], frozenset({0}))) == [0]
    # no model named, and an empty kwargs dict, key as vLLM reads them: the default model
    refs.record({}, ["v"], {0: [feature("v")]})
    assert list(refs.lookup({"mm_processor_kwargs": {}}, ["v"], frozenset({0}))) == [0]
    assert refs.keeps_all({}, ["v"]) and not refs.keeps_all({}, ["v", "u"])
    assert not refs.keeps_all({"model": 3}, ["v"])


@pytest.mark.parametrize("request_", [{"model": 3}, {"mm_processor_kwargs": [1]}])
def test_an_unkeyable_request_keeps_nothing(request_):
    assert reference_key(request_, "u") is None
    refs = HeldReferences()
    refs.record(request_, ["u"], {0: [feature("u")]})
    assert len(refs) == 0
    refs.record({}, [""], {0: [feature("")]})  # no uuid: nothing to find it by
    assert len(refs) == 0


def test_an_item_without_metadata_is_not_kept():
    refs = HeldReferences()
    refs.record({}, ["u", "v", "w"], {0: [feature("u", {})], 1: [], 2: [feature("w")]})
    assert list(refs.lookup({}, ["u", "v", "w"], frozenset({0, 1, 2}))) == [2]


def test_the_least_recently_used_goes_first_past_the_bound():
    refs = HeldReferences(capacity=2)
    refs.record({}, ["a", "b"], {0: [feature("a")], 1: [feature("b")]})
    assert list(refs.lookup({}, ["a"], frozenset({0}))) == [0]  # a used: b is the oldest
    refs.record({}, ["c"], {0: [feature("c")]})
    assert len(refs) == 2
    assert list(refs.lookup({}, ["a", "b", "c"], frozenset({0, 1, 2}))) == [0, 2]


@pytest.mark.parametrize("capacity", [0, -1, 1.5, True])
def test_a_bad_capacity_is_refused_by_name(capacity):
    with pytest.raises(ValueError, match="capacity"):
        HeldReferences(capacity)


# ---- the flag -----------------------------------------------------------------------------------


def test_reference_is_refused_where_nothing_is_held_or_nothing_rewritten():
    base = ["--encode-servers-urls", "http://e", "--decode-servers-urls", "http://d"]
    with pytest.raises(ConfigError, match="held_items"):
        ProxyConfig(**URLS, planning=PlanningConfig(held_items="reference"))
    with pytest.raises(ConfigError, match="no_rewrite"):
        ProxyConfig(
            **URLS,
            planning=PlanningConfig(policy="index", held_items="reference"),
            serving=ServingConfig(no_rewrite=True),
        )
    with pytest.raises(ConfigError, match="held_items"):
        PlanningConfig(held_items="refs")
    with pytest.raises(SystemExit):
        parse_args([*base, "--held-items", "reference"])
    assert parse_args([*base, "--policy", "index", *REFERENCE]).planning.held_items == "reference"
    assert parse_args(base).planning.held_items == "raw"


# ---- the proxy ----------------------------------------------------------------------------------


async def test_a_held_item_goes_to_p_as_the_reference_e_gave():
    # [A, B, C]: nothing held, all to E. Then P holds 5 blocks: A and B covered, C not. The
    # next request sends E only C, and P gets A and B as the references E gave the first time
    # (no media to fetch or decode), C as E's answer: every image an embeds part, no mix.
    async with index_proxy(flags=REFERENCE) as s:
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        assert pd_content(s) == [TEXT, embeds(A), embeds(B), embeds(C)]
        await s.hold(0, [sha(A), sha(B), sha(C)], 5)
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        assert e_sent(s) == [sha(A), sha(B), sha(C), sha(C)]
        assert pd_content(s) == [TEXT, embeds(A), embeds(B), embeds(C)]
        body = s.pd[0].chats()[-1].body
        # only C moves: A and B are P's (its KV), found by uuid
        assert [x["mm_hash"] for x in body["ec_transfer_params"]["ec_items"]] == [sha(C)]
        assert s.sample("mmreuse_proxy_held_items_total", instance="PD0", form="reference") == 2
        assert s.sample("mmreuse_proxy_held_items_total", instance="PD0", form="raw") == 0


async def test_the_render_gets_the_kept_references_not_the_media():
    # The plan's render lays the prompt out from E's references where every item of a
    # modality has one kept (no media for P to fetch and decode), else from the media.
    async with index_proxy(flags=REFERENCE) as s:
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        await s.hold(0, [sha(A), sha(B)], 4)
        assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
        # (the first request, all new, went to E at arrival: not rendered)
        (second,) = (x.body for x in s.pd[0].seen if x.path.endswith("/render"))
        assert second["messages"][0]["content"][1:] == [embeds(A), embeds(B)]
        assert second["mm_payload"] == "none"
        assert e_sent(s) == [sha(A), sha(B), sha(B)]  # the same plan: A covered, B not
        # C never encoded: the image modality renders raw, each item with its uuid
        assert (await s.post(chat(TEXT, img(A), img(C)))).status == 200
        third = [x.body for x in s.pd[0].seen if x.path.endswith("/render")][-1]
        assert third["messages"][0]["content"][1:] == [{**img(u), "uuid": sha(u)} for u in (A, C)]


async def test_without_the_flag_a_held_item_goes_raw():
    async with index_proxy() as s:
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        await s.hold(0, [sha(A), sha(B), sha(C)], 5)
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        assert pd_content(s) == [TEXT, *({**img(u), "uuid": sha(u)} for u in (A, B, C))]
        assert s.sample("mmreuse_proxy_held_items_total") == 0


async def test_a_held_item_this_proxy_never_had_encoded_goes_raw():
    # A proxy started after the conversation's first turn (or past its bound) kept nothing
    # for A and B: they go raw with their uuid, so C does too (vLLM refuses the mix).
    async with index_proxy(flags=REFERENCE) as s:
        await s.hold(0, [sha(A), sha(B), sha(C)], 5)
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        assert e_sent(s) == [sha(C)]
        assert pd_content(s) == [TEXT, *({**img(u), "uuid": sha(u)} for u in (A, B, C))]
        assert s.sample("mmreuse_proxy_held_items_total", instance="PD0", form="raw") == 2
        # C is kept now; A and B are not, until E encodes them
        assert len(s.proxy.references) == 1


async def test_another_tenants_item_is_never_sent_as_a_reference():
    # --uuid-policy tenant: the same image under another cache_salt is another uuid, so the
    # first tenant's reference is not the second's.
    flags = (*REFERENCE, "--uuid-policy", "tenant")
    async with index_proxy(flags=flags) as s:
        assert (await s.post({**chat(TEXT, img(A)), "cache_salt": "t1"})).status == 200
        assert len(s.proxy.references) == 1
        assert (await s.post({**chat(TEXT, img(A)), "cache_salt": "t2"})).status == 200
        assert len(s.proxy.references) == 2
        first, second = (x.body["messages"][0]["content"][1] for x in s.pd[0].chats())
        assert first["uuid"] != second["uuid"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_reference_p_cannot_serve_is_retried_with_the_media(stream):
    # P lost A's KV and the store lost its embedding: its connector fails the request, and the
    # proxy retries it once with A (and B: the body's every reference is suspect) raw under a
    # fresh uuid, E encoding them again.
    async with index_proxy(flags=REFERENCE) as s:
        assert (await s.post(chat(TEXT, img(A), img(B), img(C)))).status == 200
        await s.hold(0, [sha(A), sha(B), sha(C)], 5)
        s.pd[0].answer = default_then(lost_once(stream=stream))
        r = await s.post(chat(TEXT, img(A), img(B), img(C), stream=stream))
        assert r.status == 200
        await r.read()
        first, second = s.pd[0].chats()[-2:]
        assert first.body["messages"][0]["content"][1:3] == [embeds(A), embeds(B)]
        for part, url in zip(second.body["messages"][0]["content"][1:], (A, B, C), strict=True):
            assert part["type"] == "image_url" and part["image_url"] == {"url": url}
            assert re.fullmatch(sha(url) + ":lost-[0-9a-f]{8}", part["uuid"]), part
        retry = s.e.chats()[-1].body["messages"][0]["content"]
        assert sorted(p["uuid"].split(":")[0] for p in retry) == sorted(map(sha, (A, B, C)))


async def test_an_item_only_in_ps_encoder_cache_goes_raw(fakes, publisher):
    # P's encoder cache holds B (its events), the store is not known to: a reference would be
    # failed by P's connector (it asks the store before the encoder cache is looked at), so B
    # goes raw with its uuid, and A, new, with it (one modality, no mix).
    import time

    from mmreuse.events.ec_wire import EncoderCacheEventBatch, EncoderCacheStored, encode_ec_batch
    from mmreuse.proxy.server import PROXY_KEY, build_app
    from tests.proxy.test_ec_events import _joined, _wait
    from tests.support.index_proxy import render
    from tests.support.proxy_fakes import proxy_client

    pub = publisher()
    e = await fakes("e")
    pd = await fakes("pd", render=render)
    argv = ["--encode-servers-urls", e.url, "--decode-servers-urls", pd.url, "--policy", "index",
            "--encoder-cache-events-endpoints", pub.endpoint,
            "--encoder-cache-events-replay-endpoints", pub.replay_endpoint, *REFERENCE]  # fmt: skip
    app = build_app(parse_args(argv, env={}))
    async with proxy_client(app) as client:
        proxy = app[PROXY_KEY]
        await _joined(pub)
        assert (await client.post("/v1/chat/completions", json=chat(TEXT, img(B)))).status == 200
        assert len(proxy.references) == 1  # B's reference is kept
        batch = EncoderCacheEventBatch(time.time(), [EncoderCacheStored(sha(B), 16)], 0)
        pub.publish(encode_ec_batch(batch))
        await _wait(lambda: sha(B) in proxy.availability.availability_for("PD0").p_local)
        r = await client.post("/v1/chat/completions", json=chat(TEXT, img(A), img(B)))
        assert r.status == 200
        content = pd.chats()[-1].body["messages"][0]["content"]
        assert content[1:] == [{**img(A), "uuid": sha(A)}, {**img(B), "uuid": sha(B)}]
        sample = proxy.registry.get_sample_value
        labels = {"instance": "PD0", "form": "raw"}
        assert sample("mmreuse_proxy_held_items_total", labels) == 1
        assert sample("mmreuse_proxy_occurrences_total", {"klass": "p_local"}) == 1


async def test_a_request_whose_every_item_is_kept_and_stored_is_decided_at_arrival():
    # Index with the store: a request with no new item, every one with E's reference kept and
    # in the store, goes to P at once as those references: no render, no plan (P's KV or its
    # connector serves each). One item out of the store: it waits for the render and plan.
    from mmreuse.embedding_store import embedding_key
    from tests.proxy.test_store import NS, Master

    master = await Master().start()
    try:
        flags = (*REFERENCE, "--e-store-url", master.url, "--e-store-namespace", NS)
        async with index_proxy(flags=flags) as s:

            def renders() -> int:
                return sum(x.path.endswith("/render") for x in s.pd[0].seen)

            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert e_sent(s) == [sha(A), sha(B)] and renders() == 0  # new: E at arrival
            master.held = {embedding_key(NS, sha(A)), embedding_key(NS, sha(B))}
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert renders() == 0 and e_sent(s) == [sha(A), sha(B)]
            assert pd_content(s) == [TEXT, embeds(A), embeds(B)]
            assert "ec_items" not in (s.pd[0].chats()[-1].body.get("ec_transfer_params") or {})
            assert s.sample("mmreuse_proxy_arrival_items_total", action="p_stored") == 2
            assert s.sample("mmreuse_proxy_held_items_total", instance="PD0", form="reference") == 2
            assert s.sample("mmreuse_proxy_occurrences_total", klass="unclassified") == 2

            master.held = {embedding_key(NS, sha(A))}  # B evicted from the store
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert renders() == 1  # planned: B needs E (E's cache has it)
            assert e_sent(s) == [sha(A), sha(B), sha(B)]
            assert s.sample("mmreuse_proxy_arrival_items_total", action="p_stored") == 2
    finally:
        await master.close()


async def test_under_demand_a_stored_request_goes_at_arrival_without_asking_p():
    # Demand: the store's own word is what P's connector loads, so a request whose every item
    # is kept and stored goes at arrival too: P is not asked and nothing is rendered.
    from mmreuse.embedding_store import embedding_key
    from tests.proxy.test_store import NS, Master

    master = await Master().start()
    try:
        flags = ("--policy", "demand", *REFERENCE, "--e-store-url", master.url,
                 "--e-store-namespace", NS)  # fmt: skip
        async with index_proxy(demand=True, flags=flags) as s:
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert sorted(e_sent(s)) == sorted([sha(A), sha(B)])
            asked, seen = len(s.ps[0].queries), len(s.pd[0].seen)
            master.held = {embedding_key(NS, sha(A)), embedding_key(NS, sha(B))}
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert len(s.ps[0].queries) == asked and len(s.pd[0].seen) == seen + 1
            assert pd_content(s) == [TEXT, embeds(A), embeds(B)]
            assert s.sample("mmreuse_proxy_arrival_items_total", action="p_stored") == 2

            master.held = {embedding_key(NS, sha(A))}  # B evicted: P is asked again
            assert (await s.post(chat(TEXT, img(A), img(B)))).status == 200
            assert len(s.ps[0].queries) > asked
            assert s.sample("mmreuse_proxy_arrival_items_total", action="p_stored") == 2
    finally:
        await master.close()


async def test_without_the_flag_a_stored_request_still_waits_for_its_plan():
    from mmreuse.embedding_store import embedding_key
    from tests.proxy.test_store import NS, Master

    master = await Master().start()
    try:
        flags = ("--e-store-url", master.url, "--e-store-namespace", NS)
        async with index_proxy(flags=flags) as s:
            master.held = {embedding_key(NS, sha(A))}
            assert (await s.post(chat(TEXT, img(A)))).status == 200
            assert sum(x.path.endswith("/render") for x in s.pd[0].seen) == 1
            assert pd_content(s) == [TEXT, {**img(A), "uuid": sha(A)}]
    finally:
        await master.close()

"""`mmreuse proxy --policy eager` as a drop-in for vLLM 0.33.0's reference EPD proxy
(`examples/disaggregated/disaggregated_encoder/disagg_epd_proxy.py`, static mode), over HTTP
against recording fake E / P / D / PD servers (tests/support/proxy_fakes.py). Each test names the
reference function whose behaviour it pins. The one deliberate difference: a streaming request
whose E, P or D stage fails gets an HTTP error status, where the reference answers 200 and then
breaks the stream."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any

import pytest

from mmreuse.proxy.server import PROXY_KEY
from tests.support.epd_proxy import epd
from tests.support.proxy_fakes import chat, img, refused_url, sha

HEX6 = "[0-9a-f]{6}"
HANG_GUARD_S = 3.0  # a bound on a read that must end at once (a hang guard, not a timing check)
KV_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def text(t: str) -> dict[str, Any]:
    return {"type": "text", "text": t}


def e_items(seen) -> list[dict[str, Any]]:
    """The media parts of one E sub-request."""
    return seen.body["messages"][0]["content"]


def child_index(seen) -> int:
    """The first item index in an E sub-request's `<req id>:<index>:<6 hex>`."""
    return int(seen.headers["x-request-id"].split(":")[-2])


# ---- routes -------------------------------------------------------------------------------------


async def test_chat_non_streaming_e_pd():
    # chat_completions -> forward_non_stream: decode's bytes, status and Content-Type come back.
    async with epd() as s:
        r = await s.post(chat(text("hi"), img("http://img/a.png")))
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("application/json")
        assert await r.json() == {
            "id": "chatcmpl-pd",
            "object": "chat.completion",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}}],
        }
        assert len(s.e[0].chats()) == 1 and len(s.pd.chats()) == 1
        assert s.pd.chats()[0].headers["x-request-id"] == "r1"
        assert s.e[0].chats()[0].headers["content-type"] == "application/json"


# The reference's test_http_roundtrip_preserves_payload_and_response_bytes: a multibyte
# character split across chunks, at the old 1024-byte forwarding boundary.
_PREFIX = b'data: {"content":"'
STREAM = _PREFIX + b"x" * (1023 - len(_PREFIX)) + '图片🌍"}\n\ndata: [DONE]\n\n'.encode()
STREAM_CHUNKS = (STREAM[:1024], STREAM[1024:1030], STREAM[1030:])


async def test_chat_streaming_bytes_forwarded_exactly():
    # forward_stream: decode's chunks, byte for byte (no SSE parsing, no re-chunking damage).
    async with epd() as s:
        s.pd.chunks = STREAM_CHUNKS
        r = await s.post(chat(text("描述图片🌍"), img("http://img/a.png"), stream=True))
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/event-stream")
        assert await r.read() == STREAM
        assert s.pd.chats()[0].body["stream"] is True


async def test_chat_without_media_reaches_decode_unchanged():
    # fanout_encoder_primer returns ({}, {}) without media; rewrite_for_decode returns req_data.
    body = chat(text("hello"), max_tokens=7, temperature=0.1, seed=3, logprobs=True)
    body["messages"].insert(0, {"role": "system", "content": "plain string content"})
    async with epd() as s:
        assert (await s.post(body)).status == 200
        assert s.e[0].chats() == []
        assert s.pd.chats()[0].body == body


# ---- the E sub-request --------------------------------------------------------------------------

OPTIONS = {
    "mm_processor_kwargs": {"max_pixels": 262144},
    "media_io_kwargs": {"image": {"image_mode": "RGB"}},
    "priority": -3,
    "session_id": "session-123",
}


@pytest.mark.parametrize("options", [{}, OPTIONS])
async def test_encoder_subrequest_shape(options):
    # fanout_encoder_primer: media parts only, each with its uuid, text removed, one user
    # message, "stream": false, no max_tokens; mm_processor_kwargs, media_io_kwargs, priority
    # and session_id copied when present; x-request-id "<req id>:<first index>:<6 hex>".
    a = img("http://img/a.png")
    body = chat(
        text("describe"),
        a,
        text("and"),
        max_tokens=32,
        temperature=0.5,
        stream=False,
        structured_outputs={"choice": ["A", "B"]},
        **options,
    )
    body["messages"].insert(0, {"role": "system", "content": "be brief"})
    async with epd() as s:
        assert (await s.post(body, request_id="req-7")).status == 200
        [sub] = s.e[0].chats()
        assert sub.body == {
            "model": "tiny",
            "messages": [{"role": "user", "content": [{**a, "uuid": sha("http://img/a.png")}]}],
            "stream": False,
            **options,
        }
        assert re.fullmatch(f"req-7:0:{HEX6}", sub.headers["x-request-id"])
        final = s.pd.chats()[0].body
        for key in ("model", "max_tokens", "temperature", "stream", "structured_outputs"):
            assert final[key] == body[key]
        for key, value in options.items():  # decode keeps them too
            assert final[key] == value


def test_generated_request_ids_are_uuid4s_as_str_uuid4_writes_them():
    from mmreuse.proxy.ids import new_uuid4

    ids = [new_uuid4() for _ in range(2000)]
    for rid in ids:
        u = uuid.UUID(rid)
        assert (u.version, u.variant, str(u)) == (4, uuid.RFC_4122, rid)
    assert len(set(ids)) == len(ids)


async def test_request_id_generated_when_the_client_sends_none():
    # chat_completions: req_id = x-request-id, else str(uuid.uuid4()).
    async with epd() as s:
        assert (await s.post(chat(img("http://img/a.png")), request_id=None)).status == 200
        rid = s.pd.chats()[0].headers["x-request-id"]
        assert uuid.UUID(rid).version == 4 and str(uuid.UUID(rid)) == rid
        assert uuid.UUID(rid).variant == uuid.RFC_4122
        assert re.fullmatch(f"{rid}:0:{HEX6}", s.e[0].chats()[0].headers["x-request-id"])
        await s.post(chat(img("http://img/a.png")), request_id=None)
        assert s.pd.chats()[1].headers["x-request-id"] != rid  # a fresh one per request


async def test_uuid_rule():
    # content_uuid and the `item.get("uuid") or content_uuid(item)` rule: the client's uuid,
    # else sha256 of the URL string, else sha256 of json.dumps(item, sort_keys=True).
    audio = {"type": "input_audio", "input_audio": {"format": "wav", "data": "UklGRg=="}}
    url_less = {"type": "image_url", "image_url": {"detail": "low"}}
    items = [img("http://img/a.png", uuid="client-1"), img("http://img/b.png"), audio, url_less]
    async with epd() as s:
        assert (await s.post(chat(*items))).status == 200
        uuids = {child_index(x): [p["uuid"] for p in e_items(x)] for x in s.e[0].chats()}
        assert uuids == {
            0: ["client-1", sha("http://img/b.png"), sha(json.dumps(url_less, sort_keys=True))],
            2: [sha(json.dumps(audio, sort_keys=True))],
        }
        content = s.pd.chats()[0].body["messages"][0]["content"]
        assert [p["uuid"] for p in content] == [uuids[0][0], uuids[0][1], uuids[2][0], uuids[0][2]]


# ---- batching -----------------------------------------------------------------------------------


async def test_images_to_the_same_encoder_share_one_subrequest():
    # fanout_encoder_primer: per-item round robin, then images grouped per encoder.
    images = [img(f"http://img/{i}.png") for i in range(4)]
    async with epd(n_e=2) as s:
        assert (await s.post(chat(*images), request_id="r")).status == 200
        for k, fake in enumerate(s.e):
            [sub] = fake.chats()
            assert [p["image_url"] for p in e_items(sub)] == [
                images[k]["image_url"],
                images[k + 2]["image_url"],
            ]
            assert re.fullmatch(f"r:{k}:{HEX6}", sub.headers["x-request-id"])
        assert s.sample("mmreuse_proxy_encoder_subrequests_total") == 2


@pytest.mark.parametrize(
    "batch, sizes", [("0", [[0, 2, 4], [1, 3, 5]]), ("1", [[0], [2], [4]]), ("2", [[0, 2], [4]])]
)
async def test_encoder_max_batch_size_caps_a_subrequest(batch, sizes):
    # ENCODER_MAX_BATCH_SIZE: at most that many images per sub-request (0: unlimited).
    urls = [f"http://img/{i}.png" for i in range(6)]
    async with epd(n_e=2, env={"ENCODER_MAX_BATCH_SIZE": batch}) as s:
        assert (await s.post(chat(*map(img, urls)))).status == 200
        groups = []
        for fake in s.e:
            subs = sorted(fake.chats(), key=child_index)
            groups.append([[urls.index(p["image_url"]["url"]) for p in e_items(x)] for x in subs])
            for x in subs:
                assert child_index(x) == urls.index(e_items(x)[0]["image_url"]["url"])
        flat = [g for per_encoder in groups for g in per_encoder]
        if batch == "0":
            assert flat == sizes
        else:
            assert groups[0] == sizes
            assert groups[1] == [[i + 1 for i in g] for g in sizes]
        assert sorted(i for g in flat for i in g) == list(range(6))


async def test_audio_and_video_go_one_per_subrequest():
    # fanout_encoder_primer: only image_url items are grouped.
    audio = {"type": "audio_url", "audio_url": {"url": "http://a/0.wav"}}
    video = {"type": "video_url", "video_url": {"url": "http://v/0.mp4"}}
    pcm = {"type": "input_audio", "input_audio": {"format": "wav", "data": "AAAA"}}
    items = [audio, img("http://img/0.png"), video, img("http://img/1.png"), pcm]
    async with epd() as s:
        assert (await s.post(chat(*items))).status == 200
        subs = sorted(s.e[0].chats(), key=child_index)
        assert [(child_index(x), [p["type"] for p in e_items(x)]) for x in subs] == [
            (0, ["audio_url"]),
            (1, ["image_url", "image_url"]),
            (2, ["video_url"]),
            (4, ["input_audio"]),
        ]


async def test_round_robin_cursor_continues_across_requests():
    # encoder_rr_assignment: the cursor persists across requests, contiguous.
    async with epd(n_e=2) as s:
        for i in range(3):
            await s.post(chat(img(f"http://img/single-{i}.png")))
        assert [len(f.chats()) for f in s.e] == [2, 1]
        assert e_items(s.e[1].chats()[0])[0]["image_url"]["url"] == "http://img/single-1.png"
        three = [img(f"http://img/three-{i}.png") for i in range(3)]
        await s.post(chat(*three))  # the cursor is at E1: items 0, 2 -> E1; item 1 -> E0
        assert [p["image_url"]["url"] for p in e_items(s.e[1].chats()[-1])] == [
            "http://img/three-0.png",
            "http://img/three-2.png",
        ]
        assert [p["image_url"]["url"] for p in e_items(s.e[0].chats()[-1])] == [
            "http://img/three-1.png"
        ]


# ---- matching E's ec_transfer_params ------------------------------------------------------------


def e_answer(params: dict[str, Any]):
    return lambda body: {"id": "e", "choices": [], "ec_transfer_params": params}


@pytest.mark.parametrize(
    "params, detail",
    [
        ({"h": {"metadata": {"g": [1]}, "item_indices": [0, 2]}}, "Invalid encoder item index"),
        ({"h": {"metadata": {"g": [1]}, "item_indices": [-1]}}, "Invalid encoder item index"),
        ({"h": {"metadata": {"g": [1]}, "item_indices": ["0"]}}, "Invalid encoder item index"),
        ({"h": {"metadata": {"g": [1]}, "item_indices": [True]}}, "Invalid encoder item index"),
        (
            {"h": {"metadata": {"g": [1]}, "item_indices": [0]}, "k": {"item_indices": [0, 1]}},
            "Duplicate encoder item index",
        ),
        ({"unknown": {"metadata": {"g": [1]}}}, "Encoder metadata cannot be matched"),
    ],
)
async def test_bad_encoder_indices_are_502(params, detail):
    # fanout_encoder_primer: HTTPException(502, ...) for each of these; decode is not called.
    async with epd() as s:
        s.e[0].answer = e_answer(params)
        r = await s.post(chat(img("http://img/a.png"), img("http://img/b.png")))
        assert r.status == 502
        assert await r.json() == {"detail": detail}
        assert s.pd.chats() == []


async def test_matching_by_item_indices_in_any_order():
    # The reference's test_image_batches_preserve_item_identity: positions, not order or uuid,
    # place E's features; a repeated image keeps one transfer per occurrence.
    urls = ["http://img/A", "http://img/A", "http://img/C"]

    def answer(body):
        params: dict[str, Any] = {}
        for i, part in enumerate(e_items_of(body)):
            u = part["image_url"]["url"]
            entry = params.setdefault(
                u + "-processed",
                {"metadata": {"image_grid_thw": [1, 2, ord(u[-1])]}, "item_indices": []},
            )
            entry["item_indices"].append(i)
        return {"ec_transfer_params": dict(reversed(list(params.items())))}

    async with epd() as s:
        s.e[0].answer = answer
        assert (await s.post(chat(*map(img, urls)))).status == 200
        final = s.pd.chats()[0].body
        content = final["messages"][0]["content"]
        assert [p["image_embeds"]["image_grid_thw"] for p in content] == [
            [1, 2, ord("A")],
            [1, 2, ord("A")],
            [1, 2, ord("C")],
        ]
        assert [p["uuid"] for p in content] == [sha(u) for u in urls]
        items = final["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == ["http://img/A-processed"] * 2 + [
            "http://img/C-processed"
        ]
        assert len({x["transfer_id"] for x in items}) == 3


def e_items_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return body["messages"][0]["content"]


async def test_matching_falls_back_to_the_uuid():
    # fanout_encoder_primer: without item_indices, an entry keyed by the item's uuid matches.
    def answer(body):
        parts = e_items_of(body)
        params = {
            p["uuid"]: {"metadata": {"image_grid_thw": [1, 2, 2 + i]}} for i, p in enumerate(parts)
        }
        return {"ec_transfer_params": dict(reversed(list(params.items())))}

    async with epd() as s:
        s.e[0].answer = answer
        assert (await s.post(chat(img("http://img/a"), img("http://img/b")))).status == 200
        content = s.pd.chats()[0].body["messages"][0]["content"]
        assert [p["image_embeds"] for p in content] == [
            {"image_grid_thw": [1, 2, 2]},
            {"image_grid_thw": [1, 2, 3]},
        ]


async def test_matching_a_single_item_by_its_only_entry():
    # fanout_encoder_primer: one item, one entry under any key (an engine-derived hash).
    handle = {"metadata": {"image_grid_thw": [[1, 2, 3]]}, "peer_port": 5601}
    async with epd() as s:
        s.e[0].answer = e_answer({"engine-hash": handle})
        assert (await s.post(chat(img("http://img/a")))).status == 200
        final = s.pd.chats()[0].body
        assert final["messages"][0]["content"] == [
            {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": [1, 2, 3]},
                "uuid": sha("http://img/a"),
            }
        ]
        assert final["ec_transfer_params"]["engine-hash"] == handle
        [item] = final["ec_transfer_params"]["ec_items"]
        assert item["mm_hash"] == "engine-hash"
        assert re.fullmatch("[0-9a-f]{32}", item["transfer_id"])


# ---- the PD rewrite -----------------------------------------------------------------------------


async def test_rewrite_for_decode():
    # rewrite_for_decode: each item E described becomes {"type": "image_embeds",
    # "image_embeds": <E's metadata, flattened per key>, "uuid": ...}; text untouched; E's
    # handles and ec_items on ec_transfer_params. The client's own ec_transfer_params is dropped
    # (a deliberate difference: the reference forwards it, a channel to P a client must not have).
    a, b = img("http://img/a.png"), img("http://img/b.png", uuid="client-b")
    body = chat(text("first"), a, text("second"), b, ec_transfer_params={"client": 1})
    handles = {
        sha("http://img/a.png"): {
            "metadata": {"image_grid_thw": [[1, 4, 4]]},
            "item_indices": [0],
            "peer_host": "e0",
        },
        "client-b": {
            "metadata": {"image_grid_thw": [1, 2, 2]},
            "item_indices": [1],
            "transfer_id": "reported-b",
        },
    }
    async with epd() as s:
        s.e[0].answer = e_answer(handles)
        assert (await s.post(body)).status == 200
        final = s.pd.chats()[0].body
        assert final["messages"][0]["content"] == [
            text("first"),
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 4]}, "uuid": sha("http://img/a.png")},
            text("second"),
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": "client-b"},
        ]  # fmt: skip
        params = final["ec_transfer_params"]
        assert set(params) == {"ec_items", *handles}
        for key, handle in handles.items():
            assert params[key] == handle
        items = params["ec_items"]
        assert [x["mm_hash"] for x in items] == [sha("http://img/a.png"), "client-b"]
        assert re.fullmatch("[0-9a-f]{32}", items[0]["transfer_id"])
        assert items[1]["transfer_id"] == "reported-b"  # E's own transfer id wins


async def test_an_item_without_metadata_stays_raw():
    # rewrite_for_decode: no metadata to size the placeholders with -> the media as sent (no
    # uuid added). Nothing rewritten: the body is the client's, plus E's handles, no ec_items.
    a = img("http://img/a.png")
    handle = {"metadata": {}, "item_indices": [0], "peer_port": 1}
    async with epd() as s:
        s.e[0].answer = e_answer({sha("http://img/a.png"): handle})
        body = chat(text("x"), a)
        assert (await s.post(body)).status == 200
        final = s.pd.chats()[0].body
        assert final == {**body, "ec_transfer_params": {sha("http://img/a.png"): handle}}


async def test_an_item_without_metadata_stays_raw_beside_another_modality():
    # rewrite_for_decode: per item; a video without metadata stays raw beside an image that
    # becomes a reference, and ec_items still names both.
    a = img("http://img/a.png")
    v = {"type": "video_url", "video_url": {"url": "http://v/0.mp4"}}

    def answer(body):
        part = e_items_of(body)[0]
        meta = {"image_grid_thw": [1, 2, 2]} if part["type"] == "image_url" else {}
        return {"ec_transfer_params": {part["uuid"]: {"metadata": meta, "item_indices": [0]}}}

    async with epd() as s:
        s.e[0].answer = answer
        assert (await s.post(chat(a, v))).status == 200
        final = s.pd.chats()[0].body
        content = final["messages"][0]["content"]
        assert content[0] == {
            "type": "image_embeds",
            "image_embeds": {"image_grid_thw": [1, 2, 2]},
            "uuid": sha("http://img/a.png"),
        }
        assert content[1] == v  # raw, without a uuid, as the reference leaves it
        assert [x["mm_hash"] for x in final["ec_transfer_params"]["ec_items"]] == [
            sha("http://img/a.png"),
            sha("http://v/0.mp4"),
        ]


async def test_one_modality_is_never_sent_half_raw():
    # Where mmreuse differs from rewrite_for_decode: vLLM refuses raw and embeds inputs of one
    # modality in one request, which the reference would send (P answers 400). mmreuse sends
    # that modality raw, each item with its uuid (P finds E's embeddings by uuid).
    a, b = img("http://img/a.png"), img("http://img/b.png")
    handles = {
        sha("http://img/a.png"): {"metadata": {"image_grid_thw": [1, 2, 2]}, "item_indices": [0]},
        sha("http://img/b.png"): {"metadata": {}, "item_indices": [1]},
    }
    async with epd() as s:
        s.e[0].answer = e_answer(handles)
        assert (await s.post(chat(a, b))).status == 200
        final = s.pd.chats()[0].body
        assert final["messages"][0]["content"] == [
            {**a, "uuid": sha("http://img/a.png")},
            {**b, "uuid": sha("http://img/b.png")},
        ]
        assert [x["mm_hash"] for x in final["ec_transfer_params"]["ec_items"]] == list(handles)


async def test_partial_audio_metadata_keeps_the_whole_request_raw():
    # The reference's test_partial_audio_metadata_falls_back_with_all_transfers: with audio in
    # the request and an item without metadata, every item goes raw with its uuid (the client's
    # kept), as E received it; E's handles and ec_items still reach decode.
    audio = {"type": "audio_url", "audio_url": {"url": "http://a/small.wav"}, "uuid": "user-audio"}
    second = img("http://img/large.png")

    def answer(body):
        part = e_items_of(body)[0]
        meta = {"audio_feature_lengths": [100]} if part["type"] == "audio_url" else {}
        return {
            "ec_transfer_params": {
                part["uuid"] + "-processed": {"metadata": meta, "item_indices": [0]}
            }
        }

    body = chat(audio, second, mm_processor_kwargs={"sampling_rate": 16000})
    async with epd() as s:
        s.e[0].answer = answer
        assert (await s.post(body)).status == 200
        final = s.pd.chats()[0].body
        content = final["messages"][0]["content"]
        sent = {child_index(x): e_items(x)[0] for x in s.e[0].chats()}
        assert content == [sent[0], sent[1]]
        assert content[0]["uuid"] == "user-audio"
        assert content[1] == {**second, "uuid": sha("http://img/large.png")}
        assert final["mm_processor_kwargs"] == {"sampling_rate": 16000}
        assert [x["mm_hash"] for x in final["ec_transfer_params"]["ec_items"]] == [
            "user-audio-processed",
            sha("http://img/large.png") + "-processed",
        ]


@pytest.mark.parametrize("has_metadata", [True, False])
async def test_video_with_its_audio_is_two_features(has_metadata):
    # The reference's test_video_audio_rewrite: with use_audio_in_video one video publishes a
    # video and an audio feature (item_indices [0] and [1]); both land on the one item.
    video = {"type": "video_url", "video_url": {"url": "http://v/with-audio.mp4"}}
    a, b = img("http://img/A"), img("http://img/B")
    video_meta = {"video_grid_thw": [4, 2, 2], "second_per_grid_ts": [0.5]} if has_metadata else {}
    audio_meta = {"audio_feature_lengths": [100]} if has_metadata else {}

    def answer(body):
        parts = e_items_of(body)
        if parts[0]["type"] == "video_url":
            params = {
                "video": {"modality": "video", "item_indices": [0], "metadata": video_meta},
                "audio": {"modality": "audio", "item_indices": [1], "metadata": audio_meta},
            }
        else:
            params = {
                p["image_url"]["url"][-1]: {
                    "metadata": {"image_grid_thw": [1, 2, 2 * (i + 1)]},
                    "item_indices": [i],
                }
                for i, p in enumerate(parts)
            }
        return {"ec_transfer_params": params}

    body = chat(a, video, b, mm_processor_kwargs={"use_audio_in_video": True})
    async with epd() as s:
        s.e[0].answer = answer
        assert (await s.post(body)).status == 200
        assert sorted(len(e_items(x)) for x in s.e[0].chats()) == [1, 2]
        final = s.pd.chats()[0].body
        content = final["messages"][0]["content"]
        if has_metadata:
            assert content == [
                {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 2]}, "uuid": sha("http://img/A")},
                {
                    "type": "video_embeds",
                    "video_embeds": video_meta,
                    "audio_embeds": audio_meta,
                    "uuid": sha("http://v/with-audio.mp4"),
                },
                {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 4]}, "uuid": sha("http://img/B")},
            ]  # fmt: skip
        else:  # an audio-bearing request with an item lacking metadata: all raw, with uuids
            assert content == [
                {**a, "uuid": sha("http://img/A")},
                {**video, "uuid": sha("http://v/with-audio.mp4")},
                {**b, "uuid": sha("http://img/B")},
            ]
        items = final["ec_transfer_params"]["ec_items"]
        assert [x["mm_hash"] for x in items] == ["A", "video", "audio", "B"]
        assert len({x["transfer_id"] for x in items}) == 4


async def test_encoder_without_ec_transfer_params_leaves_the_body():
    # fanout_encoder_primer returns ({}, {}); decode gets the client's body as it came.
    body = chat(text("x"), img("http://img/a.png"), max_tokens=5)
    async with epd() as s:
        s.e[0].answer = lambda _: {"id": "e", "choices": []}
        assert (await s.post(body)).status == 200
        assert s.pd.chats()[0].body == body


async def test_no_rewrite():
    # --no-rewrite (NO_REWRITE): E gets no uuid, decode gets the original media plus E's
    # handles, and no ec_items.
    a, b = img("http://img/a.png"), img("http://img/b.png")
    body = chat(text("x"), a, b)
    async with epd(flags=("--no-rewrite",)) as s:
        assert (await s.post(body)).status == 200
        assert e_items(s.e[0].chats()[0]) == [a, b]
        final = s.pd.chats()[0].body
        assert final["messages"] == body["messages"]
        assert set(final["ec_transfer_params"]) == {"hash-0", "hash-1"}  # the fake's keys


# ---- E + P + D ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("max_completion_tokens", [None, 64])
async def test_e_p_d(stream, max_completion_tokens):
    # process_prefill_stage: P gets max_tokens 1, stream false, kv_transfer_params asking for a
    # remote decode, no stream_options, max_completion_tokens 1 if present; maybe_prefill: D
    # gets P's kv_transfer_params; both get x-request-id = the request id.
    extra: dict[str, Any] = {"max_tokens": 32, "stream": stream}
    if stream:
        extra["stream_options"] = {"include_usage": True}
    if max_completion_tokens is not None:
        extra["max_completion_tokens"] = max_completion_tokens
    body = chat(text("x"), img("http://img/a.png"), **extra)
    async with epd(n_p=1) as s:
        r = await s.post(body, request_id="r-epd")
        assert r.status == 200
        if stream:
            assert await r.read() == b"".join(s.d[0].chunks)
        [p] = s.p[0].chats()
        [d] = s.d[0].chats()
        assert p.headers["x-request-id"] == d.headers["x-request-id"] == "r-epd"
        # P gets the rewritten body D gets, with its own fields in place of P's answer.
        rewritten = {k: v for k, v in d.body.items() if k != "kv_transfer_params"}
        expected_p = {
            **rewritten,
            "kv_transfer_params": KV_REMOTE_DECODE,
            "stream": False,
            "max_tokens": 1,
        }
        expected_p.pop("stream_options", None)
        if max_completion_tokens is not None:
            expected_p["max_completion_tokens"] = 1
        assert p.body == expected_p
        assert d.body["kv_transfer_params"] == {
            "remote_engine_id": "p-engine",
            "remote_block_ids": [1],
        }
        assert d.body["messages"][0]["content"][1]["type"] == "image_embeds"
        assert "ec_items" in d.body["ec_transfer_params"]
        for key, value in extra.items():
            assert d.body[key] == value  # D keeps the client's stream, stream_options, limits
        assert s.sample("mmreuse_proxy_stage_seconds_count", stage="prefill") == 1


async def test_e_p_d_prefill_without_kv_transfer_params():
    # maybe_prefill: no kv_transfer_params from P -> D gets the body without any.
    async with epd(n_p=1) as s:
        s.p[0].answer = lambda _: {"id": "p", "choices": []}
        assert (await s.post(chat(img("http://img/a.png")))).status == 200
        assert "kv_transfer_params" not in s.d[0].chats()[0].body


@pytest.mark.parametrize("stream", [False, True])
async def test_prefill_failure_is_an_error_status(stream):
    # process_prefill_stage: the reference answers every P failure as 500 {"error": "Prefill
    # processing error", ...}; mmreuse keeps P's status (and 502 when P is unreachable). Either
    # way D is not called.
    async with epd(n_p=1) as s:
        s.p[0].fail["/v1/chat/completions"] = [503]
        r = await s.post(chat(img("http://img/a.png"), stream=stream))
        assert r.status == 503
        assert (await r.json())["detail"] == {
            "error": "Prefill request failed",
            "message": "injected 503",
        }
        assert s.d[0].chats() == []
    async with epd(n_p=1) as s:
        await s.p[0].close()
        r = await s.post(chat(img("http://img/a.png"), stream=stream))
        assert r.status == 502
        assert (await r.json())["detail"]["error"] == "Prefill processing error"


# ---- decode retries and errors ------------------------------------------------------------------


async def test_decode_500_is_retried_once_with_a_re_encode():
    # forward_non_stream: a decode 500 re-runs prepare_for_decode (E again, a fresh transfer).
    body = chat(text("x"), img("http://img/a.png"), img("http://img/b.png"))
    async with epd() as s:
        calls = []

        def answer(b):
            calls.append(b)
            parts = e_items_of(b)
            return {
                "ec_transfer_params": {
                    p["uuid"]: {
                        "metadata": {"image_grid_thw": [1, 2, 2]},
                        "item_indices": [i],
                        "peer_port": len(calls),
                    }
                    for i, p in enumerate(parts)
                }
            }

        s.e[0].answer = answer
        s.pd.fail["/v1/chat/completions"] = [500]
        r = await s.post(body)
        assert r.status == 200
        first, second = s.e[0].chats()
        assert first.body == second.body  # the same raw items: the body was not mutated
        assert [p["type"] for p in e_items(second)] == ["image_url", "image_url"]
        d1, d2 = s.pd.chats()
        assert d1.body["messages"] == d2.body["messages"]
        handles = {k: v for k, v in d2.body["ec_transfer_params"].items() if k != "ec_items"}
        assert {v["peer_port"] for v in handles.values()} == {2}  # attempt 2's handles only
        ids1 = {x["transfer_id"] for x in d1.body["ec_transfer_params"]["ec_items"]}
        ids2 = {x["transfer_id"] for x in d2.body["ec_transfer_params"]["ec_items"]}
        assert len(ids1) == len(ids2) == 2 and not ids1 & ids2
        assert s.sample("mmreuse_proxy_fallbacks_total", instance="PD0", kind="retry") == 1


async def test_e_p_d_retry_starts_from_the_client_body():
    # test_maybe_prefill_leaves_the_caller_body_untouched: attempt 1's remote_block_ids must not
    # reach attempt 2.
    async with epd(n_p=1) as s:
        count = iter(range(1, 10))
        s.p[0].answer = lambda _: {"kv_transfer_params": {"remote_block_ids": [next(count)]}}
        s.d[0].fail["/v1/chat/completions"] = [500]
        assert (await s.post(chat(img("http://img/a.png")))).status == 200
        p1, p2 = s.p[0].chats()
        strip = lambda b: {k: v for k, v in b.items() if k != "ec_transfer_params"}  # noqa: E731
        assert strip(p1.body) == strip(p2.body)  # transfer ids are fresh per attempt
        assert p2.body["kv_transfer_params"] == KV_REMOTE_DECODE
        assert p2.body["messages"][0]["content"][0]["type"] == "image_embeds"
        assert [d.body["kv_transfer_params"] for d in s.d[0].chats()] == [
            {"remote_block_ids": [1]},
            {"remote_block_ids": [2]},
        ]
        assert len(s.e[0].chats()) == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_decode_retries_zero_disables_the_retry(stream):
    # DECODE_RETRIES = max(0, --decode-retries): 0 answers decode's first 500.
    async with epd(flags=("--decode-retries", "0")) as s:
        s.pd.fail["/v1/chat/completions"] = [500]
        r = await s.post(chat(img("http://img/a.png"), stream=stream))
        assert r.status == 500
        assert await r.json() == {"detail": "injected 500"}
        assert len(s.e[0].chats()) == 1 and len(s.pd.chats()) == 1


async def test_decode_retries_two():
    # forward_non_stream: range(DECODE_RETRIES + 1) attempts, each re-encoding.
    async with epd(flags=("--decode-retries", "2")) as s:
        s.pd.fail["/v1/chat/completions"] = [500, 500]
        assert (await s.post(chat(img("http://img/a.png")))).status == 200
        assert len(s.e[0].chats()) == len(s.pd.chats()) == 3
    async with epd() as s:  # the default, 1: a second 500 is the answer
        s.pd.fail["/v1/chat/completions"] = [500, 500]
        r = await s.post(chat(img("http://img/a.png")))
        assert r.status == 500 and await r.json() == {"detail": "injected 500"}
        assert len(s.e[0].chats()) == len(s.pd.chats()) == 2


@pytest.mark.parametrize("status", [400, 404, 422, 429, 502, 503])
@pytest.mark.parametrize("stream", [False, True])
async def test_decode_errors_other_than_500_propagate(status, stream):
    # forward_non_stream: HTTPException(resp.status, detail=<decode's text>); no retry. Streaming,
    # the reference's forward_stream breaks its 200 stream (raise_for_status); mmreuse answers
    # the same status as non-streaming.
    async with epd() as s:
        s.pd.fail["/v1/chat/completions"] = [status]
        r = await s.post(chat(img("http://img/a.png"), stream=stream))
        assert r.status == status
        assert r.headers["Content-Type"].startswith("application/json")
        assert await r.json() == {"detail": f"injected {status}"}
        assert len(s.e[0].chats()) == len(s.pd.chats()) == 1


@pytest.mark.parametrize("status", [400, 429, 500, 503])
@pytest.mark.parametrize("stream", [False, True])
async def test_encoder_failure_status_propagates(status, stream):
    # fanout_encoder_primer: HTTPException(r.status, "Encoder request failed: <text>"); an E
    # failure is not retried (only decode's 500 is); decode never sees the request.
    async with epd(n_e=2) as s:
        s.e[1].fail["/v1/chat/completions"] = [status]
        r = await s.post(chat(img("http://img/a.png"), img("http://img/b.png"), stream=stream))
        assert r.status == status
        assert await r.json() == {"detail": f"Encoder request failed: injected {status}"}
        assert s.pd.chats() == []
        assert s.sample("mmreuse_proxy_errors_total", stage="encode") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_unreachable_encoder_is_502(stream):
    # fanout_encoder_primer: an exception from a sub-request -> 502 "Encoder request failed: ...".
    async with epd(e_urls=[refused_url()]) as s:
        r = await s.post(chat(img("http://img/a.png"), stream=stream))
        assert r.status == 502
        assert (await r.json())["detail"].startswith("Encoder request failed: ")
        assert s.pd.chats() == []


async def test_unreachable_decode_is_500(caplog):
    # forward_non_stream: any other exception -> 500 "Proxy error: ...". mmreuse counts it as
    # decode's and logs it in a line: a dead PD under load is not a traceback per request.
    async with epd(d_urls=[refused_url()]) as s:
        r = await s.post(chat(img("http://img/a.png")))
        assert r.status == 500
        assert (await r.json())["detail"].startswith("Proxy error: ")
        assert s.sample("mmreuse_proxy_errors_total", stage="decode") == 1
        assert not [rec for rec in caplog.records if rec.exc_info]


async def test_invalid_json_body_is_an_error():
    # chat_completions: the reference answers 500 "Request processing error"; mmreuse 400.
    async with epd() as s:
        r = await s.client.post("/v1/chat/completions", data=b"{not json")
        assert r.status == 400
        assert "detail" in await r.json()
        r = await s.client.post("/v1/chat/completions", json=[1, 2])
        assert r.status == 400
        assert s.e[0].chats() == [] and s.pd.chats() == []


# ---- streaming failures: an HTTP error status, not a broken 200 stream ------------------------


async def test_streaming_decode_500_before_the_first_byte_is_retried():
    # forward_stream: a 500 before anything was streamed is retried with a re-encode.
    async with epd() as s:
        s.pd.chunks = STREAM_CHUNKS
        s.pd.fail["/v1/chat/completions"] = [500]
        r = await s.post(chat(img("http://img/a.png"), stream=True))
        assert r.status == 200
        assert await r.read() == STREAM
        assert len(s.e[0].chats()) == len(s.pd.chats()) == 2


async def test_streaming_failures_are_http_errors():
    # Where mmreuse differs: the reference's StreamingResponse has sent 200 before E runs, so
    # its E / decode failures break the stream; mmreuse answers the error status.
    async with epd() as s:
        s.e[0].fail["/v1/chat/completions"] = [503]
        r = await s.post(chat(img("http://img/a.png"), stream=True))
        assert r.status == 503
        assert r.headers["Content-Type"].startswith("application/json")
        assert await r.json() == {"detail": "Encoder request failed: injected 503"}
        s.pd.fail["/v1/chat/completions"] = [500, 500]
        r = await s.post(chat(img("http://img/a.png"), stream=True))
        assert r.status == 500
        assert await r.json() == {"detail": "injected 500"}
        assert s.sample("mmreuse_proxy_requests_total", policy="eager", outcome="server_error") == 2


async def test_decode_dropping_the_stream_mid_way_ends_it_with_an_error_event():
    # forward_stream: once bytes went out, the reference can only end the stream broken (it
    # raises inside its generator and the server drops the connection), which a client may
    # take for a whole answer. mmreuse ends it as vLLM ends a stream it fails: the bytes
    # forwarded, an error event, [DONE], promptly.
    async with epd() as s:
        s.pd.chunks = STREAM_CHUNKS
        s.pd.abort_after = 1
        r = await s.post(chat(img("http://img/a.png"), stream=True))
        assert r.status == 200
        got = await asyncio.wait_for(r.read(), HANG_GUARD_S)  # TimeoutError: it hung
        assert got.startswith(STREAM_CHUNKS[0])
        rest = got[len(STREAM_CHUNKS[0]) :].split(b"\n\n")
        assert rest[1:] == [b"data: [DONE]", b""], rest
        error = json.loads(rest[0].removeprefix(b"data: "))["error"]
        assert (error["code"], error["type"]) == (502, "BadGatewayError")


# ---- transport ----------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_compressing_backends(stream):
    # The reference's sessions decompress (aiohttp's default): a backend that gzips its answers
    # (a compressing front end) still gives the client plain JSON / SSE, and E's metadata and
    # P's kv_transfer_params are still read.
    async with epd(n_p=1) as s:
        for fake in (*s.e, *s.p, *s.d):
            fake.gzip = True
        r = await s.post(chat(img("http://img/a.png"), stream=stream))
        assert r.status == 200
        if stream:
            assert await r.read() == b"".join(s.d[0].chunks)
        else:
            assert (await r.json())["id"] == "chatcmpl-d"
        final = s.d[0].chats()[0].body
        assert final["messages"][0]["content"][0]["type"] == "image_embeds"  # E was read
        assert final["kv_transfer_params"]["remote_engine_id"] == "p-engine"  # P was read


async def test_log_requests_serves_the_same():
    # --log-requests (log_requests middleware): logging only, the answer is the same.
    async with epd(flags=("--log-requests",)) as s:
        r = await s.post(chat(img("http://img/a.png")))
        assert r.status == 200 and (await r.json())["id"] == "chatcmpl-pd"


@pytest.mark.parametrize("n_p", [0, 2])
async def test_p_and_d_chosen_at_random(n_p):
    # chat_completions: random.choice(p_urls), random.randrange(len(d_urls)) per request.
    async with epd(n_p=n_p, n_d=2, seed=0) as s:
        for i in range(16):
            assert (await s.post(chat(img(f"http://img/{i}")))).status == 200
        for fakes in (s.p, s.d) if n_p else (s.d,):
            counts = [len(f.chats()) for f in fakes]
            assert sum(counts) == 16 and min(counts) > 0


async def test_a_large_media_body_is_accepted():
    # The reference (FastAPI) sets no body limit; base64 images are megabytes.
    big = img("data:image/png;base64," + "A" * (3 << 20))
    async with epd() as s:
        assert (await s.post(chat(big))).status == 200
        assert e_items(s.e[0].chats()[0])[0]["image_url"] == big["image_url"]


@pytest.mark.parametrize("server_keep_alive", ["0.1", "1", "2", "5", "30"])
async def test_pooled_connections_are_retired_before_the_server_closes_them(server_keep_alive):
    # The reference's test of the same name (on_startup): vLLM closes idle keep-alive
    # connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds; the pool must drop them first.
    async with epd(env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": server_keep_alive}) as s:
        session = s.app[PROXY_KEY].session
        assert session is not None
        assert session.connector._keepalive_timeout < float(server_keep_alive)  # no public accessor
        upstream = s.app[PROXY_KEY].upstream  # E's, P's and D's POSTs
        assert upstream is not None and upstream.keepalive_s is not None
        assert upstream.keepalive_s < float(server_keep_alive)
        assert (await s.post(chat(img("http://img/a")))).status == 200


async def test_no_keep_alive_server_means_no_pooling():
    # on_startup: VLLM_HTTP_TIMEOUT_KEEP_ALIVE=0 -> force_close (no pooled connection).
    async with epd(env={"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "0"}) as s:
        session = s.app[PROXY_KEY].session
        assert session is not None and session.connector.force_close
        upstream = s.app[PROXY_KEY].upstream
        assert upstream is not None and upstream.keepalive_s is None
        assert (await s.post(chat(img("http://img/a")))).status == 200

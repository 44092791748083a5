"""`--uuid-policy content`: every item named by the bytes the proxy forwards, namespaced by the
cache salt. A forged or reused client uuid names nothing; a URL whose content changed is a new
item; http(s) media is fetched within bounds (bytes, time, redirects, hosts) and forwarded
inline, so E and P encode exactly the bytes named."""

from __future__ import annotations

import asyncio
import base64
import gzip
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from mmreuse.proxy.config import parse_args
from mmreuse.proxy.content import content_name, embeds_name
from mmreuse.proxy.errors import ProxyError
from tests.support.epd_proxy import epd
from tests.support.index_proxy import TEXT, e_sent, index_proxy
from tests.support.proxy_fakes import chat, img

CONTENT = ("--uuid-policy", "content")
PNG_A = b"\x89PNG\r\n\x1a\n" + b"a" * 100
PNG_B = b"\x89PNG\r\n\x1a\n" + b"b" * 100


def data_url(body: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(body).decode()}"


def name(body: bytes, salt: str | None = None) -> str:
    return content_name(salt, "image", data_url(body))


def uuids_at(backend) -> list[str]:
    return [
        p["uuid"] for x in backend.chats() for p in x.body["messages"][0]["content"] if "uuid" in p
    ]


def media_at(backend) -> list[str]:
    return [
        p["image_url"]["url"]
        for x in backend.chats()
        for p in x.body["messages"][0]["content"]
        if p.get("type") == "image_url"
    ]


@dataclass
class Media:
    """A media origin on loopback: `files` served by name (changeable), a redirect, bodies too
    big (declared or streamed), a gzip bomb and a slow answer; `hits` counts each path."""

    files: dict[str, bytes] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)
    server: TestServer | None = None

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        assert self.server is not None
        return f"http://{host}:{self.server.port}{path}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] = self.hits.get(path, 0) + 1
        if path.startswith("/img/") and path[5:] in self.files:
            return web.Response(body=self.files[path[5:]], content_type="image/png")
        if path == "/redirect":
            raise web.HTTPFound(request.query["to"])
        if path == "/loop":
            raise web.HTTPFound("/loop")
        if path == "/declared-big":
            return web.Response(body=b"x" * 4096, content_type="image/png")
        if path == "/streamed-big":
            resp = web.StreamResponse(headers={"Content-Type": "image/png"})
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            for _ in range(64):
                await resp.write(b"x" * 1024)
            return resp
        if path == "/bomb":  # 64 MiB of zeros in ~64 KiB on the wire
            body = gzip.compress(b"\0" * (64 << 20), compresslevel=9)
            return web.Response(
                body=body, headers={"Content-Encoding": "gzip", "Content-Type": "image/png"}
            )
        if path == "/slow":
            await asyncio.sleep(5)
            return web.Response(body=PNG_A, content_type="image/png")
        return web.Response(status=404)


@pytest.fixture
async def media() -> AsyncIterator[Media]:
    origin = Media()
    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", origin.handle)
    origin.server = TestServer(app, host="127.0.0.1")
    await origin.server.start_server()
    yield origin
    await origin.server.close()


@asynccontextmanager
async def content_proxy(*flags: str):
    async with epd(flags=(*CONTENT, *flags)) as s:
        yield s


# ---- names: the bytes, never the client's uuid -------------------------------------------------


async def test_a_forged_uuid_names_nothing_the_bytes_do():
    # Tenant B claims the uuid tenant A's image has: under content the claim is only a hint, so
    # B's item is named by B's bytes; the same bytes under any claimed uuid are one item.
    async with content_proxy() as s:
        await s.post(chat(img(data_url(PNG_A), uuid="a-photo")))
        await s.post(chat(img(data_url(PNG_B), uuid="a-photo")))  # forged: B's own bytes
        await s.post(chat(img(data_url(PNG_A), uuid="another-name")))  # A's bytes renamed
        assert uuids_at(s.e[0]) == [name(PNG_A), name(PNG_B), name(PNG_A)]
        assert uuids_at(s.pd) == uuids_at(s.e[0])  # P keys each as E did


async def test_the_salt_namespaces_content_names():
    async with content_proxy() as s:
        for salt in ("t1", "t2", None):
            await s.post(chat(img(data_url(PNG_A)), **({"cache_salt": salt} if salt else {})))
        assert uuids_at(s.e[0]) == [name(PNG_A, "t1"), name(PNG_A, "t2"), name(PNG_A)]
        assert len(set(uuids_at(s.e[0]))) == 3


async def test_a_uuid_without_media_is_refused_before_any_backend():
    # vLLM's "reuse my cached item" part names an embedding by uuid alone: nothing can check
    # what it names, so content refuses it (reference and tenant forward it).
    async with content_proxy() as s:
        r = await s.post(chat({"type": "image_url", "image_url": None, "uuid": "x"}))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert "messages[0].content[0]" in detail and "--uuid-policy content" in detail
        assert s.e[0].chats() == [] and s.pd.chats() == []
        assert s.sample("mmreuse_proxy_errors_total", stage="media") == 1


async def test_video_frames_are_named_by_the_text_that_carries_them():
    # A video/jpeg data URL is comma-separated frames (vLLM decodes each): its whole text is
    # named, so two videos that differ only in their last frame are two items.
    f1, f2, f3 = (base64.b64encode(x).decode() for x in (b"one", b"two", b"three"))
    videos = [f"data:video/jpeg;base64,{f1},{f2}", f"data:video/jpeg;base64,{f1},{f3}"]
    async with content_proxy() as s:
        for v in videos:
            await s.post(chat({"type": "video_url", "video_url": {"url": v}}))
        assert uuids_at(s.e[0]) == [content_name(None, "video", v) for v in videos]
        assert len(set(uuids_at(s.e[0]))) == 2


async def test_one_text_as_two_modalities_is_two_items():
    url = data_url(PNG_A)
    async with content_proxy() as s:
        await s.post(chat(img(url), {"type": "video_url", "video_url": {"url": url}}))
        assert uuids_at(s.e[0]) == [name(PNG_A), content_name(None, "video", url)]


async def test_input_audio_and_embeds_are_named_by_their_payload():
    audio = {"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFF").decode(),
                                                   "format": "wav"}}  # fmt: skip
    embeds = {"type": "image_embeds", "image_embeds": "AAAA", "uuid": "shared-name"}
    async with content_proxy() as s:
        assert (await s.post(chat(audio, cache_salt="t"))).status == 200
        text = '{"data":"UklGRg==","format":"wav"}'  # its canonical JSON
        assert uuids_at(s.e[0]) == [content_name("t", "audio", text)]
        assert (await s.post(chat(embeds, TEXT, cache_salt="t"))).status == 200
        [sent] = [p for p in s.pd.chats()[-1].body["messages"][0]["content"] if "uuid" in p]
        assert sent["uuid"] == embeds_name("t", "image_embeds", "AAAA") != "shared-name"
        assert sent["image_embeds"] == "AAAA"  # the input itself is forwarded as is


# ---- fetched media: inlined, so the bytes named are the bytes encoded --------------------------


async def test_a_url_whose_content_changed_is_a_new_item(media):
    media.files["cat.png"] = PNG_A
    async with content_proxy() as s:
        await s.post(chat(img(media.url("/img/cat.png"))))
        media.files["cat.png"] = PNG_B  # the origin now serves other bytes at the same URL
        await s.post(chat(img(media.url("/img/cat.png"))))
        await s.post(chat(img(data_url(PNG_A))))  # A's bytes inline: the item fetched first
        assert uuids_at(s.e[0]) == [name(PNG_A), name(PNG_B), name(PNG_A)]
        # E and P got the bytes themselves: neither fetches, so neither can see other bytes
        assert media_at(s.e[0]) == [data_url(PNG_A), data_url(PNG_B), data_url(PNG_A)]
        assert media.hits["/img/cat.png"] == 2
        assert s.sample("mmreuse_proxy_media_fetched_bytes_total") == 2 * len(PNG_A)


async def test_a_redirect_is_followed_and_each_hop_checked(media):
    media.files["cat.png"] = PNG_A
    target = media.url("/img/cat.png")
    async with content_proxy() as s:
        assert (await s.post(chat(img(media.url(f"/redirect?to={target}"))))).status == 200
        assert uuids_at(s.e[0]) == [name(PNG_A)]
    # Only localhost allowed: a hop to 127.0.0.1 is refused before it is requested.
    async with content_proxy("--allowed-media-domains", "localhost") as s:
        r = await s.post(chat(img(media.url(f"/redirect?to={target}", host="localhost"))))
        assert (
            r.status == 400
            and "'127.0.0.1' is not in --allowed-media-domains" in (await r.json())["detail"]
        )
        assert media.hits["/img/cat.png"] == 1  # the first run's only
        r = await s.post(chat(img(target)))
        assert r.status == 400 and media.hits["/img/cat.png"] == 1
        assert s.e[0].chats() == [] and s.pd.chats() == []


@pytest.mark.parametrize(
    "path, why",
    [
        ("/declared-big", "over 1000 bytes"),
        ("/streamed-big", "over 1000 bytes"),
        ("/bomb", "over 1000 bytes"),
        ("/loop", "over 5 redirects"),
        ("/missing", "answered HTTP 404"),
    ],
)
async def test_media_past_its_bounds_is_a_400(media, path, why):
    async with content_proxy("--media-max-bytes", "1000") as s:
        r = await s.post(chat(TEXT, img(media.url(path))))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert why in detail and "messages[0].content[1]" in detail
        assert s.e[0].chats() == [] and s.pd.chats() == []


async def test_a_slow_origin_costs_the_fetch_timeout_not_more(media):
    async with content_proxy("--media-fetch-timeout", "0.3") as s:
        t0 = asyncio.get_running_loop().time()
        r = await s.post(chat(img(media.url("/slow"))))
        assert r.status == 400 and "took over 0.3 s" in (await r.json())["detail"]
        assert asyncio.get_running_loop().time() - t0 < 3


async def test_an_embeds_part_of_a_uuid_alone_is_refused():
    async with content_proxy() as s:
        r = await s.post(chat(TEXT, {"type": "image_embeds", "image_embeds": None, "uuid": "u"}))
        assert r.status == 400 and "names no embedding" in (await r.json())["detail"]


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://127.0.0.1/x.png"])
async def test_the_proxy_fetches_only_http(url):
    async with content_proxy() as s:
        r = await s.post(chat(img(url)))
        assert (
            r.status == 400
            and "is not an http(s), data: or input_audio item" in (await r.json())["detail"]
        )


async def test_the_index_plans_on_content_names():
    # The render P is asked to key by the content names, so the index finds a tenant's KV under
    # them: an item P holds is skipped, another tenant's same bytes are not.
    async with index_proxy(flags=CONTENT) as s:
        a1, b1 = name(PNG_A, "t1"), name(PNG_B, "t1")
        await s.hold(0, [a1, b1], 4, cache_salt="t1")  # P holds t1's prompt up to past A
        pair = (TEXT, img(data_url(PNG_A)), img(data_url(PNG_B)))
        assert (await s.post(chat(*pair, cache_salt="t1"))).status == 200
        assert e_sent(s) == [b1]  # A is KV-covered under its content name
        assert (await s.post(chat(*pair, cache_salt="t2"))).status == 200
        assert e_sent(s)[1:] == [name(PNG_A, "t2"), name(PNG_B, "t2")]


# ---- flags -------------------------------------------------------------------------------------


BASE = ["--encode-servers-urls", "http://e:1", "--decode-servers-urls", "http://d:2"]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--allowed-media-domains", "a.com"], "--allowed-media-domains bounds what"),
        (["--media-max-bytes", "10", "--uuid-policy", "tenant"], "under --uuid-policy tenant"),
        ([*CONTENT, "--media-max-bytes", "0"], "--media-max-bytes=0 must be >= 1"),
        ([*CONTENT, "--media-fetch-timeout", "inf"], "--media-fetch-timeout=inf must be"),
        ([*CONTENT, "--allowed-media-domains", "http://a.com"], "must be host names"),
        ([*CONTENT, "--no-rewrite"], "--no-rewrite with --uuid-policy content"),
    ],
)
def test_media_flags_are_checked(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, *flags], env={})
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_media_flags_set_the_limits():
    cfg = parse_args([*BASE, *CONTENT, "--allowed-media-domains", "A.com", "b.org",
                      "--media-max-bytes", "5", "--media-fetch-timeout", "2.5"], env={})  # fmt: skip
    assert cfg.media.allowed_domains == {"a.com", "b.org"}
    assert (cfg.media.max_item_bytes, cfg.media.timeout_s) == (5, 2.5)


async def test_a_requests_media_is_bounded_in_all_not_only_per_item():
    # Three fetched items of 400 bytes under a 1,000-byte request bound: the third is refused,
    # whichever order they arrive in; two fit.
    from mmreuse.proxy.content import MediaFetcher, MediaLimits, name_by_content

    async def get(url, cap, timeout_s, charge):
        await asyncio.sleep(0)
        for _ in range(4):
            charge(100)
            await asyncio.sleep(0)
        return 200, {"Content-Type": "image/png"}, b"x" * 400

    limits = MediaLimits(max_item_bytes=500, max_request_bytes=1000)
    urls = [f"http://origin/{i}.png" for i in range(3)]
    with pytest.raises(ProxyError) as e:
        await name_by_content(chat(*(img(u) for u in urls)), MediaFetcher(limits, get))
    assert e.value.status == 400 and "over 1000 in all" in e.value.detail
    two = chat(*(img(u) for u in urls[:2]))
    assert await name_by_content(two, MediaFetcher(limits, get)) == 800
    assert [p["image_url"]["url"] for p in two["messages"][0]["content"]] == [
        data_url(b"x" * 400)
    ] * 2

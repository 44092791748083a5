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
from mmreuse.proxy.content import MediaLimits, content_name, embeds_name
from mmreuse.proxy.errors import ProxyError
from tests.support.epd_proxy import epd
from tests.support.index_proxy import TEXT, e_sent, index_proxy
from tests.support.proxy_fakes import chat, img

CONTENT = ("--uuid-policy", "content")
# The test origins are on loopback, which the fetcher refuses unless the operator allows it.
LOOPBACK = ("--allow-private-media-networks", "127.0.0.0/8", "::1")
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
    cookies: list[str | None] = field(default_factory=list)  # each request's Cookie header
    release: asyncio.Event = field(default_factory=asyncio.Event)  # ends every /hold
    server: TestServer | None = None

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        assert self.server is not None
        return f"http://{host}:{self.server.port}{path}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        self.hits[path] = self.hits.get(path, 0) + 1
        self.cookies.append(request.headers.get("Cookie"))
        if path == "/cookie":  # an origin that hands its visitor a session
            resp = web.Response(body=PNG_A, content_type="image/png")
            resp.set_cookie("session", "tenant-A-secret")
            return resp
        if path == "/hold":  # an origin that answers when the test says so
            await self.release.wait()
            return web.Response(body=PNG_A, content_type="image/png")
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
            await asyncio.sleep(5)  # a slow origin: what the fetch timeouts are tested against
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
    origin.release.set()
    await origin.server.close()


@asynccontextmanager
async def content_proxy(*flags: str):
    async with epd(flags=(*CONTENT, *flags)) as s:
        yield s


def media_proxy(*flags: str):
    """A content proxy that may fetch from the loopback test origin."""
    return content_proxy(*LOOPBACK, *flags)


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
    async with media_proxy() as s:
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
    async with media_proxy() as s:
        assert (await s.post(chat(img(media.url(f"/redirect?to={target}"))))).status == 200
        assert uuids_at(s.e[0]) == [name(PNG_A)]
    # Only localhost allowed: a hop to 127.0.0.1 is refused before it is requested.
    async with media_proxy("--allowed-media-domains", "localhost") as s:
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
        ("/missing", "HTTP 404 error"),
    ],
)
async def test_media_past_its_bounds_is_a_400(media, path, why):
    async with media_proxy("--media-max-bytes", "1000") as s:
        r = await s.post(chat(TEXT, img(media.url(path))))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert why in detail and "messages[0].content[1]" in detail
        assert s.e[0].chats() == [] and s.pd.chats() == []


async def test_a_slow_origin_costs_the_fetch_timeout_not_more(media):
    async with media_proxy("--media-fetch-timeout", "0.3") as s:
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
        (["--allow-private-media-networks", "10.0.0.0/8"], "under --uuid-policy reference"),
        (["--media-max-redirects", "0"], "--media-max-redirects bounds what"),
        (
            [*CONTENT, "--allow-private-media-networks", "10.0.0.0/33"],
            "--allow-private-media-networks: '10.0.0.0/33' is not an IP network",
        ),
        ([*CONTENT, "--media-max-redirects", "-1"], "--media-max-redirects=-1 must be >= 0"),
        ([*CONTENT, "--media-request-timeout", "0"], "--media-request-timeout=0.0 must be"),
    ],
)
def test_media_flags_are_checked(capsys, flags, message):
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, *flags], env={})
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_media_flags_set_the_limits():
    cfg = parse_args([*BASE, *CONTENT, "--allowed-media-domains", "A.com", "b.org",
                      "--media-max-bytes", "5", "--media-fetch-timeout", "2.5"], env={})  # fmt: skip
    assert cfg.media.fetch.allowed_domains == {"a.com", "b.org"}
    assert (cfg.media.fetch.max_item_bytes, cfg.media.fetch.timeout_s) == (5, 2.5)
    cfg = parse_args([*BASE, *CONTENT, "--allow-private-media-networks", "10.0.0.0/8", "::1",
                      "--media-max-redirects", "0", "--media-request-timeout", "7"], env={})  # fmt: skip
    assert [str(n) for n in cfg.media.fetch.private_networks] == ["10.0.0.0/8", "::1/128"]
    assert (cfg.media.fetch.max_redirects, cfg.media.fetch.request_timeout_s) == (0, 7.0)


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
    assert await name_by_content(two, MediaFetcher(limits, get)) == (800, None)
    assert [p["image_url"]["url"] for p in two["messages"][0]["content"]] == [
        data_url(b"x" * 400)
    ] * 2


# ---- the fetcher: stateless, public addresses only, fixed answers, bounded per request ----------


async def test_media_fetch_keeps_no_cookies_across_tenants(media):
    # An origin's Set-Cookie on tenant A's fetch must not be presented on tenant B's fetch of
    # that host: media fetches keep no cookie state (a name, since aiohttp's jar takes no
    # cookie from an IP address).
    media.files["cat.png"] = PNG_B
    async with media_proxy() as s:
        r = await s.post(chat(img(media.url("/cookie", host="localhost")), cache_salt="A"))
        assert r.status == 200
        r = await s.post(chat(img(media.url("/img/cat.png", host="localhost")), cache_salt="B"))
        assert r.status == 200
    assert media.hits == {"/cookie": 1, "/img/cat.png": 1}
    assert media.cookies == [None, None]


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::ffff:127.0.0.1]"])
async def test_media_fetch_refuses_loopback_by_default(media, host):
    # The proxy's own loopback (its metrics port, the supervisor, a store's HTTP API) is not
    # fetched unless the operator allows it; a literal is refused before any connection, a
    # name once it resolves to it, with the answer any unreachable URL gets.
    media.files["cat.png"] = PNG_A
    async with content_proxy() as s:
        r = await s.post(chat(TEXT, img(media.url("/img/cat.png", host=host))))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert detail.startswith("messages[0].content[1]: ")
        if host == "localhost":
            assert "could not fetch media from" in detail
        else:
            assert "is not a public address (--allow-private-media-networks)" in detail
        assert media.hits == {} and s.e[0].chats() == [] and s.pd.chats() == []


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "127.9.9.9", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
     "100.64.0.1", "0.0.0.0", "224.0.0.1", "240.0.0.1", "255.255.255.255", "192.0.2.1", "::1",
     "::", "fe80::1", "fe80::1%eth0", "fc00::1", "fd12::1", "ff02::1", "::ffff:127.0.0.1",
     "::ffff:10.0.0.1", "2002:7f00:1::1", "2002:a00:1::1", "64:ff9b::a00:1", "2001:db8::1",
     "2130706433", "127.1", "0x7f.1", "localhost", ""],
)  # fmt: skip
def test_a_non_public_address_is_refused(address):
    from mmreuse.proxy.content import address_allowed

    assert not address_allowed(address)


def test_public_addresses_and_the_operators_networks_are_allowed():
    from ipaddress import ip_network

    from mmreuse.proxy.content import address_allowed

    for address in ("8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"):
        assert address_allowed(address), address
    nets = (ip_network("127.0.0.0/8"), ip_network("fd00::/8"))
    assert address_allowed("127.0.0.2", nets) and address_allowed("::ffff:127.0.0.1", nets)
    assert address_allowed("fd00::5", nets)
    assert not address_allowed("10.0.0.1", nets) and not address_allowed("::1", nets)
    # a network of one version never admits an address of the other
    assert not address_allowed("10.0.0.1", (ip_network("::/0"),))
    assert not address_allowed("::1", (ip_network("0.0.0.0/0"),))


class StubResolver:
    """Names to addresses without DNS: what a hostile resolver could answer."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.asked: list[str] = []

    async def resolve(self, host, port=0, family=0):
        self.asked.append(host)
        if host not in self.answers:
            raise OSError(-2, "Name or service not known")
        return [
            {"hostname": host, "host": a, "port": port, "family": 10 if ":" in a else 2,
             "proto": 0, "flags": 0}
            for a in self.answers[host]
        ]  # fmt: skip

    async def close(self):
        pass


async def test_a_name_resolving_to_a_private_address_is_refused_before_connecting():
    # Any answer that is not public refuses the name, a mixed answer too (DNS rebinding); the
    # resolver's check comes before any connection, so no packet is sent to these addresses.
    from mmreuse.proxy.content import AddressRefused, GuardedResolver

    stub = StubResolver({"meta.test": ["169.254.169.254"], "mixed.test": ["8.8.8.8", "10.0.0.1"],
                         "v6.test": ["fd00::1"], "ok.test": ["8.8.4.4"]})  # fmt: skip
    guarded = GuardedResolver((), stub)
    for host in ("meta.test", "mixed.test", "v6.test"):
        with pytest.raises(AddressRefused, match="not public"):
            await guarded.resolve(host, 80)
    assert [a["host"] for a in await guarded.resolve("ok.test", 80)] == ["8.8.4.4"]
    # Through the fetcher: one fixed answer, the same as for a name that does not resolve.
    details = [await fetch_detail(MediaLimits(), f"http://{h}/x.png", stub)
               for h in ("meta.test", "mixed.test", "nowhere.test")]  # fmt: skip
    assert len({d.split("'")[0] for d in details}) == 1
    assert all("could not fetch media from" in d for d in details)


async def fetch_detail(limits, url: str, resolver=None) -> str:
    """The 400 detail a fetch of `url` gets, through the proxy's own session (`resolver`: how
    names resolve)."""
    from mmreuse.proxy.content import MediaFetcher, fetch_hop, media_session

    session = media_session(limits, resolver=resolver)
    try:
        fetcher = MediaFetcher(limits, lambda *a: fetch_hop(session, *a))
        with pytest.raises(ProxyError) as e:
            await fetcher.fetch(url, "messages[0].content[0]", [limits.max_request_bytes])
        assert e.value.status == 400
        return e.value.detail
    finally:
        await session.close()


async def test_media_fetch_error_does_not_echo_peer_bytes():
    # A non-HTTP service (an SSH banner), a closed port, a name that does not resolve: one
    # answer for all three, with none of the peer's bytes, so the proxy is no port scanner.
    from ipaddress import ip_network

    async def banner(reader, writer):
        writer.write(b"SSH-2.0-OpenSSH_9.6 internal-host-secret-42\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(banner, "127.0.0.1", 0)
    closed = await asyncio.start_server(banner, "127.0.0.1", 0)
    closed_port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    port = server.sockets[0].getsockname()[1]
    limits = MediaLimits(private_networks=(ip_network("127.0.0.0/8"),))
    stub = StubResolver({"svc.test": ["127.0.0.1"]})
    try:
        details = [
            await fetch_detail(limits, f"http://svc.test:{port}/x.png", stub),
            await fetch_detail(limits, f"http://svc.test:{closed_port}/x.png", stub),
            await fetch_detail(limits, f"http://nowhere.test:{port}/x.png", stub),
        ]
    finally:
        server.close()
        await server.wait_closed()
    for d in details:
        assert "SSH" not in d and "secret" not in d and "Connect call" not in d
    urls = (f"svc.test:{port}", f"svc.test:{closed_port}", f"nowhere.test:{port}")
    assert len({d.replace(u, "URL") for d, u in zip(details, urls, strict=True)}) == 1
    assert details[0] == (
        f"messages[0].content[0]: could not fetch media from 'http://svc.test:{port}/x.png' "
        "(--uuid-policy content)"
    )


async def test_a_redirect_to_a_non_public_address_is_refused_at_that_hop(media):
    # Only 127.0.0.1 is allowed: hops to the metadata address or to ::1 are refused before
    # they are requested (a literal is never connected to).
    media.files["cat.png"] = PNG_A
    async with content_proxy("--allow-private-media-networks", "127.0.0.1") as s:
        for to in ("http://169.254.169.254/latest/meta-data/",
                   media.url("/img/cat.png", host="[::1]")):  # fmt: skip
            r = await s.post(chat(img(media.url(f"/redirect?to={to}"))))
            assert r.status == 400
            assert "is not a public address" in (await r.json())["detail"]
        assert media.hits == {"/redirect": 2}


async def test_redirects_can_be_switched_off(media):
    # vLLM's VLLM_MEDIA_URL_ALLOW_REDIRECTS=0: no redirect is followed.
    media.files["cat.png"] = PNG_A
    target = media.url("/img/cat.png")
    async with media_proxy("--media-max-redirects", "0") as s:
        r = await s.post(chat(img(media.url(f"/redirect?to={target}"))))
        assert r.status == 400 and "over 0 redirects" in (await r.json())["detail"]
        assert (await s.post(chat(img(target)))).status == 200
    assert media.hits == {"/redirect": 1, "/img/cat.png": 1}


@pytest.mark.parametrize(
    "url", ["http://[::1/x.png", "http://a\u2100b.example/x.png", "http://[v1.x]/x.png"]
)
async def test_malformed_media_url_is_a_client_error(url):
    async with content_proxy() as s:
        r = await s.post(chat(TEXT, img(url)))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert detail.startswith("messages[0].content[1]: ") and "is not a valid URL" in detail
        assert s.sample("mmreuse_proxy_errors_total", stage="proxy") == 0


async def test_a_requests_media_has_a_deadline(media):
    async with media_proxy("--media-request-timeout", "0.5") as s:
        t0 = asyncio.get_running_loop().time()
        r = await s.post(chat(TEXT, img(media.url("/hold")), img(media.url("/hold"))))
        assert r.status == 400
        detail = (await r.json())["detail"]
        assert "took over 0.5 s in all (--media-request-timeout)" in detail
        assert detail.startswith("messages[0].content[1]: ")
        assert asyncio.get_running_loop().time() - t0 < 3


async def test_one_clients_slow_origins_do_not_starve_another_tenants_fetch(media):
    # Eight requests of eight held fetches each (64, the old shared pool's size): another
    # tenant's fetch is not queued behind them, and is served at once.
    media.files["cat.png"] = PNG_A
    async with media_proxy("--media-fetch-timeout", "3") as s:
        held = [
            asyncio.create_task(s.post(chat(*(img(media.url("/hold")) for _ in range(8)))))
            for _ in range(8)
        ]
        for _ in range(200):
            if media.hits.get("/hold", 0) >= 64:
                break
            await asyncio.sleep(0.02)
        assert media.hits["/hold"] == 64  # each request at most 8 at once
        t0 = asyncio.get_running_loop().time()
        r = await s.post(chat(img(media.url("/img/cat.png")), cache_salt="other"))
        elapsed = asyncio.get_running_loop().time() - t0
        media.release.set()
        assert r.status == 200 and elapsed < 1.5
        assert [x.status for x in await asyncio.gather(*held)] == [200] * 8


def test_media_defaults_are_vllms():
    cfg = parse_args([*BASE, *CONTENT], env={})
    assert cfg.media.fetch.max_request_bytes == 256 << 20  # VLLM_MAX_MEDIA_REQUEST_DOWNLOAD_SIZE_MB
    assert cfg.media.fetch.timeout_s == 5.0  # VLLM_IMAGE_FETCH_TIMEOUT
    assert (cfg.media.fetch.request_timeout_s, cfg.media.fetch.max_redirects) == (30.0, 5)
    assert cfg.media.fetch.private_networks == ()


@pytest.mark.parametrize(
    "field, value",
    [("timeout_s", 0), ("request_timeout_s", float("nan")), ("max_redirects", -1),
     ("concurrency", 0), ("max_item_bytes", True), ("private_networks", ["10.0.0.0/8"]),
     ("allowed_domains", {"a.com"})],
)  # fmt: skip
def test_media_limits_refuse_bad_values_naming_the_field(field, value):
    from mmreuse.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=f"MediaLimits.{field}"):
        MediaLimits(**{field: value})

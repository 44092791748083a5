"""The adversarial collision suite on the real cluster, one stream under each `--uuid-policy`
(`mmreuse proxy --policy index` in front of E0 and P0).

vLLM keys E's EC store, P's encoder cache and the multimodal part of P's block hashes by an
item's uuid, across tenants. Honest tenants send their own images twice; then attackers try
every way to be served what is not theirs: another tenant's uuid on their own image (across
salts), a shared uuid without a salt (one namespace), a URL whose content changed, and a
metadata-only embeds part naming another tenant's embedding. An item rides on another's
embedding when no encoder (E's or P's) ran for it; it rides on another's KV when P's cached
tokens reach past its image. What must hold: under `tenant` and `content` no cross-tenant
hit, under `content` none at all; no engine error under any policy; honest reuse the same
under all three."""

from __future__ import annotations

import base64
import random
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from mmreuse.cluster.client import png_data_url, post_json
from mmreuse.cluster.proxy import proxy_process

pytestmark = pytest.mark.live

TENANTS = 4
POLICIES = ("reference", "tenant", "content")


class Origin:
    """A media origin on loopback serving one PNG whose bytes the test changes."""

    def __init__(self) -> None:
        self.body = b""
        origin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(origin.body)))
                self.end_headers()
                self.wfile.write(origin.body)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_port}/photo.png"

    def serve(self, data_url: str) -> None:
        self.body = base64.b64decode(data_url.partition(",")[2])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _body(image_part: dict, salt: str | None, text: str = "what is in the picture?") -> dict:
    body = {
        "model": "tiny",
        "max_tokens": 4,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": [image_part, {"type": "text", "text": text}]}],
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


def _image(url: str, uuid: str | None = None) -> dict:
    part = {"type": "image_url", "image_url": {"url": url}}
    return part if uuid is None else {**part, "uuid": uuid}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _stream(cluster, proxy_flags, tmp_path, policy: str, run: int) -> dict:
    """One policy's stream: per step, the encoder forwards (E0 + P0) and P's cached tokens."""
    rng = random.Random(f"{run}-{policy}")  # images no other test (or policy) sends

    def salt(k: int) -> str:  # each policy's tenants are new to P (no KV from another run)
        return f"tenant-{k}-{policy}-{run}"

    def new_image() -> str:
        return png_data_url(32, 32, tuple(rng.randrange(1, 255) for _ in range(3)))

    probe = cluster.probe()
    p_log = cluster.instances["P0"].log_path
    log_start = p_log.stat().st_size
    out: dict = {"honest": [], "forged_salted": [], "rejected": []}
    origin = Origin()

    def send(part: dict, salt: str | None) -> tuple[int, int]:
        before = probe.count("E0").log_inputs + probe.count("P0").log_inputs
        reply = post_json(url + "/v1/chat/completions", _body(part, salt), timeout=300)
        assert reply["choices"], reply
        forwards = probe.count("E0").log_inputs + probe.count("P0").log_inputs - before
        cached = ((reply.get("usage") or {}).get("prompt_tokens_details") or {}).get(
            "cached_tokens"
        )
        return forwards, int(cached or 0)

    args = [*proxy_flags(["P0"]), "--policy", "index", "--uuid-policy", policy]
    if policy == "content":  # the test's origin is on loopback, which is refused by default
        args += ["--allow-private-media-networks", "127.0.0.0/8"]
    try:
        with proxy_process(args, tmp_path / f"proxy-{policy}.log") as url:
            time.sleep(1.0)  # the subscribers connect (slow joiner)
            own = [new_image() for _ in range(TENANTS)]
            names = [f"photo-{run}-{k}" for k in range(TENANTS)]
            for _turn in range(2):  # honest: each tenant its own image, twice
                for k in range(TENANTS):
                    out["honest"].append(send(_image(own[k], names[k]), salt(k)))
            for k in range(TENANTS):  # tenant k+1 sends its own image under tenant k's name
                forged = _image(new_image(), names[k])
                out["forged_salted"].append(send(forged, salt((k + 1) % TENANTS)))
            # One namespace (no salt): X's image, a fresh control, then Y's image under X's name.
            shared = f"shared-{run}"
            out["unsalted_x"] = send(_image(new_image(), shared), None)
            out["unsalted_control"] = send(_image(new_image()), None)
            out["unsalted_forged"] = send(_image(new_image(), shared), None)
            # A URL whose content changed between two requests of one tenant.
            origin.serve(new_image())
            out["url_first"] = send(_image(origin.url), salt(0))
            origin.serve(new_image())
            out["url_changed"] = send(_image(origin.url), salt(0))
            # A metadata-only embeds part naming tenant 0's embedding (the reference forwards it).
            forged_ref = {
                "type": "image_embeds",
                "image_embeds": {"image_grid_thw": [1, 2, 2]},
                "uuid": names[0],
            }
            try:
                post_json(url + "/v1/chat/completions", _body(forged_ref, salt(1)))
                out["rejected"].append(200)
            except urllib.error.HTTPError as e:
                out["rejected"].append(e.code)
            out["after"] = send(_image(own[1], names[1]), salt(1))  # still serving
    finally:
        origin.close()
    out["healthy"] = _healthy(cluster.instances["E0"].spec.url) and _healthy(
        cluster.instances["P0"].spec.url
    )
    with p_log.open("rb") as f:
        f.seek(log_start)
        out["p_log_errors"] = f.read().count(b"Traceback")
    return out


def test_no_tenant_is_served_what_is_not_its_own(cluster, proxy_flags, tmp_path):
    run = time.time_ns()
    got = {policy: _stream(cluster, proxy_flags, tmp_path, policy, run) for policy in POLICIES}
    for policy, r in got.items():
        # No engine error under any policy; the forged metadata-only part never reaches P.
        assert r["healthy"] and r["p_log_errors"] == 0, (policy, r)
        assert r["rejected"] == [400], (policy, r["rejected"])
        assert r["after"][0] == 0, (policy, r["after"])  # tenant 1's own image: reused
        # Honest traffic: the first request of each tenant encodes, its repeat reuses (no
        # forward, KV cached) - the same under every policy.
        first, repeat = r["honest"][:TENANTS], r["honest"][TENANTS:]
        assert all(f >= 1 for f, _ in first) and all(f == 0 and c > 0 for f, c in repeat), (
            policy,
            r["honest"],
        )
    assert got["tenant"]["honest"] == got["reference"]["honest"] == got["content"]["honest"]
    # Across salts: under reference the forged item rides on the other tenant's embedding.
    assert all(f == 0 for f, _ in got["reference"]["forged_salted"]), got["reference"]
    for policy in ("tenant", "content"):
        assert all(f >= 1 for f, _ in got[policy]["forged_salted"]), (policy, got[policy])
    # One namespace (no salt): reference and tenant share it (a forged name rides on X's
    # embedding and X's KV); content names Y by its bytes (its own forward, the control's KV).
    for policy in ("reference", "tenant"):
        f, cached = got[policy]["unsalted_forged"]
        assert f == 0 and cached > got[policy]["unsalted_control"][1], (policy, got[policy])
    f, cached = got["content"]["unsalted_forged"]
    assert f >= 1 and cached == got["content"]["unsalted_control"][1], got["content"]
    # A URL whose content changed: reference and tenant serve the stale embedding.
    for policy in ("reference", "tenant"):
        assert got[policy]["url_first"][0] >= 1 and got[policy]["url_changed"][0] == 0, policy
    assert got["content"]["url_first"][0] >= 1 and got["content"]["url_changed"][0] >= 1

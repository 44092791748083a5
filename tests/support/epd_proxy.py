"""`mmreuse proxy` in process in front of fresh recording fakes (E + PD, or E + P + D), for
tests: the proxy's aiohttp test client, its app and the fakes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestClient

from mmreuse.proxy.config import parse_args
from mmreuse.proxy.server import PROXY_KEY, build_app

from .proxy_config import seeded
from .proxy_fakes import Fake, proxy_client


@dataclass
class Setup:
    client: TestClient
    app: web.Application
    e: list[Fake]
    p: list[Fake]
    d: list[Fake]

    @property
    def pd(self) -> Fake:
        return self.d[0]

    def sample(self, name: str, **labels: str) -> float:
        value = self.app[PROXY_KEY].registry.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def post(self, body: Any, request_id: str | None = "r1") -> aiohttp.ClientResponse:
        headers = {} if request_id is None else {"x-request-id": request_id}
        return await self.client.post("/v1/chat/completions", json=body, headers=headers)


@asynccontextmanager
async def epd(
    n_e: int = 1,
    n_p: int = 0,
    n_d: int = 1,
    *,
    flags: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    e_urls: list[str] | None = None,
    d_urls: list[str] | None = None,
    seed: int | None = None,
) -> AsyncIterator[Setup]:
    """A proxy (E + PD, or E + P + D when n_p) in front of fresh fakes; `seed` seeds its
    routing RNG (the reference's random.choice of P and D)."""
    e = [await Fake("e").start() for _ in range(n_e)]
    p = [await Fake("p").start() for _ in range(n_p)]
    d = [await Fake("d" if n_p else "pd").start() for _ in range(n_d)]
    argv = [
        "--encode-servers-urls", ",".join(e_urls or [f.url for f in e]),
        "--decode-servers-urls", ",".join(d_urls or [f.url for f in d]),
    ]  # fmt: skip
    if p:
        argv += ["--prefill-servers-urls", ",".join(f.url for f in p)]
    config = parse_args([*argv, *flags], env=env or {})
    app = build_app(config if seed is None else seeded(config, seed))
    try:
        async with proxy_client(app) as client:
            yield Setup(client, app, e, p, d)
    finally:
        for fake in (*e, *p, *d):
            await fake.close()

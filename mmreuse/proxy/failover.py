"""Instances that fail are routed around: passive health per role (`Ejections`), and an
active probe that brings them back (`HealthProbe`).

A request that finds an instance's connection refused or reset, or that it stalled past a
bound, ejects that instance, and its sub-request goes once to the next live instance of the
same role. The ejected instance gets no request until the probe finds it answering: after a
back-off (MIN_BACKOFF_S; doubled, at most MAX_BACKOFF_S, for one that fails again soon after it
came back) its /health is asked once a second (vLLM answers 200 once its engine serves), and
the first 200 brings it back. So a dead or stopped instance costs the requests that found it
so, once, and no request is risked to learn it is back. Without a probe (`Ejections` alone),
requests try it again once its back-off is over. The choice among live instances keeps the
rotation the reference uses, skipping the ejected ones; with every instance ejected, all are
tried, so a role that came back is found by the next request too.

Only a failed connection ejects, or a bound passing (--encode-timeout, --prefill-timeout, and
--request-timeout for a PD or D): a status from the instance (a 500, a 400) is its answer and
goes to the client as before.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import aiohttp

from ..validate import check_float, check_str

MIN_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
PROBE_INTERVAL_S = 1.0  # how often each ejected instance's /health is asked
PROBE_TIMEOUT_S = 1.0  # a probe not answered within it: still down

logger = logging.getLogger("mmreuse.proxy")

# What ejects an instance: the connection refused, reset, or closed before the answer
# (aiohttp's, as `proxy.upstream` raises them). Not a malformed answer (ClientPayloadError):
# that instance is up, and answered.
FAILED_CONNECTION = (aiohttp.ClientConnectionError, ConnectionError)


@dataclass(slots=True)
class _Health:
    down_until: float = 0.0  # monotonic: ejected until then (inf: until the probe's 200)
    probe_at: float = 0.0  # monotonic: the probe asks it from then (its back-off over)
    backoff_s: float = 0.0  # the last back-off
    back_since: float = -math.inf  # monotonic: when it last came back
    failing: bool = False  # ejected since its last success (reported down)


class Ejections:
    """Which instances of one role are up, as their requests found them (module doc).

    `role`: "E", "P" or "D" (metric labels); `urls`: the role's instances in rotation order;
    `on_change(role, url, up)`: called when an instance is ejected or comes back (metrics);
    `clock`: monotonic seconds (tests pass their own). `probed` (set by `HealthProbe`): an
    ejected instance is out until the probe finds it answering, its back-off only delaying
    the first question; without, its back-off over, requests try it again.
    """

    def __init__(
        self,
        role: str,
        urls: Sequence[str],
        *,
        on_change: Callable[[str, str, bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        min_backoff_s: float = MIN_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
    ) -> None:
        self.role = check_str("role", role)
        self.urls = [check_str("urls[]", u) for u in urls]
        self.min_backoff_s = check_float("min_backoff_s", min_backoff_s, 0.0)
        self.max_backoff_s = check_float("max_backoff_s", max_backoff_s, self.min_backoff_s)
        self._health = {u: _Health() for u in self.urls}
        self._on_change = on_change
        self._clock = clock
        self._cursor = 0
        self.probed = False
        self.on_eject: Callable[[], None] | None = None  # the probe's wake-up
        # instances ejected since their last success: while 0, callers skip every check
        self.failing = 0

    def up(self, url: str) -> bool:
        """Whether `url` may be given requests now (not ejected, or its back-off is over)."""
        return self._health[url].down_until <= self._clock()

    def down(self) -> list[str]:
        """The instances ejected now, in order."""
        now = self._clock()
        return [u for u in self.urls if self._health[u].down_until > now]

    def eject(self, url: str) -> None:
        """`url`'s connection failed (or it stalled): out for a back-off, twice the last one
        where it fails again within MAX_BACKOFF_S of coming back (a flapping instance), the
        shortest otherwise; with a probe, out until the probe finds it answering."""
        h = self._health[url]
        now = self._clock()
        if not h.failing and now - h.back_since > self.max_backoff_s:
            h.backoff_s = 0.0  # up long enough: its history is forgotten
        h.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, 2 * h.backoff_s))
        h.probe_at = now + h.backoff_s
        h.down_until = math.inf if self.probed else h.probe_at
        if not h.failing:
            h.failing = True
            self.failing += 1
            if self._on_change is not None:
                self._on_change(self.role, url, False)
        if self.on_eject is not None:
            self.on_eject()

    def ok(self, url: str) -> None:
        """`url` answered (a request, or the probe): back in."""
        h = self._health[url]
        if h.failing:
            h.failing = False
            self.failing -= 1
            h.down_until = h.probe_at = 0.0
            h.back_since = self._clock()
            if self._on_change is not None:
                self._on_change(self.role, url, True)

    def ejected(self) -> list[str]:
        """The instances ejected since their last success (back-off over or not), in order."""
        return [u for u in self.urls if self._health[u].failing] if self.failing else []

    def due(self) -> list[str]:
        """The ejected instances whose back-off is over: the probe's to ask."""
        now = self._clock()
        return [u for u in self.ejected() if self._health[u].probe_at <= now]

    def bound(self, url: str, bound_s: float) -> float | None:
        """How long `url` may take before it is taken for stalled: `bound_s` while another
        instance could take its request, else None (a lone instance is waited for)."""
        return bound_s if bound_s and self.instead_of(url) is not None else None

    def assign(self, count: int) -> list[str]:
        """The next `count` instances in the rotation (contiguous across requests), the
        ejected ones skipped; every instance where all are ejected."""
        urls, n = self.urls, len(self.urls)
        if self.failing:
            now = self._clock()
            live = sum(1 for u in urls if self._health[u].down_until <= now)
            if 0 < live < n:  # the rotation, from the cursor, over the live ones only
                out = []
                for _ in range(count):
                    while self._health[urls[self._cursor]].down_until > now:
                        self._cursor = (self._cursor + 1) % n
                    out.append(urls[self._cursor])
                    self._cursor = (self._cursor + 1) % n
                return out
        start = self._cursor  # every one up (or none): the reference's rotation, exactly
        self._cursor = (start + count) % n
        return [urls[(start + i) % n] for i in range(count)]

    def live(self) -> list[int] | None:
        """The indices of the instances up now, None where every one is (or none is: then
        all are tried)."""
        if not self.failing:
            return None
        now = self._clock()
        up = [i for i, u in enumerate(self.urls) if self._health[u].down_until <= now]
        return None if len(up) == len(self.urls) or not up else up

    def instead_of(self, failed: str) -> str | None:
        """The live instance to send `failed`'s request to (the next in rotation order after
        it), or None where no other is up."""
        urls, n = self.urls, len(self.urls)
        at = urls.index(failed)
        for step in range(1, n):
            url = urls[(at + step) % n]
            if url != failed and self.up(url):
                return url
        return None


class HealthProbe:
    """Asks each ejected instance of `roles` for its health every `interval_s` once its
    back-off is over; one that answers `get(url + "/health")` with 200 within `timeout_s` is
    up again (`Ejections.ok`). While every instance is up it waits for an ejection, so it
    costs nothing. `run()` until cancelled."""

    def __init__(
        self,
        roles: Sequence[Ejections],
        get: Callable[[str, float], Awaitable[int]],
        *,
        interval_s: float = PROBE_INTERVAL_S,
        timeout_s: float = PROBE_TIMEOUT_S,
    ) -> None:
        self.roles = list({id(r): r for r in roles}.values())  # E + PD: P's and D's are one
        self._wake = asyncio.Event()  # set by an ejection: the probe sleeps while none is out
        for role in self.roles:
            role.probed = True
            role.on_eject = self._wake.set
        self._get = get
        self.interval_s = check_float("interval_s", interval_s, 0.0)
        self.timeout_s = check_float("timeout_s", timeout_s, 0.0)

    async def run(self) -> None:
        while True:
            if not any(role.failing for role in self.roles):
                await self._wake.wait()  # nothing out: no timer, no cost per request
            self._wake.clear()
            await asyncio.sleep(self.interval_s)
            await self.once()

    async def once(self) -> None:
        """One round: every ejected instance asked at once."""
        pending = [(r, u) for r in self.roles if r.failing for u in r.due()]
        if not pending:
            return
        answers = await asyncio.gather(
            *(self._probe(url) for _, url in pending), return_exceptions=True
        )
        for (role, url), answer in zip(pending, answers, strict=True):
            if answer is True and url in role.ejected():
                logger.info("%s instance %s answers /health again: back in", role.role, url)
                role.ok(url)

    async def _probe(self, url: str) -> bool:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await self._get(url.rstrip("/") + "/health", self.timeout_s) == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False


def named_ejections(
    role: str, urls: Sequence[str], on_change: Callable[[str, str, bool], None]
) -> Ejections:
    """`Ejections` for `role` whose `on_change(role, name, up)` names each instance as the
    proxy's views do (E0, E1, ...), every one reported up to begin with."""
    names = {url: f"{role}{i}" for i, url in enumerate(urls)}
    for name in names.values():
        on_change(role, name, True)
    return Ejections(role, urls, on_change=lambda r, url, up: on_change(r, names[url], up))


def choose(rng: random.Random, scores: Sequence[float] | int, health: Ejections | None) -> int:
    """An instance index, at random among those with the best score (`scores` an int: that
    many instances, all equal), the ejected ones left out while another is up. With every
    instance up, the draws are exactly the reference's (`rng.randrange(n)`) and affine
    routing's (`rng.choice` of the best)."""
    live = None if health is None or not health.failing else health.live()
    if isinstance(scores, int):
        return rng.randrange(scores) if live is None else rng.choice(live)
    candidates = range(len(scores)) if live is None else live
    best = max(scores[i] for i in candidates)
    return rng.choice([i for i in candidates if scores[i] == best])

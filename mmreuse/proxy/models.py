"""What each P/PD serves, from its `GET /v1/models`: the base models and the LoRA adapters (an
entry whose `parent` names its base model). The proxy hashes a request as the base model's, so
a request naming an adapter (whose blocks vLLM keys with the adapter) must not be planned on the
base model's blocks: `ModelCatalog.kind` tells the planner which a request's `model` is."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Literal

import msgspec

Kind = Literal["base", "adapter", "unknown"]
REFRESH_S = 5.0  # an unknown name re-reads a server's list at most this often
MAX_MODELS = 4096  # entries kept per server (a server listing more is read up to this)

_decode = msgspec.json.Decoder()


class ModelCatalog:
    """Per server URL, its models' kinds, read once and again when a name is not among them
    (at most every REFRESH_S): a server that is restarted with new adapters is followed, and a
    client sending made-up names costs the server one list read per REFRESH_S."""

    def __init__(
        self,
        get: Callable[[str], Awaitable[tuple[int, bytes]]],
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._get = get  # async url -> (status, body)
        self._clock = clock
        self._kinds: dict[str, dict[str, Kind]] = {}
        self._read_at: dict[str, float] = {}
        self._reading: dict[str, asyncio.Future[None]] = {}  # a read in flight, shared
        self.errors: dict[str, str] = {}  # server -> why its last read failed

    async def kind(self, server: str, model: str) -> Kind:
        """Whether `model` is a base model or an adapter of `server`, or unknown to it (not
        listed, or the list could not be read)."""
        known = self._kinds.get(server, {})
        if model in known:
            return known[model]
        reading = self._reading.get(server)
        last = self._read_at.get(server)
        if reading is None and (last is None or self._clock() - last >= REFRESH_S):
            self._read_at[server] = self._clock()
            reading = self._reading[server] = asyncio.ensure_future(self._read(server))
            reading.add_done_callback(lambda _f: self._reading.pop(server, None))
        if reading is not None:  # the requests that come meanwhile get its answer too
            await asyncio.shield(reading)
        return self._kinds.get(server, {}).get(model, "unknown")

    async def _read(self, server: str) -> None:
        try:
            status, body = await self._get(f"{server}/v1/models")
            if status != 200:
                raise ValueError(f"GET /v1/models answered {status}")
            self._kinds[server] = _kinds(_decode.decode(body))
            self.errors.pop(server, None)
        except Exception as e:  # unreachable, or not vLLM's answer: its requests are unplanned
            self.errors[server] = f"{type(e).__name__}: {e}"[:200]


def _kinds(answer: object) -> dict[str, Kind]:
    """vLLM's /v1/models answer -> model id -> kind (an entry with a `parent` is an adapter)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list):
        raise ValueError("not a model list ({'data': [...]})")
    out: dict[str, Kind] = {}
    for entry in answer["data"][:MAX_MODELS]:
        if isinstance(entry, dict) and isinstance(entry.get("id"), str):
            out[entry["id"]] = "adapter" if entry.get("parent") is not None else "base"
    return out

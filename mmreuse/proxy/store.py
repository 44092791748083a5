"""What the shared embedding store holds, asked of the store itself: the Mooncake master's HTTP
`GET /batch_query_keys?keys=K1,K2`, for one request's identifiers, under the namespace P's
EC connector keys them by (`mmreuse.embedding_store`; `--e-store-url`, `--e-store-namespace`).

Every proxy replica asking the same master sees the same store, whatever it sent itself. An
item the store holds is one P's connector loads (`p_external`): it needs no E at all. The
answer is bounded in time (`--e-store-timeout`); a master that is slow, unreachable or answers
junk makes the answer None (the proxy then plans with its own record, as without a store),
counted by outcome and shown in /health until a query succeeds again. Either way a wrong
answer costs only work: an item called held that is gone by P's admission is encoded by P;
one called absent goes to E, which finds it in the store.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import quote

import aiohttp
import msgspec

from ..embedding_store import embedding_key
from ..errors import InvalidArgument
from ..validate import check_float, check_str

__all__ = ["MAX_KEYS_PER_QUERY", "StoreTruth"]

MAX_KEYS_PER_QUERY = 32  # keys per GET (a request with more items asks in several, at once)
MAX_ANSWER_BYTES = 1 << 20  # an answer larger than this is junk, not read on
OUTCOMES = ("ok", "timeout", "unreachable", "http_error", "junk")


class _Junk(ValueError):
    pass


class _Entry(msgspec.Struct):
    """One key's answer (its other fields, `error` and `values`, are not read)."""

    ok: bool


class _Answer(msgspec.Struct):
    """A `/batch_query_keys` answer: `data` maps each asked key to its `_Entry`."""

    success: bool
    data: dict[str, _Entry] | None = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


def _held(body: bytes, keys: list[str]) -> set[str]:
    """The keys a `/batch_query_keys` answer says the store holds; _Junk when it is not one
    (anything that does not decode, a nesting too deep for the decoder included)."""
    try:
        doc = _decode_answer(body)
    except msgspec.ValidationError as exc:
        raise _Junk(f"not an answer: {exc}") from None
    except msgspec.DecodeError as exc:
        raise _Junk(f"not JSON: {exc}") from None
    except RecursionError:  # msgspec's own depth limit, met even in a field it skips
        raise _Junk(f"not an answer: nested too deep ({len(body)} bytes)") from None
    if not doc.success:
        raise _Junk(f"no success: {body[:120]!r}")
    if doc.data is None:
        raise _Junk(f"success without data: {body[:120]!r}")
    held = set()
    for key in keys:
        entry = doc.data.get(key)
        if entry is None:
            raise _Junk(f"no answer for key {key[:120]!r}")
        if entry.ok:
            held.add(key)
    return held


class StoreTruth:
    """Asks one Mooncake master what it holds (see the module docstring)."""

    def __init__(
        self,
        url: str,
        namespace: str,
        session: Callable[[], aiohttp.ClientSession],
        *,
        timeout_s: float = 0.25,
        on_outcome: Callable[[str], None] | None = None,
    ) -> None:
        self.url = check_str("url", url, nonempty=True).rstrip("/")
        self.namespace = check_str("namespace", namespace, nonempty=True)
        self.timeout_s = check_float("timeout_s", timeout_s, 0, lo_open=True)
        self._session = session
        self._on_outcome = on_outcome
        self.outcomes: Counter[str] = Counter()
        self.unkeyable = 0  # identifiers that make no store key: not asked, not held
        self.last_outcome = ""
        self.last_error = ""
        self.last_ok_at: float | None = None

    def _record(self, outcome: str, error: str = "") -> None:
        self.outcomes[outcome] += 1
        self.last_outcome = outcome
        if outcome == "ok":
            self.last_ok_at = time.time()
            self.last_error = ""
        else:
            self.last_error = error
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    async def held(self, identifiers: Iterable[str]) -> frozenset[str] | None:
        """The identifiers the store holds, of these; None when the store did not answer
        (in time, or with an answer that is one)."""
        by_key = {}
        for ident in identifiers:
            if "," in ident:  # the master splits its keys at commas: not askable, not held
                continue
            try:
                by_key[embedding_key(self.namespace, ident)] = ident
            except InvalidArgument:  # no key ("", a non-str): P's connector cannot hold it
                self.unkeyable += 1
        if not by_key:
            return frozenset()
        keys = list(by_key)
        chunks = [keys[i : i + MAX_KEYS_PER_QUERY] for i in range(0, len(keys), MAX_KEYS_PER_QUERY)]
        try:
            async with asyncio.timeout(self.timeout_s):
                found = await asyncio.gather(*(self._ask(c) for c in chunks))
        except TimeoutError:
            self._record("timeout", f"no answer in {self.timeout_s} s")
            return None
        except (aiohttp.ClientError, OSError) as exc:
            self._record("unreachable", f"{type(exc).__name__}: {exc}")
            return None
        except _HttpError as exc:
            self._record("http_error", str(exc))
            return None
        except _Junk as exc:
            self._record("junk", str(exc))
            return None
        self._record("ok")
        return frozenset(by_key[k] for part in found for k in part)

    async def _ask(self, keys: list[str]) -> set[str]:
        query = ",".join(quote(k, safe="@:") for k in keys)
        async with self._session().get(f"{self.url}/batch_query_keys?keys={query}") as r:
            body = b""
            while chunk := await r.content.read(MAX_ANSWER_BYTES + 1 - len(body)):
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    raise _Junk(f"an answer over {MAX_ANSWER_BYTES} bytes")
            if r.status != 200:
                raise _HttpError(f"HTTP {r.status}: {body[:120]!r}")
        return _held(body, keys)

    def health(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "namespace": self.namespace,
            "queries": dict(self.outcomes),
            "unkeyable": self.unkeyable,
            "last_outcome": self.last_outcome or None,
            "last_error": self.last_error or None,
            "last_ok_at": self.last_ok_at,
        }


class _HttpError(RuntimeError):
    pass

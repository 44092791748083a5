"""Request streams for the simulator: multi-turn chat, shared-image fan-out, agentic screenshots,
and replay of a JSONL trace. Every turn resends the whole conversation history (as chat APIs do).

Trace schema (JSONL, one turn per line, turns of a session in arrival order):
    {"session": "s1", "arrival_s": 0.0, "text_tokens": 120,
     "images": [{"id": "sha256-of-image", "tokens": 576}], "output_tokens": 200}
`text_tokens` and `images` are what the user adds this turn (text first, then images);
`output_tokens` the assistant's answer, appended to the history of the session's next turn.
Image `id`s are engine identifiers: the same id in two sessions is the same image.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from array import array
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..occurrence import MMOccurrence
from .config import WorkloadConfig

IMAGE_TOKEN = 151655
VOCAB = 150000


@dataclass(slots=True)
class Session:
    """A conversation: its final history; each turn's request is a prefix of it."""

    sid: int
    tokens: array  # int64 token ids, compact: 100k-request streams hold ~50M of them
    mm: list[MMOccurrence]
    hashes: list[bytes] | None = None  # block hashes of the final history (filled by the cluster)


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    session: Session
    turn: int
    arrival_ms: float
    num_tokens: int  # the request's prompt: session.tokens[:num_tokens]
    num_mm: int  # its occurrences: session.mm[:num_mm]

    @property
    def mm(self) -> list[MMOccurrence]:
        return self.session.mm[: self.num_mm]


def _image_id(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def _image_tokens(rng: random.Random, kind: str) -> int:
    if kind == "fixed576":
        return 576
    # Qwen2-VL: one token per 28x28 pixels after 2x2 merging, for a random resolution
    w = rng.randrange(224, 1345, 28)
    h = rng.randrange(224, 1345, 28)
    return (w // 28) * (h // 28)


class _Builder:
    def __init__(self, sid: int, rng: random.Random):
        self.session = Session(sid, array("q"), [])
        self.rng = rng
        self._np = np.random.default_rng(rng.getrandbits(64))

    def text(self, n: int) -> None:
        if n:
            self.session.tokens.frombytes(self._np.integers(0, VOCAB, n, dtype=np.int64).tobytes())

    def image(self, ident: str, n: int) -> None:
        s = self.session
        s.mm.append(MMOccurrence(ident, len(s.tokens), n))
        s.tokens.frombytes(np.full(n, IMAGE_TOKEN, dtype=np.int64).tobytes())


def _poisson(rng: random.Random, lam: float) -> int:
    if lam <= 0:
        return 0
    l, k, p = math.exp(-lam), 0, 1.0
    while True:
        p *= rng.random()
        if p <= l:
            return k
        k += 1


def generate(cfg: WorkloadConfig, seed: int) -> list[SimRequest]:
    """The request stream, sorted by arrival; exactly cfg.requests requests."""
    if cfg.kind == "trace":
        return _from_trace(cfg)
    rng = random.Random(f"{seed}-{cfg.kind}")
    out: list[tuple[float, int, Session, int, int, int]] = []
    t_session = 0.0
    sid = 0
    total = 0
    while total < cfg.requests:
        t_session += rng.expovariate(cfg.sessions_per_s) * 1000.0
        b = _Builder(sid, rng)
        if cfg.kind == "chat":
            turns = 1 + _poisson(rng, cfg.mean_turns - 1)
            k = rng.randint(*cfg.images_per_session)
            image_turns = sorted([0] + [rng.randrange(turns) for _ in range(max(0, k - 1))]) if k else []
        elif cfg.kind == "agentic":
            turns = 1 + _poisson(rng, cfg.mean_turns - 1)
            image_turns = list(range(turns))
        else:  # fanout: a popular image, asked about for 1-3 turns
            turns = rng.randint(1, 3)
            image_turns = [0]
        t = t_session
        for turn in range(turns):
            b.text(rng.randint(*cfg.text_tokens))
            for _ in range(image_turns.count(turn)):
                if cfg.kind == "fanout":
                    rank = min(int(rng.paretovariate(1.1)), cfg.fanout_pool) - 1
                    ident = _image_id("fanout", seed, rank)
                    rng_img = random.Random(ident)
                    b.image(ident, _image_tokens(rng_img, cfg.image_tokens))
                else:
                    b.image(_image_id(cfg.kind, seed, sid, len(b.session.mm)),
                            _image_tokens(rng, cfg.image_tokens))
            out.append((t, sid, b.session, turn, len(b.session.tokens), len(b.session.mm)))
            b.text(rng.randint(*cfg.output_tokens))  # the answer, resent next turn
            t += rng.expovariate(1.0 / cfg.think_time_s) * 1000.0
        total += turns
        sid += 1
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    return [SimRequest(i, s, turn, t, n, k) for i, (t, _, s, turn, n, k) in
            enumerate(out[: cfg.requests])]


def _from_trace(cfg: WorkloadConfig) -> list[SimRequest]:
    path = Path(cfg.trace_path or "")
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"trace_path {str(path)!r}: {exc}") from None
    sessions: dict[str, _Builder] = {}
    pending_output: dict[str, int] = {}
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            name = str(rec["session"])
            arrival = float(rec["arrival_s"]) * 1000.0
            text = int(rec.get("text_tokens", 0))
            images = rec.get("images", [])
            output = int(rec.get("output_tokens", 0))
            if text < 0 or output < 0 or not isinstance(images, list):
                raise ValueError("negative token count or images not a list")
        except (KeyError, TypeError, ValueError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}:{lineno}: bad trace record ({exc}): {line[:120]}") from None
        b = sessions.get(name)
        if b is None:
            b = sessions[name] = _Builder(len(sessions), random.Random(f"trace-{name}"))
        b.text(pending_output.pop(name, 0))
        b.text(text)
        for img in images:
            try:
                ident, n = str(img["id"]), int(img["tokens"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"{path}:{lineno}: bad image ({exc}): {img!r}") from None
            if not ident or n < 1:
                raise ValueError(f"{path}:{lineno}: image needs an id and tokens >= 1: {img!r}")
            b.image(ident, n)
        if not b.session.tokens:
            raise ValueError(f"{path}:{lineno}: a turn with no tokens")
        pending_output[name] = output
        turn = sum(1 for r in out if r[2] is b.session)
        out.append((arrival, b.session.sid, b.session, turn, len(b.session.tokens), len(b.session.mm)))
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    if not out:
        raise ValueError(f"{path}: empty trace")
    out = out[: cfg.requests]
    return [SimRequest(i, s, turn, t, n, k) for i, (t, _, s, turn, n, k) in enumerate(out)]

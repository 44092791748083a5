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

from ..errors import InvalidArgument
from ..occurrence import MMOccurrence
from ..validate import check_float, check_int, fail_type
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


class _SessionBuilder:
    """Appends a session's turns: random text tokens, and image placeholders."""

    def __init__(self, sid: int, rng: random.Random):
        self.session = Session(sid, array("q"), [])
        self._token_rng = np.random.default_rng(rng.getrandbits(64))

    def text(self, n: int) -> None:
        if n:
            tokens = self._token_rng.integers(0, VOCAB, n, dtype=np.int64)
            self.session.tokens.frombytes(tokens.tobytes())

    def image(self, ident: str, n: int) -> None:
        session = self.session
        session.mm.append(MMOccurrence(ident, len(session.tokens), n))
        session.tokens.frombytes(np.full(n, IMAGE_TOKEN, dtype=np.int64).tobytes())


def _poisson(rng: random.Random, lam: float) -> int:
    """A Poisson(lam) draw (Knuth's method: multiply uniforms until below e^-lam)."""
    if lam <= 0:
        return 0
    threshold, k, product = math.exp(-lam), 0, 1.0
    while True:
        product *= rng.random()
        if product <= threshold:
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
        builder = _SessionBuilder(sid, rng)
        if cfg.kind == "chat":
            turns = 1 + _poisson(rng, cfg.mean_turns - 1)
            num_images = rng.randint(*cfg.images_per_session)
            image_turns = (
                sorted([0] + [rng.randrange(turns) for _ in range(num_images - 1)])
                if num_images
                else []
            )
        elif cfg.kind == "agentic":
            turns = 1 + _poisson(rng, cfg.mean_turns - 1)
            image_turns = list(range(turns))
        else:  # fanout: a popular image, asked about for 1-3 turns
            turns = rng.randint(1, 3)
            image_turns = [0]
        t = t_session
        session = builder.session
        for turn in range(turns):
            builder.text(rng.randint(*cfg.text_tokens))
            for _ in range(image_turns.count(turn)):
                if cfg.kind == "fanout":
                    rank = min(int(rng.paretovariate(1.1)), cfg.fanout_pool) - 1
                    ident = _image_id("fanout", seed, rank)
                    rng_img = random.Random(ident)
                    builder.image(ident, _image_tokens(rng_img, cfg.image_tokens))
                else:
                    builder.image(
                        _image_id(cfg.kind, seed, sid, len(session.mm)),
                        _image_tokens(rng, cfg.image_tokens),
                    )
            out.append((t, sid, session, turn, len(session.tokens), len(session.mm)))
            builder.text(rng.randint(*cfg.output_tokens))  # the answer, resent next turn
            t += rng.expovariate(1.0 / cfg.think_time_s) * 1000.0
        total += turns
        sid += 1
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    return [
        SimRequest(i, s, turn, t, n, k)
        for i, (t, _, s, turn, n, k) in enumerate(out[: cfg.requests])
    ]


def _from_trace(cfg: WorkloadConfig) -> list[SimRequest]:
    """The trace's turns (schema above), sorted by arrival; the first cfg.requests of them."""
    path = Path(cfg.trace_path or "")
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidArgument(f"trace_path {str(path)!r}: {exc}") from None
    sessions: dict[str, _SessionBuilder] = {}
    pending_output: dict[str, int] = {}
    turns_so_far: dict[str, int] = {}
    out = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict):
                fail_type("record", "an object", rec)
            name = str(rec["session"])
            arrival = check_float("arrival_s", rec["arrival_s"]) * 1000.0
            text = check_int("text_tokens", rec.get("text_tokens", 0), 0)
            images = rec.get("images", [])
            output = check_int("output_tokens", rec.get("output_tokens", 0), 0)
            if not isinstance(images, list):
                fail_type("images", "a list", images)
        except (KeyError, ValueError) as exc:  # JSONDecodeError is a ValueError
            raise InvalidArgument(
                f"{path}:{lineno}: bad trace record ({exc}): {line[:120]}"
            ) from None
        builder = sessions.get(name)
        if builder is None:
            builder = sessions[name] = _SessionBuilder(
                len(sessions), random.Random(f"trace-{name}")
            )
        builder.text(pending_output.pop(name, 0))
        builder.text(text)
        for img in images:
            try:
                if not isinstance(img, dict):
                    fail_type("image", "an object", img)
                ident, n = str(img["id"]), check_int("tokens", img["tokens"])
            except (KeyError, ValueError) as exc:
                raise InvalidArgument(f"{path}:{lineno}: bad image ({exc}): {img!r}") from None
            if not ident or n < 1:
                raise InvalidArgument(
                    f"{path}:{lineno}: image needs an id and tokens >= 1: {img!r}"
                )
            builder.image(ident, n)
        session = builder.session
        if not session.tokens:
            raise InvalidArgument(f"{path}:{lineno}: a turn with no tokens")
        pending_output[name] = output
        turn = turns_so_far.get(name, 0)
        turns_so_far[name] = turn + 1
        out.append((arrival, session.sid, session, turn, len(session.tokens), len(session.mm)))
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    if not out:
        raise InvalidArgument(f"{path}: empty trace")
    out = out[: cfg.requests]
    return [SimRequest(i, s, turn, t, n, k) for i, (t, _, s, turn, n, k) in enumerate(out)]

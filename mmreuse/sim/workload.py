"""Request streams for the simulator: multi-turn chat, shared-image fan-out, agentic screenshots,
follow-up questions about photos with ServeGen's request shapes (`servegen-photos`), and replay
of a JSONL trace. Every turn resends the whole conversation history (as chat APIs do).

`servegen-photos` (`servegen_photos`): each session opens with one ServeGen request (its images,
each with ServeGen's image tokens, its text and output tokens: `mmreuse.sim.servegen`, the
table's `servegen_client` entry), then asks follow-up questions about the same images: text
only, text and output tokens again ServeGen's; 1 + Poisson(mean_turns - 1) turns. Sessions
arrive by ServeGen's arrival process (the hour's inter-arrival CV, the day's hourly profile from
`servegen_hour` on), scaled so that the starting hour's rate is `sessions_per_s`; follow-ups
come an exponential think time (mean `think_time_s`) after the previous turn. `max_images`,
`max_text_tokens` and `max_output_tokens` clip draws for a small server (0: no cap); a turn has
at least one text token.

Trace schema (JSONL, one turn per line, turns of a session in arrival order):
    {"session": "s1", "arrival_s": 0.0, "text_tokens": 120,
     "images": [{"id": "sha256-of-image", "tokens": 576}], "output_tokens": 200}
`text_tokens` and `images` are what the user adds this turn (text first, then images);
`output_tokens` the assistant's answer, appended to the history of the session's next turn.
Every session, generated or read, records these turns (`Session.turns`, `SimRequest.turns`).
Image `id`s are engine identifiers: the same id in two sessions is the same image.
Checked line by line, every error reading `<path>:<line>: <field>: <what is wrong>`: `session`
and `arrival_s` are required; `session` and image `id`s are non-empty strings (valid Unicode);
`arrival_s` is a finite number >= 0, not before the session's previous turn (sessions may
interleave in any order: turns are sorted by arrival); token counts are ints (never bools or
floats), images' >= 1; unknown fields are refused; a turn must leave its session some tokens.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import random
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InvalidArgument
from ..occurrence import MMOccurrence
from ..validate import check_float, check_int, check_str, fail_type, fail_value, show
from .config import WorkloadConfig
from .memory import Budget, fmt_bytes
from .servegen import ServeGenRequest, sample_requests, shipped_table

IMAGE_TOKEN = 151655
VOCAB = 150000


@dataclass(frozen=True, slots=True)
class Turn:
    """What one turn adds to its session's history, in order: the user's text, the images
    (id, tokens), then the assistant's answer, which the session's next turn resends."""

    text_tokens: int
    images: tuple[tuple[str, int], ...]
    output_tokens: int


@dataclass(slots=True)
class Session:
    """A conversation: its final history; each turn's request is a prefix of it. `turns` is the
    same history as turns: request k's prompt is turns[0..k], less turn k's output."""

    sid: int
    tokens: array  # int64 token ids, compact: 100k-request streams hold ~50M of them
    mm: list[MMOccurrence]
    turns: list[Turn]
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

    @property
    def turns(self) -> list[Turn]:
        """The turns its prompt holds: the session's first `turn + 1` (the last one's output
        is not part of it)."""
        return self.session.turns[: self.turn + 1]


def _image_id(*parts: object) -> str:
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()


def _image_tokens(rng: random.Random, fixed: int | None) -> int:
    """`fixed` (WorkloadConfig.fixed_image_tokens), else a random Qwen2-VL image's tokens."""
    if fixed is not None:
        return fixed
    # Qwen2-VL: one token per 28x28 pixels after 2x2 merging, for a random resolution
    w = rng.randrange(224, 1345, 28)
    h = rng.randrange(224, 1345, 28)
    return (w // 28) * (h // 28)


class _SessionBuilder:
    """Appends a session's turns: random text tokens, and image placeholders."""

    def __init__(self, sid: int, rng: random.Random):
        self.session = Session(sid, array("q"), [], [])
        self._token_rng = np.random.default_rng(rng.getrandbits(64))

    def text(self, n: int) -> None:
        if n:
            tokens = self._token_rng.integers(0, VOCAB, n, dtype=np.int64)
            self.session.tokens.frombytes(tokens.tobytes())

    def image(self, ident: str, n: int) -> tuple[str, int]:
        """Appends the image; returns (ident, n), for the turn's record."""
        session = self.session
        session.mm.append(MMOccurrence(ident, len(session.tokens), n))
        session.tokens.frombytes(np.full(n, IMAGE_TOKEN, dtype=np.int64).tobytes())
        return ident, n


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


def generate(cfg: WorkloadConfig, seed: int, budget: Budget | None = None) -> list[SimRequest]:
    """The request stream, sorted by arrival: exactly cfg.requests requests, or a trace's first
    cfg.requests turns (all of them if fewer). A trace that needs more memory than `budget`
    allows (`mmreuse.sim.memory.check`) is refused while it is read."""
    if cfg.kind == "trace":
        return _from_trace(cfg, budget)
    if cfg.kind == "servegen-photos":
        return servegen_photos(cfg, seed, budget)
    rng = random.Random(f"{seed}-{cfg.kind}")
    fixed = cfg.fixed_image_tokens
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
        images_at = Counter(image_turns)  # (not image_turns.count: quadratic in turns)
        for turn in range(turns):  # draws in the order tests/sim/test_sim.py's pinned outputs fix
            text = rng.randint(*cfg.text_tokens)
            builder.text(text)
            images = []
            for _ in range(images_at[turn]):
                if cfg.kind == "fanout":
                    rank = min(int(rng.paretovariate(1.1)), cfg.fanout_pool) - 1
                    ident = _image_id("fanout", seed, rank)
                    rng_img = random.Random(ident)
                    images.append(builder.image(ident, _image_tokens(rng_img, fixed)))
                else:
                    images.append(
                        builder.image(
                            _image_id(cfg.kind, seed, sid, len(session.mm)),
                            _image_tokens(rng, fixed),
                        )
                    )
            out.append((t, sid, session, turn, len(session.tokens), len(session.mm)))
            output = rng.randint(*cfg.output_tokens)
            builder.text(output)  # the answer, resent next turn
            session.turns.append(Turn(text, tuple(images), output))
            t += rng.expovariate(1.0 / cfg.think_time_s) * 1000.0
        total += turns
        sid += 1
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    return [
        SimRequest(i, s, turn, t, n, k)
        for i, (t, _, s, turn, n, k) in enumerate(out[: cfg.requests])
    ]


def _cap(value: int, cap: int) -> int:
    """`value` clipped to `cap` (0: no cap)."""
    return min(value, cap) if cap else value


def servegen_rate_scale(cfg: WorkloadConfig) -> float:
    """What multiplies ServeGen's hourly rates so that `cfg.servegen_hour`'s is
    `cfg.sessions_per_s` (the day's mean where that hour has no arrivals)."""
    dist = shipped_table().client(cfg.servegen_client)
    base = dist.hourly_rate[cfg.servegen_hour] or dist.mean_rate
    return cfg.sessions_per_s / base


def servegen_photos(
    cfg: WorkloadConfig, seed: int, budget: Budget | None = None
) -> list[SimRequest]:
    """The `servegen-photos` stream (the module docstring): exactly cfg.requests requests,
    sorted by arrival, the same for the same (cfg, seed). Image ids are unique per session
    (`sha256("servegen-photos/<seed>/<session>/<k>")`), so every session's first turn brings
    new images and its follow-ups reuse them. A stream that needs more memory than `budget`
    allows is refused (InvalidArgument on `WorkloadConfig.requests`) as it is drawn."""
    if cfg.kind != "servegen-photos":
        fail_value("WorkloadConfig.kind", "'servegen-photos'", cfg.kind)
    seed = check_int("seed", seed, 0)
    dist = shipped_table().client(cfg.servegen_client)
    rng = random.Random(f"{seed}-{cfg.kind}")
    turns: list[int] = []
    while sum(turns) < cfg.requests:
        turns.append(1 + _poisson(rng, cfg.mean_turns - 1))
    scale = servegen_rate_scale(cfg)
    # the sessions' openings (arrivals and shapes), then the follow-ups' shapes (arrivals unused)
    first = sample_requests(dist, len(turns), seed, start_hour=cfg.servegen_hour, rate_scale=scale)
    follow = iter(sample_requests(dist, sum(turns) - len(turns), seed + 1, rate_scale=1.0))
    out: list[tuple[float, int, Session, int, int, int]] = []
    needed = 0.0
    for sid, (n_turns, opening) in enumerate(zip(turns, first, strict=True)):
        builder = _SessionBuilder(sid, rng)
        session = builder.session
        t = opening.arrival_s * 1000.0
        for turn in range(n_turns):
            shape: ServeGenRequest = opening if turn == 0 else next(follow)
            text = max(1, _cap(shape.text_tokens, cfg.max_text_tokens))
            builder.text(text)
            images = []
            if turn == 0:
                tokens = shape.image_tokens[: cfg.max_images or None]
                for k, n in enumerate(tokens):
                    images.append(builder.image(_image_id(cfg.kind, seed, sid, k), n))
            out.append((t, sid, session, turn, len(session.tokens), len(session.mm)))
            output = _cap(shape.output_tokens, cfg.max_output_tokens)
            builder.text(output)
            session.turns.append(Turn(text, tuple(images), output))
            if budget is not None:
                needed += (
                    budget.per_request
                    + budget.per_token * (text + sum(n for _, n in images) + output)
                    + budget.per_occurrence * len(images)
                    + (budget.per_session if turn == 0 else 0)
                )
                if needed > budget.available:
                    raise InvalidArgument(
                        f"WorkloadConfig.requests: the stream's first {len(out)} requests need "
                        f"about {fmt_bytes(needed)} of memory, more than the "
                        f"{fmt_bytes(budget.available)} left for it, got {cfg.requests}"
                    )
            t += rng.expovariate(1.0 / cfg.think_time_s) * 1000.0
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    return [
        SimRequest(i, s, turn, t, n, k)
        for i, (t, _, s, turn, n, k) in enumerate(out[: cfg.requests])
    ]


MAX_ARRIVAL_S = 1e300  # in ms it must stay finite
MAX_LINE_BYTES = 1 << 20  # a turn is a few hundred bytes; this bounds a line of /dev/zero
TRACE_KEYS = ("session", "arrival_s", "text_tokens", "images", "output_tokens")
IMAGE_KEYS = ("id", "tokens")


@dataclass(frozen=True, slots=True)
class _Turn:
    """One trace line, checked: what the session adds this turn, and where it came from."""

    lineno: int
    sid: int
    arrival_ms: float
    text: int
    images: tuple[tuple[str, int], ...]
    output: int


class _TraceError(InvalidArgument):
    """`<path>:<line>: <field>: <what is wrong>`."""


def _name(value: Any, field: str) -> str:
    """A session name or image id: a non-empty str that is valid Unicode (no lone surrogates,
    which cannot be encoded for hashing or seeding)."""
    name = check_str(field, value, nonempty=True)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        fail_value(field, "valid Unicode (no lone surrogates)", name)
    return name


def _refuse_unknown(prefix: str, record: dict, known: tuple[str, ...]) -> None:
    for key in record:
        if key not in known:
            name = key if key.isidentifier() else show(key)
            raise InvalidArgument(
                f"{prefix}{name}: unknown field (the schema has {', '.join(known)})"
            )


def _parse(rec: Any, lineno: int, sessions: dict[str, int], last_arrival: list[float]) -> _Turn:
    """One line's record, checked; raises InvalidArgument starting with the field."""
    if not isinstance(rec, dict):
        fail_type("record", "an object", rec)
    _refuse_unknown("", rec, TRACE_KEYS)
    for key in ("session", "arrival_s"):
        if key not in rec:
            raise InvalidArgument(f"{key}: is required")
    name = _name(rec["session"], "session")
    arrival = check_float("arrival_s", rec["arrival_s"], 0, MAX_ARRIVAL_S) * 1000.0
    text = check_int("text_tokens", rec.get("text_tokens", 0), 0)
    output = check_int("output_tokens", rec.get("output_tokens", 0), 0)
    raw_images = rec.get("images", [])
    if not isinstance(raw_images, list):
        fail_type("images", "a list", raw_images)
    images = []
    for i, img in enumerate(raw_images):
        field = f"images[{i}]"
        if not isinstance(img, dict):
            fail_type(field, "an object", img)
        _refuse_unknown(f"{field}.", img, IMAGE_KEYS)
        for key in IMAGE_KEYS:
            if key not in img:
                raise InvalidArgument(f"{field}.{key}: is required")
        images.append(
            (_name(img["id"], f"{field}.id"), check_int(f"{field}.tokens", img["tokens"], 1))
        )
    sid = sessions.setdefault(name, len(sessions))
    if sid == len(last_arrival):
        last_arrival.append(arrival)
    elif arrival < last_arrival[sid]:
        raise InvalidArgument(
            f"arrival_s must not be before the session's previous turn "
            f"({last_arrival[sid] / 1000.0}), got {arrival / 1000.0}"
        )
    last_arrival[sid] = arrival
    return _Turn(lineno, sid, arrival, text, tuple(images), output)


def _field_error(where: str, exc: InvalidArgument) -> _TraceError:
    """`exc` ("text_tokens must be >= 0, got -1") as `where: text_tokens: must be ...`."""
    message = str(exc)
    field, sep, problem = message.partition(" must ")
    if sep and " " not in field:
        message = f"{field}: must {problem}"
    return _TraceError(f"{where}: {message}")


def _read_lines(path: Path):
    """(line number, text) of every line, each at most MAX_LINE_BYTES, decoded as UTF-8."""
    try:
        f = open(path, "rb")  # noqa: SIM115 (closed below; a generator cannot use `with` here)
    except OSError as exc:
        raise _TraceError(f"{path}: trace file: cannot be read ({exc.strerror or exc})") from None
    with f:
        lineno = 0
        while True:
            try:
                raw = f.readline(MAX_LINE_BYTES + 1)
            except OSError as exc:
                raise _TraceError(
                    f"{path}: trace file: cannot be read ({exc.strerror or exc})"
                ) from None
            if not raw:
                return
            lineno += 1
            if len(raw) > MAX_LINE_BYTES:
                raise _TraceError(f"{path}:{lineno}: record: longer than {MAX_LINE_BYTES} bytes")
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise _TraceError(
                    f"{path}:{lineno}: record: not UTF-8 (byte {exc.start} of the line)"
                ) from None


def _build_session(
    sid: int,
    rng: random.Random,
    turns: list[_Turn],
    out: list[tuple[float, int, Session, int, int, int]],
) -> None:
    """A trace session, whole: each turn adds the previous turn's output and its own text (random
    tokens), then its images; appends each turn's (arrival, sid, session, turn, tokens, mm).

    The text is drawn in one `integers` call per session: numpy draws bounded integers element
    by element from the bit generator's stream, so this is the same tokens as `_SessionBuilder`'s
    one call per piece (the pinned trace output in tests/sim/test_sim.py guards it), 15x fewer calls."""
    session = Session(sid, array("q"), [], [])
    token_rng = np.random.default_rng(rng.getrandbits(64))  # as _SessionBuilder seeds it
    pending = 0
    total_text = 0
    for turn in turns:
        total_text += pending + turn.text
        pending = turn.output
    text = token_rng.integers(0, VOCAB, total_text, dtype=np.int64) if total_text else None
    pieces: list[np.ndarray] = []
    mm = session.mm
    pos = length = pending = 0
    for number, turn in enumerate(turns):
        n = pending + turn.text
        if n:
            assert text is not None
            pieces.append(text[pos : pos + n])
            pos += n
            length += n
        for ident, k in turn.images:
            mm.append(MMOccurrence(ident, length, k))
            pieces.append(np.full(k, IMAGE_TOKEN, dtype=np.int64))
            length += k
        pending = turn.output
        session.turns.append(Turn(turn.text, turn.images, turn.output))
        out.append((turn.arrival_ms, sid, session, number, length, len(mm)))
    session.tokens.frombytes(np.concatenate(pieces).tobytes())


def _from_trace(cfg: WorkloadConfig, budget: Budget | None) -> list[SimRequest]:
    """The trace's turns (schema above), sorted by arrival; the first cfg.requests of them.

    Two passes, both linear: every line is parsed and checked (and its memory counted against
    `budget`) before anything is built; then each session is built whole, one at a time. The
    cyclic GC is paused meanwhile: the loader makes no cycles, and the collections its ~10
    objects a line set off would take a third of the time (benchmarks/test_bench_sim.py)."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return _load_trace(cfg, budget)
    finally:
        if paused:
            gc.enable()


def _load_trace(cfg: WorkloadConfig, budget: Budget | None) -> list[SimRequest]:
    path = Path(cfg.trace_path or "")
    sessions: dict[str, int] = {}
    last_arrival: list[float] = []
    session_tokens: list[int] = []
    turns: list[_Turn] = []
    needed = 0.0
    for lineno, line in _read_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
                reason = "nested too deeply" if isinstance(exc, RecursionError) else exc
                raise InvalidArgument(f"record: invalid JSON ({reason})") from None
            turn = _parse(rec, lineno, sessions, last_arrival)
        except InvalidArgument as exc:
            raise _field_error(where, exc) from None
        if turn.sid == len(session_tokens):
            session_tokens.append(0)
        # the previous turn's output is resent with this one; tokens so far in the session
        tokens = turn.text + sum(n for _, n in turn.images)
        before = session_tokens[turn.sid]
        session_tokens[turn.sid] = before + tokens + turn.output
        if before + tokens == 0:
            raise _TraceError(f"{where}: text_tokens: a turn with no tokens (nor any before it)")
        if budget is not None:
            needed += (
                budget.per_request
                + budget.per_token * (tokens + turn.output)
                + budget.per_occurrence * len(turn.images)
                + (budget.per_session if before == 0 else 0)
            )
            if needed > budget.available:
                sizes = [("text_tokens", turn.text), ("output_tokens", turn.output)]
                sizes += [(f"images[{i}].tokens", n) for i, (_, n) in enumerate(turn.images)]
                field = max(sizes, key=lambda s: s[1])[0]
                raise _TraceError(
                    f"{where}: {field}: the trace up to this line needs about "
                    f"{fmt_bytes(needed)} of memory, more than the {fmt_bytes(budget.available)} "
                    "left for it"
                )
        turns.append(turn)
    if not turns:
        raise _TraceError(f"{path}: trace file: holds no turns")
    by_session: list[list[_Turn]] = [[] for _ in sessions]
    for turn in turns:
        by_session[turn.sid].append(turn)
    out: list[tuple[float, int, Session, int, int, int]] = []
    for name, sid in sessions.items():
        _build_session(sid, random.Random(f"trace-{name}"), by_session[sid], out)
    out.sort(key=lambda x: (x[0], x[1], x[3]))
    out = out[: cfg.requests]
    return [SimRequest(i, s, turn, t, n, k) for i, (t, _, s, turn, n, k) in enumerate(out)]

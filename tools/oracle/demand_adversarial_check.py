"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout): `DemandScheduler` under
a hostile demand client, side by side with vLLM's real `Scheduler` driven identically.

Between engine steps, hostile frames go to `Answers.handle` (the scheduler's `_answers`) directly and over the real
ROUTER socket (`ControlServer` on a free loopback port, a DEALER client): garbage, truncated
msgpack, wrong types per field, too many tokens / items / e_cached entries, 1 MB strings, bad
item placements and masks, unknown adapters, out-of-range ints, NaN, duplicate ids, stats
queries; over the socket also multipart and empty frames, a frame over the size limit, raw TCP
garbage and a burst of 2,000 queries whose answers are not read while the engine steps.

Counted, and printed as one JSON line: exceptions escaping `Answers.handle` (`raised`), answers that
are neither a DemandError nor a valid answer (`invalid`), answers other than the expected kind
(`unexpected`, with names), pool-state changes across an answer (`side_effects`), steps whose
outputs differ from vLLM's (`output_mismatch`), residency-index mismatches (`index_mismatch`),
the slowest answer and engine step, whether the answer thread survived; `findings` lists what
broke the contract (anything slower than SLOW_S included).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import random
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import zmq
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler

from mmreuse.demand_query import (
    DemandAnswer,
    DemandError,
    DemandStats,
    MalformedAnswer,
    MalformedQuery,
    StatsQuery,
    decode_answer,
    decode_query,
    encode,
)
from mmreuse.integrations.control import ControlServer
from mmreuse.integrations.vllm import DemandScheduler

_spec = importlib.util.spec_from_file_location(
    "demand_check", Path(__file__).with_name("demand_scheduler_check.py")
)
check = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(check)  # type: ignore[union-attr]

SLOW_S = 1.0  # an answer (or engine step) slower than this is a finding
MB = 1 << 20
BURST = 2000
MAX_MODEL_LEN = 2048  # make_scheduler's


def _big_token_ids() -> tuple[str, str | None]:
    """What a query with token ids past int32 gets from this vLLM: an answer where its
    `Request` holds any int (0.33), a DemandError naming token_ids where it holds int32 and
    raises OverflowError (0.34 on)."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    try:
        Request("probe", [2**31], SamplingParams(max_tokens=1), None)
    except OverflowError:
        return ("error", "token_ids")
    return ("answer", None)


BIG_TOKEN_IDS = _big_token_ids()


def _q(base_tokens: list[int], base_items: list[tuple[str, int, int]], **over: Any) -> bytes:
    """A query frame as a raw map (so that any field can hold anything)."""
    m: dict[str, Any] = {
        "type": "DemandQuery",
        "id": "h",
        "token_ids": list(base_tokens),
        "items": [{"identifier": i, "offset": o, "length": n} for i, o, n in base_items],
    }
    m.update(over)
    return msgspec.msgpack.encode(m)


def _item(ident: str, off: int, n: int, **over: Any) -> dict[str, Any]:
    return {"identifier": ident, "offset": off, "length": n, **over}


def hostile_frames(tokens: list[int], items: list, rng: random.Random) -> list[tuple]:
    """(name, payload, expect): expect is ("error", text the error must contain), ("answer",
    class every item must get or None), or ("stats", None)."""
    t = list(tokens)
    one = [("img-x", 2, 4)]
    t40 = [1, 2, 3] + [5] * 37
    q = lambda **kw: _q(t, items, **kw)  # noqa: E731
    q40 = lambda **kw: _q(t40, one, **kw)  # noqa: E731
    valid = q()
    err, ok = "error", "answer"
    return [
        # not a query at all
        ("garbage", bytes(rng.randrange(256) for _ in range(64)), (err, "")),
        ("garbage_1mb", rng.randbytes(MB), (err, "")),
        ("truncated", valid[: len(valid) // 2], (err, "truncated")),
        ("empty", b"", (err, "")),
        ("nil", b"\xc0", (err, "")),
        ("array32_bomb", b"\xdd\xff\xff\xff\xff", (err, "")),
        ("str32_bomb", b"\xdb\xff\xff\xff\xff", (err, "")),
        ("deep_nesting", b"\x91" * 100_000 + b"\xc0", (err, "")),
        ("not_a_map", msgspec.msgpack.encode([1, 2, 3]), (err, "")),
        ("answer_type", msgspec.msgpack.encode({"type": "DemandAnswer", "id": "h"}), (err, "")),
        ("no_type", msgspec.msgpack.encode({"id": "h", "token_ids": t}), (err, "")),
        (
            "junk_4mb_no_type",
            msgspec.msgpack.encode({"id": "h", "junk": [{"a": [1] * 8}] * 300_000}),
            (err, ""),
        ),
        ("unknown_fields", q(junk=[{"a": [1] * 8}] * 1000, more="x"), (ok, None)),
        # wrong types, per field
        ("id_int", q(id=5), (err, "$.id")),
        ("id_empty", q(id=""), (err, "$.id")),
        ("id_long", q(id="i" * 200), (err, "$.id")),
        ("id_1mb", q(id="i" * MB), (err, "$.id")),
        ("token_ids_str", q(token_ids="abc"), (err, "$.token_ids")),
        ("token_ids_float", q(token_ids=[1.5, *t[1:]]), (err, "$.token_ids[0]")),
        ("token_ids_nan", q(token_ids=[float("nan"), *t[1:]]), (err, "$.token_ids[0]")),
        ("token_ids_bool", q(token_ids=[True, *t[1:]]), (err, "$.token_ids[0]")),
        ("token_ids_negative", q(token_ids=[-1, *t[1:]]), (err, "$.token_ids[0]")),
        ("token_ids_2p64", q(token_ids=[2**64 - 1, *t[1:]]), (err, "$.token_ids[0]")),
        ("token_ids_empty", q(token_ids=[], items=[]), (err, "token_ids")),
        ("items_map", q(items={"a": 1}), (err, "$.items")),
        ("item_list", q(items=[[1, 2, 3]]), (err, "$.items[0]")),
        ("identifier_int", q40(items=[_item(7, 2, 4)]), (err, "$.items[0].identifier")),  # type: ignore[arg-type]
        ("offset_str", q40(items=[_item("a", "2", 4)]), (err, "$.items[0].offset")),  # type: ignore[arg-type]
        ("offset_nan", q40(items=[_item("a", float("nan"), 4)]), (err, "$.items[0].offset")),  # type: ignore[arg-type]
        ("length_zero", q40(items=[_item("a", 2, 0)]), (err, "$.items[0].length")),
        ("modality_int", q40(items=[_item("a", 2, 4, modality=3)]), (err, "modality")),
        ("is_embed_ints", q40(items=[_item("a", 2, 2, is_embed=[1, 0])]), (err, "is_embed")),
        ("cache_salt_int", q40(cache_salt=5), (err, "$.cache_salt")),
        ("lora_name_list", q40(lora_name=["a"]), (err, "$.lora_name")),
        ("e_cached_str", q40(e_cached="img-x"), (err, "$.e_cached")),
        ("e_cached_ints", q40(e_cached=[1, 2]), (err, "$.e_cached[0]")),
        ("remember_str", q40(remember="yes"), (err, "$.remember")),
        ("remember_nan", q40(remember=float("nan")), (err, "$.remember")),
        # sizes
        (
            "token_ids_over_max_len",
            q40(token_ids=[5] * (MAX_MODEL_LEN + 1)),
            (err, "max_model_len"),
        ),
        ("token_ids_1e5", q40(token_ids=[5] * 100_000), (err, "max_model_len")),
        ("token_ids_max_len", q40(token_ids=[5] * MAX_MODEL_LEN), (ok, None)),
        (
            "items_1e5",
            q40(token_ids=[5] * 2000, items=[_item(f"i{i}", 0, 1) for i in range(100_000)]),
            (err, "items"),
        ),
        (
            "items_4096_full_masks",
            q40(
                token_ids=[5] * 2000,
                items=[_item(f"i{i}", 0, 2000, is_embed=[True] * 2000) for i in range(4096)],
            ),
            (err, "items"),
        ),
        ("identifier_1mb", q40(items=[_item("a" * MB, 2, 4)]), (err, "identifier")),
        ("modality_1mb", q40(items=[_item("a", 2, 4, modality="m" * MB)]), (err, "modality")),
        ("cache_salt_1mb", q40(cache_salt="s" * MB), (err, "cache_salt")),
        ("lora_name_1mb", q40(lora_name="l" * MB), (err, "lora_name")),
        ("e_cached_1e5", q40(e_cached=[f"e{i}" for i in range(100_000)]), (err, "e_cached")),
        ("e_cached_1mb_entry", q40(e_cached=["e" * MB]), (err, "e_cached")),
        (
            "is_embed_1e6_for_length_1",
            q40(items=[_item("a", 2, 1, is_embed=[True] * 1_000_000)]),
            (err, "is_embed"),
        ),
        # placement and masks
        ("overlap_two", q40(items=[_item("a", 2, 6), _item("b", 2, 6)]), (ok, None)),
        (
            "out_of_order",
            q40(items=[_item("a", 10, 2), _item("b", 2, 2)]),
            (err, "items[1].offset"),
        ),
        ("past_end", q40(items=[_item("a", 38, 4)]), (err, "past the")),
        ("offset_2p63", q40(items=[_item("a", 2**63 - 1, 1)]), (err, "past the")),
        ("length_2p63", q40(items=[_item("a", 2, 2**63 - 1)]), (err, "past the")),
        ("offset_negative", q40(items=[_item("a", -1, 2)]), (err, "$.items[0].offset")),
        ("offset_2p64", q40(items=[_item("a", 2**64 - 1, 2)]), (err, "$.items[0].offset")),
        ("is_embed_short", q40(items=[_item("a", 2, 4, is_embed=[True])]), (err, "is_embed")),
        (
            "is_embed_all_false",
            q40(items=[_item("a", 2, 4, is_embed=[False] * 4)]),
            (ok, "no_embeds"),
        ),
        # identities
        ("unknown_lora", q(lora_name="no-such-adapter"), (err, "lora_name")),
        ("duplicate_items", q40(items=[_item("a", 2, 4), _item("a", 10, 4)]), (ok, None)),
        # vLLM 0.34 on holds token ids in int32: a larger one makes no Request there
        ("token_id_2p63", q(token_ids=[2**63 - 1] * len(t)), BIG_TOKEN_IDS),
        ("token_id_2p31", q(token_ids=[2**31] * len(t)), BIG_TOKEN_IDS),
        ("token_id_int32_max", q(token_ids=[2**31 - 1] * len(t)), (ok, None)),
        ("one_token", q(token_ids=[7], items=[]), (ok, None)),
        ("one_token_item", q(token_ids=[7], items=[_item("a", 0, 1)]), (ok, None)),
        ("not_remembered", q(remember=False), (ok, None)),
        ("e_cached_own", q(e_cached=[i for i, _, _ in items]), (ok, None)),
        ("valid", valid, (ok, None)),
        ("valid_same_id", valid, (ok, None)),
        ("stats", encode(StatsQuery("st")), ("stats", None)),
        ("stats_check_index", encode(StatsQuery("st", check_index=True)), ("stats", None)),
        (
            "stats_check_index_int",
            msgspec.msgpack.encode({"type": "StatsQuery", "id": "s", "check_index": 1}),
            (err, "check_index"),
        ),
    ]


class Tally:
    """Counts and findings over every hostile answer."""

    def __init__(self) -> None:
        self.c: dict[str, Any] = {
            "frames_direct": 0, "frames_socket": 0, "raised": 0, "invalid": 0,
            "unexpected": 0, "side_effects": 0, "errors": 0, "answers": 0, "stats": 0,
            "no_reply": 0, "wrong_error_id": 0, "slowest_s": 0.0, "slowest": None,
            "max_lock_held_s": 0.0, "max_lock_held": None,
        }  # fmt: skip
        self.unexpected: dict[str, str] = {}
        self.findings: list[str] = []

    def time(self, name: str, seconds: float) -> None:
        if seconds > self.c["slowest_s"]:
            self.c["slowest_s"], self.c["slowest"] = seconds, name
        if seconds > SLOW_S:
            self.findings.append(f"{name}: answered in {seconds:.2f} s")

    def judge(self, name: str, payload: bytes, raw: bytes, expect: tuple) -> None:
        """raw must be a DemandError or a valid answer (to the query, when it is one), of the
        expected kind."""
        try:
            ans = decode_answer(raw)
            query = None
            with contextlib.suppress(MalformedQuery):
                query = decode_query(payload)
            if isinstance(ans, DemandAnswer):
                if query is None or isinstance(query, StatsQuery):
                    raise MalformedAnswer("a DemandAnswer to a frame that is not a DemandQuery")
                decode_answer(raw, query)
        except MalformedAnswer as e:
            self.c["invalid"] += 1
            self.findings.append(f"{name}: invalid answer: {e}")
            return
        if isinstance(ans, DemandAnswer) and ans.answer_us / 1e6 > self.c["max_lock_held_s"]:
            self.c["max_lock_held_s"], self.c["max_lock_held"] = ans.answer_us / 1e6, name
        kind, want = expect
        got = {DemandError: "error", DemandAnswer: "answer", DemandStats: "stats"}[type(ans)]
        self.c[{"error": "errors", "answer": "answers", "stats": "stats"}[got]] += 1
        why = None
        if got != kind:
            why = f"{got} ({getattr(ans, 'error', '')[:160]})"
        elif isinstance(ans, DemandError) and want not in ans.error:
            why = f"error without {want!r}: {ans.error[:160]}"
        elif (
            isinstance(ans, DemandAnswer) and want and any(x.item_class != want for x in ans.items)
        ):
            why = f"classes {[x.item_class.value for x in ans.items]}, not all {want}"
        elif isinstance(ans, DemandStats) and ans.index_mismatches not in (None, 0):
            why = f"{ans.index_mismatches} index mismatches"
        if isinstance(ans, DemandError) and ans.id != _named_id(payload):
            self.c["wrong_error_id"] += 1
            why = why or f"error id {ans.id[:40]!r} is not the frame's"
        if why is not None:
            self.c["unexpected"] += 1
            self.unexpected.setdefault(name, why)


def _named_id(payload: bytes) -> str:
    """The id a DemandError should carry: the frame's, when it is a short string."""
    try:
        raw = msgspec.msgpack.decode(payload)
    except Exception:
        return ""
    ident = raw.get("id") if isinstance(raw, dict) else None
    return ident if isinstance(ident, str) and 0 < len(ident) <= 128 else ""


def main(seed: int = 0, turns: int = 12) -> dict:
    rng = random.Random(seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(check.BLOCK, sha256)
    model = check.tiny_model_dir()
    ours = check.make_scheduler(DemandScheduler, model, num_blocks=40, cache_size=96)
    ref = check.make_scheduler(Scheduler, model, num_blocks=40, cache_size=96)
    stream = check.Stream(rng)
    tally = Tally()
    c = tally.c
    c.update(steps=0, output_mismatch=0, index_mismatch=0, slowest_step_s=0.0)
    rid = [0]

    def step() -> None:
        t0 = time.perf_counter()
        a = ours.schedule()
        ours.update_from_output(a, check.runner_output(a))
        dt = time.perf_counter() - t0
        b = ref.schedule()
        ref.update_from_output(b, check.runner_output(b))
        c["slowest_step_s"] = max(c["slowest_step_s"], dt)
        if check.output_key(a) != check.output_key(b):
            c["output_mismatch"] += 1
        c["steps"] += 1
        st = msgspec.msgpack.decode(ours._answers.handle(encode(StatsQuery("s", check_index=True))))
        c["index_mismatch"] += st["index_mismatches"]

    def turn(between: Any) -> None:
        """Add 1-3 requests (ours answered first, as the proxy asks), then 4 steps with
        `between(tokens, items)` after each."""
        batch = [stream.next() for _ in range(rng.choice([1, 2, 3]))]
        for tokens, items in batch:
            name, qid = f"r{rid[0]}", f"q{rid[0]}"
            rid[0] += 1
            ours._answers.handle(encode(check.query(qid, tokens, items)))
            ours.add_request(check.request(name, tokens, items, hasher, qid))
            ref.add_request(check.request(name, tokens, items, hasher))
        for _ in range(4):
            step()
            between(*batch[-1])

    # 1. direct: every hostile frame through Answers.handle, between steps, pool state compared
    frames: list[tuple] = []

    def direct(tokens: list[int], items: list) -> None:
        if not frames:
            frames.extend(hostile_frames(tokens, items, rng))
        for _ in range(4):
            if not frames:
                return
            name, payload, expect = frames.pop()
            before = check.pool_state(ours)
            t0 = time.perf_counter()
            try:
                raw = ours._answers.handle(payload)
            except BaseException as e:  # the contract: never
                c["raised"] += 1
                tally.findings.append(f"{name}: handle raised {type(e).__name__}: {e}"[:300])
                continue
            finally:
                tally.time(name, time.perf_counter() - t0)
                c["frames_direct"] += 1
            if check.pool_state(ours) != before:
                c["side_effects"] += 1
                tally.findings.append(f"{name}: the answer changed P's pool state")
            tally.judge(name, payload, raw, expect)

    for _ in range(turns):
        turn(direct)
    c["hostile_kinds"] = len(hostile_frames([1, 2, 3], [], rng))
    # one byte over the largest well-formed query for this P: refused unread
    frames.append(
        ("oversize", b"\x00" * (ours._answers.max_query_bytes + 1), ("error", "payload has"))
    )
    direct([], [])

    # 2. the socket: the same frames over a DEALER, between steps
    port = check.free_port()
    # as DemandScheduler starts it for a demand_endpoint (its frame limit included)
    server = ControlServer(
        f"tcp://127.0.0.1:{port}", ours._answers.handle, ours._answers.max_query_bytes
    )
    server.start()
    ctx = zmq.Context.instance()
    endpoint = f"tcp://127.0.0.1:{port}"

    def dealer() -> Any:
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(endpoint)
        return d

    client = dealer()

    def ask(d: Any, payload: bytes | list[bytes], timeout: float = 10.0) -> bytes | None:
        if isinstance(payload, list):
            d.send_multipart(payload)
        else:
            d.send(payload)
        if d.poll(int(timeout * 1000)):
            return d.recv()
        return None

    def alive(tag: str) -> bool:
        probe = dealer()
        try:
            raw = ask(probe, encode(StatsQuery(f"alive-{tag}")))
        finally:
            probe.close(0)
        if raw is None or not isinstance(decode_answer(raw), DemandStats):
            tally.findings.append(f"answer thread silent after {tag}")
            return False
        return True

    sock_frames: list[tuple] = []

    def over_socket(tokens: list[int], items: list) -> None:
        if not sock_frames:
            return
        for _ in range(6):
            if not sock_frames:
                return
            name, payload, expect = sock_frames.pop()
            before = check.pool_state(ours)
            t0 = time.perf_counter()
            raw = ask(client, payload)
            tally.time(f"socket:{name}", time.perf_counter() - t0)
            c["frames_socket"] += 1
            if raw is None:
                c["no_reply"] += 1
                tally.findings.append(f"socket:{name}: no answer within 10 s")
                continue
            if check.pool_state(ours) != before:
                c["side_effects"] += 1
                tally.findings.append(f"socket:{name}: the answer changed P's pool state")
            tally.judge(f"socket:{name}", payload, raw, expect)

    tokens, items = stream.next()
    sock_frames.extend(hostile_frames(tokens, items, rng))
    while sock_frames:
        turn(over_socket)

    # frames a DEALER should not send: none gets an answer, the thread answers the next query
    specials = {
        "three_parts": [b"a", b"b"],  # the ROUTER sees [identity, a, b]
        "empty_frame": [b""],
        "empty_parts": [b"", b""],
    }
    for name, parts in specials.items():
        raw = ask(client, parts, timeout=0.3)
        if name == "empty_frame":  # one empty frame is a (malformed) query: a DemandError
            if raw is None or not isinstance(decode_answer(raw), DemandError):
                tally.findings.append(f"socket:{name}: not a DemandError")
        elif raw is not None:
            tally.findings.append(f"socket:{name}: answered {raw[:60]!r}")
        c[f"alive_after_{name}"] = alive(name)
    # raw TCP garbage (not ZMTP), and a frame over the ROUTER's size limit
    with socket.create_connection(("127.0.0.1", port)) as raw_sock:
        raw_sock.sendall(rng.randbytes(64 * 1024))
    c["alive_after_tcp_garbage"] = alive("tcp_garbage")
    big = dealer()
    t0 = time.perf_counter()
    raw = ask(big, b"\x00" * (ours._answers.max_query_bytes + 1), timeout=3.0)
    c["oversize_answered"] = raw is not None
    c["oversize_s"] = round(time.perf_counter() - t0, 3)
    big.close(0)
    c["alive_after_oversize"] = alive("oversize")

    # a handler bug (any exception) costs that frame only, never the answer thread
    calls = [0]

    def flaky(payload: bytes) -> bytes:
        calls[0] += 1
        if calls[0] == 1:
            raise MemoryError("a handler bug")
        return ours._answers.handle(payload)

    port2 = check.free_port()
    flaky_server = ControlServer(f"tcp://127.0.0.1:{port2}", flaky)
    flaky_server.start()
    d2 = ctx.socket(zmq.DEALER)
    d2.setsockopt(zmq.LINGER, 0)
    d2.connect(f"tcp://127.0.0.1:{port2}")
    first = ask(d2, encode(StatsQuery("f1")), timeout=1.0)
    second = ask(d2, encode(StatsQuery("f2")), timeout=5.0)
    c["survives_handler_error"] = first is None and second is not None
    if not c["survives_handler_error"]:
        tally.findings.append("the answer thread stopped after its handler raised")
    d2.close(0)
    flaky_server.stop()

    # 3. a burst of BURST queries whose answers are not read, while the engine steps
    burst = dealer()
    burst.setsockopt(zmq.SNDHWM, 0)  # queue them all on the client side
    hostile = hostile_frames(tokens, items, rng)
    small = [f[1] for f in hostile if len(f[1]) < 64 * 1024 and f[2][0] != "stats"]
    counters = ours._answers.counters
    start = counters.answers + counters.errors - rid[0]  # rid: one direct answer per request

    def answered() -> int:
        return counters.answers + counters.errors - rid[0] - start

    def flood() -> None:
        for i in range(BURST):
            burst.send(small[i % len(small)])

    t_flood = threading.Thread(target=flood)
    t_flood.start()
    burst_steps = c["steps"]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (answered() < BURST or c["steps"] - burst_steps < 8):
        if len(ours.waiting) + len(ours.running) < 6:  # P busy, its queue bounded
            turn(lambda *_: None)
        else:
            step()
    t_flood.join()
    c["burst_answered"] = answered()
    if answered() < BURST:
        tally.findings.append(f"burst: {answered()} of {BURST} answered within 120 s")
    c["burst_steps"] = c["steps"] - burst_steps
    c["alive_after_burst"] = alive("burst")
    got = 0
    while burst.poll(500):
        burst.recv()
        got += 1
    c["burst_answers_read"] = got
    burst.close(0)

    for _ in range(60):  # drain
        if not ours.has_requests():
            break
        step()
    final = msgspec.msgpack.decode(ours._answers.handle(encode(StatsQuery("f", check_index=True))))
    c["final_index_mismatches"] = final["index_mismatches"]
    c["thread_alive"] = server._thread.is_alive()
    server.stop()
    client.close(0)

    if c["slowest_step_s"] > SLOW_S:
        tally.findings.append(f"an engine step took {c['slowest_step_s']:.2f} s")
    for key in ("raised", "invalid", "side_effects", "output_mismatch", "index_mismatch"):
        if c[key]:
            tally.findings.append(f"{key}: {c[key]}")
    if c["final_index_mismatches"] or not c["thread_alive"]:
        tally.findings.append("index mismatches at the end, or the answer thread died")
    if c["max_lock_held_s"] > SLOW_S:
        tally.findings.append(f"{c['max_lock_held']}: held P's lock {c['max_lock_held_s']:.2f} s")
    c["slowest_s"] = round(c["slowest_s"], 4)
    c["max_lock_held_s"] = round(c["max_lock_held_s"], 4)
    c["slowest_step_s"] = round(c["slowest_step_s"], 4)
    c["unexpected_names"] = tally.unexpected
    c["findings"] = tally.findings
    return c


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:]]
    print(json.dumps(main(*args)))

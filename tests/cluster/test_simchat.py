"""Simulator streams as chat requests for the tiny CPU model (mmreuse.cluster.simchat): exact token
counts, image sizes, shared-image uuids, resent histories, refusals."""

import base64
import dataclasses
import importlib.util
import json
import struct
import zlib
from array import array
from collections import defaultdict

import pytest

pytest.importorskip("torch")  # mmreuse.sim needs it

from mmreuse.cluster.model import model_files
from mmreuse.cluster.profile import SERVING, TINY
from mmreuse.cluster.simchat import ChatRequest, chat_requests, image_size, image_url, text
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.sim import WorkloadConfig, generate
from mmreuse.sim.workload import Session, SimRequest

RUN = "run-a"


def stream(kind, requests=120, seed=0, **kw):
    kw.setdefault("image_tokens", "fixed:16")
    return generate(WorkloadConfig(kind=kind, requests=requests, **kw), seed)


def write_trace(tmp_path, records):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


TRACE = [
    {"session": "a", "arrival_s": 0, "text_tokens": 7, "images": [{"id": "x", "tokens": 4}]},
    {"session": "b", "arrival_s": 1, "images": [{"id": "x", "tokens": 4}], "output_tokens": 3},
    {"session": "a", "arrival_s": 2, "text_tokens": 0, "output_tokens": 5},  # history only
    {
        "session": "b",
        "arrival_s": 3,
        "text_tokens": 2,
        "images": [{"id": "y", "tokens": 13}, {"id": "z", "tokens": 9}],
    },
    {"session": "a", "arrival_s": 4, "text_tokens": 1},
]


def trace_stream(tmp_path, records=TRACE):
    path = write_trace(tmp_path, records)
    return generate(WorkloadConfig(kind="trace", trace_path=str(path)), 0)


def png_size(url):
    """(width, height) of a PNG data URL, its pixels decoded (a well-formed 8-bit RGB PNG)."""
    prefix = "data:image/png;base64,"
    assert url.startswith(prefix)
    png = base64.b64decode(url[len(prefix) :])
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    width, height, depth, colour = struct.unpack(">IIBB", png[16:26])
    assert (depth, colour) == (8, 2)
    idat = png.index(b"IDAT")
    (length,) = struct.unpack(">I", png[idat - 4 : idat])
    raw = zlib.decompress(png[idat + 4 : idat + 4 + length])
    assert len(raw) == height * (1 + 3 * width)
    return width, height


def parts(req: ChatRequest):
    """The body's (role, kind, value) in order: text strings and image parts."""
    for m in req.body["messages"]:
        if m["role"] == "assistant":
            yield "assistant", "text", m["content"]
        else:
            for p in m["content"]:
                yield "user", p["type"], p["text"] if p["type"] == "text" else p


def check_stream(requests, out, run=RUN):
    """Every property a converted stream must have, against its SimRequests."""
    assert len(out) == len(requests)
    for r, c in zip(requests, out, strict=True):
        assert (c.rid, c.session, c.turn) == (r.rid, r.session.sid, r.turn)
        assert c.arrival_s == r.arrival_ms / 1000.0
        assert c.uuids == tuple(f"{run}-{m.identifier}" for m in r.mm)
        assert c.image_tokens == sum(m.length for m in r.mm)
        assert c.text_tokens + c.image_tokens == r.num_tokens
        body = c.body
        assert body["temperature"] == 0 and body["cache_salt"] == run
        assert body["return_token_ids"] is True and body["max_tokens"] == 1
        msgs = body["messages"]
        turns = r.session.turns[: r.turn + 1]
        assert [m["role"] for m in msgs] == ["user", "assistant"] * r.turn + ["user"]
        texts = 0
        for j, t in enumerate(turns):
            user = msgs[2 * j]["content"]
            said = "".join(p["text"] for p in user if p["type"] == "text")
            images = [p for p in user if p["type"] == "image_url"]
            assert len(said) == t.text_tokens and said.isascii() and (not said or said.isalnum())
            assert user[0]["type"] == "text" or t.text_tokens == 0  # text first, then images
            assert [p["uuid"] for p in images] == [f"{run}-{i}" for i, _ in t.images]
            for p, (_, n) in zip(images, t.images, strict=True):
                w, h = png_size(p["image_url"]["url"])
                assert w % 28 == 0 and h % 28 == 0 and (w // 28) * (h // 28) == n
                assert TINY.min_pixels <= w * h <= TINY.max_pixels
            texts += len(said)
            if j < r.turn:
                answer = msgs[2 * j + 1]["content"]
                assert len(answer) == t.output_tokens and answer.isascii()
                texts += len(answer)
        assert texts == c.text_tokens
        uuids_in_body = [v["uuid"] for role, kind, v in parts(c) if kind == "image_url"]
        assert tuple(uuids_in_body) == c.uuids


@pytest.mark.parametrize("kind", ["chat", "fanout", "agentic"])
def test_generated_streams_convert(kind):
    requests = stream(kind)
    out = chat_requests(requests, RUN)
    check_stream(requests, out)
    assert sum(c.image_tokens for c in out) > 0 and sum(c.turn > 0 for c in out) > 0


def test_a_trace_converts(tmp_path):
    requests = trace_stream(tmp_path)
    out = chat_requests(requests, RUN)
    check_stream(requests, out)
    by_turn = {(c.session, c.turn): c for c in out}
    a2 = by_turn[(0, 2)].body["messages"]
    assert [len(m["content"]) for m in a2 if m["role"] == "assistant"] == [0, 5]
    assert a2[2]["content"] == [{"type": "text", "text": ""}]  # a turn of history only
    b1 = by_turn[(1, 1)]
    assert b1.uuids == (f"{RUN}-x", f"{RUN}-y", f"{RUN}-z") and b1.image_tokens == 26
    assert [png_size(p["image_url"]["url"]) for p in b1.body["messages"][2]["content"][1:]] == [
        (364, 28),  # 13 tokens: prime, one row
        (84, 84),
    ]


def test_history_is_resent_with_the_answers_between():
    requests = stream("chat", requests=200)
    out = chat_requests(requests, RUN)
    by_session = defaultdict(dict)
    for r, c in zip(requests, out, strict=True):
        by_session[c.session][c.turn] = (r, c)
    pairs = 0
    for turns in by_session.values():
        for k in turns:
            if k - 1 not in turns:
                continue
            prev, cur = turns[k - 1][1].body["messages"], turns[k][1].body["messages"]
            assert cur[: len(prev)] == prev
            assert len(cur) == len(prev) + 2
            assert cur[len(prev)]["role"] == "assistant" and cur[-1]["role"] == "user"
            assert len(cur[len(prev)]["content"]) == turns[k][0].session.turns[k - 1].output_tokens
            pairs += 1
    assert pairs > 50


def test_deterministic_per_run_and_distinct_across_runs_and_sessions():
    requests = stream("chat")
    a, b = chat_requests(requests, RUN), chat_requests(list(requests), RUN)
    assert [json.dumps(c.body) for c in a] == [json.dumps(c.body) for c in b]
    assert [dataclasses.astuple(c) for c in a] == [dataclasses.astuple(c) for c in b]
    other = chat_requests(requests, "run-b")
    first = [c.body["messages"][0]["content"][0]["text"] for c in a if c.turn == 0]
    assert len(set(first)) == len(first)  # sessions do not share text
    for x, y in zip(a, other, strict=True):
        assert y.body["cache_salt"] == "run-b"
        assert x.uuids != y.uuids or not x.uuids
        assert x.body["messages"][0]["content"][0] != y.body["messages"][0]["content"][0]
        urls = [p["image_url"]["url"] for p in x.body["messages"][0]["content"][1:]]
        assert urls == [p["image_url"]["url"] for p in y.body["messages"][0]["content"][1:]]
    assert text(RUN, 3, 1, "user", 40) == text(RUN, 3, 1, "user", 40)
    assert text(RUN, 3, 1, "user", 40) != text(RUN, 3, 1, "assistant", 40)


def test_shared_images_share_uuid_and_bytes():
    requests = stream("fanout", requests=300)
    out = chat_requests(requests, RUN)
    seen: dict[str, tuple[str, set[int]]] = {}
    for c in out:
        for _role, kind, p in parts(c):
            if kind == "image_url":
                url, sessions = seen.setdefault(p["uuid"], (p["image_url"]["url"], set()))
                assert p["image_url"]["url"] == url
                sessions.add(c.session)
    shared = [u for u, (_, s) in seen.items() if len(s) > 1]
    assert shared  # fan-out: a popular image in many sessions, one uuid, one PNG
    urls = [url for url, _ in seen.values()]
    assert len(set(urls)) == len(urls)  # distinct images, distinct bytes


def test_image_sizes_give_the_token_counts():
    for n in range(4, 17):
        w, h = image_size("i", n)
        assert (w // 28) * (h // 28) == n and w % 28 == 0 and h % 28 == 0 and w >= h
        assert TINY.min_pixels <= w * h <= TINY.max_pixels
        assert png_size(image_url(f"i{n}", n)) == (w, h)
    assert image_size("i", 16) == (112, 112) and image_size("i", 6) == (84, 56)
    assert image_url("same", 9) == image_url("same", 9) != image_url("other", 9)
    for n in (1, 3, 17, 576):
        with pytest.raises(InvalidArgument, match=r"^image 'bad' tokens must be in \[4, 16\]"):
            image_size("bad", n)
    with pytest.raises(InvalidArgument, match=r"^image 'bad' tokens must be >= 1, got 0"):
        image_size("bad", 0)


def test_image_sizes_follow_the_profile():
    """The serving profile keeps images of 256-1,280 tokens as they are (and names itself when
    a count is out of its range)."""
    for n in (256, 405, 576, 1224, 1280):
        w, h = image_size("i", n, SERVING)
        assert (w // 28) * (h // 28) == n and SERVING.min_pixels <= w * h <= SERVING.max_pixels
        assert png_size(image_url(f"s{n}", n, SERVING)) == (w, h)
    assert image_url("same", 576, SERVING) != image_url("same", 16)
    with pytest.raises(InvalidArgument, match=r"in \[256, 1280\], what the serving model's"):
        image_size("bad", 16, SERVING)
    requests = stream("chat", requests=4, image_tokens="fixed:576")
    for c in chat_requests(requests, RUN, profile=SERVING):
        for msg in c.body["messages"]:
            for p in msg["content"] if isinstance(msg["content"], list) else ():
                if p["type"] == "image_url":
                    w, h = png_size(p["image_url"]["url"])
                    assert (w // 28) * (h // 28) == 576
    with pytest.raises(InvalidArgument, match=r"in \[4, 16\]"):
        chat_requests(requests, RUN)  # the tiny model cannot keep 576 tokens
    with pytest.raises(InvalidArgument, match="profile"):
        chat_requests(requests, RUN, profile="serving")  # type: ignore[arg-type]


def test_real_tokenizer_counts_one_token_per_character():
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_str(model_files()["tokenizer.json"])
    requests = stream("chat", requests=60)
    for c in chat_requests(requests, RUN):
        for _, kind, value in parts(c):
            if kind == "text":
                assert len(tok.encode(value, add_special_tokens=False).ids) == len(value)


def test_image_counts_the_tiny_model_cannot_make_are_refused(tmp_path):
    requests = stream("chat", image_tokens="fixed576")
    ident = requests[0].mm[0].identifier
    with pytest.raises(
        InvalidArgument, match=rf"^image '{ident[:20]}.* tokens must be in \[4, 16\]"
    ):
        chat_requests(requests, RUN)
    too_big = [{"session": "a", "arrival_s": 0, "images": [{"id": "big", "tokens": 17}]}]
    with pytest.raises(InvalidArgument, match=r"^image 'big' tokens must be in \[4, 16\].*got 17$"):
        chat_requests(trace_stream(tmp_path, too_big), RUN)


def test_one_id_with_two_token_counts_is_refused(tmp_path):
    records = [
        {"session": "a", "arrival_s": 0, "images": [{"id": "x", "tokens": 4}]},
        {"session": "b", "arrival_s": 1, "images": [{"id": "x", "tokens": 9}]},
    ]
    with pytest.raises(InvalidArgument, match=r"^image 'x' tokens: 4 in one place and 9"):
        chat_requests(trace_stream(tmp_path, records), RUN)


def test_inputs_are_checked(tmp_path):
    requests = trace_stream(tmp_path)
    with pytest.raises(InvalidArgument, match=r"^run must be a non-empty str, got ''$"):
        chat_requests(requests, "")
    with pytest.raises(InvalidArgumentType, match=r"^run must be"):
        chat_requests(requests, 7)
    with pytest.raises(InvalidArgument, match=r"^run must be valid Unicode"):
        chat_requests(requests, "\ud800")
    with pytest.raises(InvalidArgument, match=r"^max_tokens must be >= 1, got 0"):
        chat_requests(requests, RUN, max_tokens=0)
    with pytest.raises(InvalidArgumentType, match=r"^max_tokens must be an int"):
        chat_requests(requests, RUN, max_tokens=1.0)
    with pytest.raises(InvalidArgument, match=r"^model"):
        chat_requests(requests, RUN, model="")
    with pytest.raises(InvalidArgumentType, match=r"^requests must be a sequence"):
        chat_requests(iter(requests), RUN)
    with pytest.raises(InvalidArgumentType, match=r"^requests\[1\] must be a SimRequest"):
        chat_requests([requests[0], "x"], RUN)
    out = chat_requests(requests, RUN, model="m", max_tokens=4)
    assert {c.body["model"] for c in out} == {"m"} and {c.body["max_tokens"] for c in out} == {4}
    assert chat_requests([], RUN) == []


def test_requests_whose_turns_do_not_match_their_prompt_are_refused(tmp_path):
    r = trace_stream(tmp_path)[0]
    bare = SimRequest(0, Session(0, array("q"), r.session.mm, []), 0, 0.0, r.num_tokens, 1)
    with pytest.raises(InvalidArgument, match=r"^requests\[0\]\.turn must be in \[0, 0\)"):
        chat_requests([bare], RUN)
    off = dataclasses.replace(r, num_tokens=r.num_tokens + 1)
    with pytest.raises(InvalidArgument, match=r"^requests\[0\]: its session's turns 0\.\.0 hold"):
        chat_requests([off], RUN)


@pytest.mark.parametrize("kind", ["chat", "fanout", "agentic", "trace"])
def test_session_turns_rebuild_every_prompt(kind, tmp_path):
    """Session.turns, as every generator and the trace reader record them, place every image and
    count every request's tokens as the session's token history does."""
    if kind == "trace":
        requests = trace_stream(tmp_path)
    else:
        requests = stream(kind, requests=150, image_tokens="qwen2vl")
    sessions = {r.session.sid: r.session for r in requests}
    for s in sessions.values():
        length, placed = 0, []
        for t in s.turns:
            length += t.text_tokens
            for ident, n in t.images:
                placed.append((ident, length, n))
                length += n
            length += t.output_tokens
        assert placed == [(m.identifier, m.offset, m.length) for m in s.mm]
        assert length == len(s.tokens)
    for r in requests:
        assert ends_of(r.session)[r.turn] == (r.num_tokens, r.num_mm)
        assert r.turns == r.session.turns[: r.turn + 1]


def ends_of(session):
    """(prompt tokens, occurrences) of each turn's request, from the session's turns."""
    out, length, images = [], 0, 0
    for t in session.turns:
        length += t.text_tokens + sum(n for _, n in t.images)
        images += len(t.images)
        out.append((length, images))
        length += t.output_tokens
    return out


needs_skimage = pytest.mark.skipif(
    importlib.util.find_spec("skimage") is None,
    reason="scikit-image (the bench extra) is not installed",
)


@needs_skimage
def test_servegen_photos_become_real_photographs_under_run_scoped_uuids():
    """servegen-photos: ServeGen's image tokens are far past what the tiny model keeps, so
    its images are sent as the shipped photographs (no size check), one photo per image id."""
    from mmreuse.cluster.photos import PHOTOS, load_photos, photo_for

    requests = generate(
        WorkloadConfig(kind="servegen-photos", requests=60, mean_turns=3.0, max_images=4), 0
    )
    assert max(m.length for r in requests for m in r.mm) > 16  # the tiny model could not
    out = chat_requests(requests, RUN, max_tokens=16, photos=True, answer_tokens=True)
    shipped = load_photos()
    seen = 0
    for r, c in zip(requests, out, strict=True):
        parts = [p for m in c.body["messages"] if m["role"] == "user" for p in m["content"]]
        images = [p for p in parts if p["type"] == "image_url"]
        assert [p["uuid"] for p in images] == [f"{RUN}-{m.identifier}" for m in r.mm]
        for p, m in zip(images, r.mm, strict=True):
            k = photo_for(m.identifier)
            head, b64 = p["image_url"]["url"].split(",", 1)
            assert head == f"data:{PHOTOS[k].mime};base64"
            assert base64.b64decode(b64) == shipped[k]
            seen += 1
        own = r.session.turns[r.turn].output_tokens
        assert c.body["max_tokens"] == min(16, max(1, own))
        assert c.image_tokens == sum(m.length for m in r.mm)  # the simulator's counts
    assert seen > 30
    plain = chat_requests(stream("chat"), RUN, max_tokens=3)
    assert {c.body["max_tokens"] for c in plain} == {3}
    with pytest.raises(InvalidArgument, match=r"image .* tokens"):  # PNGs of that size: refused
        chat_requests(requests, RUN)


def test_photo_and_answer_flags_are_checked():
    with pytest.raises(InvalidArgumentType, match=r"^photos"):
        chat_requests(stream("chat", requests=3), RUN, photos=1)
    with pytest.raises(InvalidArgumentType, match=r"^answer_tokens"):
        chat_requests(stream("chat", requests=3), RUN, answer_tokens="yes")

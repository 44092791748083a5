"""mmreuse.embedding_store: vLLM's key and object format for embeddings in the Mooncake Store,
and calls into a store that stalls, fails or answers junk, each bounded in time."""

from __future__ import annotations

import logging
import struct
import threading
import time
from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mmreuse.embedding_store import (
    HEADER,
    MAGIC,
    NamespaceCard,
    NamespaceCards,
    StoreCalls,
    StoreObjectError,
    embedding_key,
    namespace_model,
    pack_embedding,
    unpack_embedding,
)
from mmreuse.errors import InvalidArgument
from tests.support.fake_mooncake import FakeMooncakeStore


def test_key_is_vllms():
    # vLLM's make_embedding_key: f"{namespace}@id:{identifier}"
    assert embedding_key("embedding@model:m@protocol:v3", "abc") == (
        "embedding@model:m@protocol:v3@id:abc"
    )
    with pytest.raises(InvalidArgument, match="identifier"):
        embedding_key("ns", "")


@pytest.mark.parametrize(("dtype", "code"), [("float32", 0), ("float16", 11), ("bfloat16", 12)])
def test_header_is_vllms(dtype, code):
    torch = pytest.importorskip("torch")  # the library's torch-free tier runs the rest
    t = torch.arange(12, dtype=getattr(torch, dtype)).view(3, 4)
    raw = t.view(torch.uint8).numpy().tobytes()
    data = pack_embedding(dtype, 3, 4, raw)
    assert data[: HEADER.size] == struct.pack("<IIQQ", 0x4D4F4F4E, code, 3, 4)
    back = unpack_embedding(data, tokens=3)
    assert (back.dtype, back.tokens, back.hidden, back.payload) == (dtype, 3, 4, raw)
    again = torch.frombuffer(bytearray(back.payload), dtype=t.dtype).view(3, 4)
    assert torch.equal(again, t)


@given(st.binary(max_size=64))
def test_junk_is_refused_by_name(data):
    try:
        unpack_embedding(data)
    except StoreObjectError:
        return
    # the only bytes that decode are a well-formed object
    magic, _, n, h = HEADER.unpack_from(data)
    assert magic == MAGIC and len(data) == HEADER.size + n * h * 2


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "shorter than its header"),
        (HEADER.pack(1, 12, 1, 1) + b"xx", "magic"),
        (HEADER.pack(MAGIC, 7, 1, 1) + b"xx", "dtype code 7"),
        (HEADER.pack(MAGIC, 12, 0, 4), "empty"),
        (HEADER.pack(MAGIC, 12, 2, 2) + b"x" * 7, "its header says 32"),
        (HEADER.pack(MAGIC, 12, 3, 1) + b"x" * 6, "3 tokens, the request expects 2"),
    ],
)
def test_each_bad_object_says_why(data, match):
    with pytest.raises(StoreObjectError, match=match):
        unpack_embedding(data, tokens=2)


@pytest.mark.parametrize(
    ("expect", "match"),
    [
        ({"tokens": 2, "hidden": 4, "dtype": "bfloat16"}, "object has 3 tokens"),  # the guard
        ({"tokens": 3, "hidden": 8, "dtype": "bfloat16"}, "hidden size is 4, the model expects 8"),
        ({"tokens": 3, "hidden": 4, "dtype": "float16"}, "dtype is bfloat16, the model expects"),
    ],
)
def test_an_object_of_another_shape_or_dtype_is_refused(expect, match):
    # vLLM's _validate_mooncake_tensor_metadata: dtype and (num_tokens, hidden_dim) both
    data = pack_embedding("bfloat16", 3, 4, b"x" * 24)
    with pytest.raises(StoreObjectError, match=match):
        unpack_embedding(data, **expect)
    assert unpack_embedding(data, tokens=3, hidden=4, dtype="bfloat16").hidden == 4


def test_pack_checks_its_input():
    with pytest.raises(InvalidArgument, match="dtype"):
        pack_embedding("int8", 1, 1, b"x")
    with pytest.raises(InvalidArgument, match="payload must be 8 bytes"):
        pack_embedding("bfloat16", 2, 2, b"x" * 7)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_stalled_store_is_a_bounded_miss_then_left_alone():
    release = threading.Event()
    clock = Clock()
    calls = StoreCalls(lambda: "client", timeout=0.05, backoff=5.0, clock=clock)
    t0 = time.monotonic()
    assert calls.call("is_exist", lambda c: release.wait(), "miss") == "miss"
    assert time.monotonic() - t0 < 2.0
    assert calls.misses["timeout"] == 1 and "is_exist: no answer" in calls.last_error
    # still stuck: an answer at once, not a second stuck thread
    clock.now = 10.0
    assert calls.call("is_exist", lambda c: 1, "miss") == "miss"
    assert calls.misses["busy"] == 1
    release.set()
    time.sleep(0.05)
    clock.now = 2.0  # within the backoff (from the timeout at 0.0)
    assert calls.call("is_exist", lambda c: 1, "miss") == "miss"
    assert calls.misses["backing_off"] == 1
    clock.now = 10.0
    assert calls.call("is_exist", lambda c: 1, "miss") == 1
    calls.close()


def test_a_call_may_wait_longer_than_the_probes_deadline():
    calls = StoreCalls(lambda: "client", timeout=0.01, backoff=5.0)
    # a transfer slower than a probe's deadline, within its own: an answer, not a miss
    assert calls.call("get", lambda c: time.sleep(0.1) or b"data", b"", timeout=2.0) == b"data"
    assert not calls.misses
    release = threading.Event()
    assert calls.call("get", lambda c: release.wait(), b"", timeout=0.05) == b""
    assert "get: no answer in 0.05 s" in calls.last_error
    release.set()
    with pytest.raises(InvalidArgument, match="timeout"):
        calls.call("get", lambda c: b"", b"", timeout=0)
    calls.close()


def test_a_failing_connect_is_retried_after_the_backoff():
    clock = Clock()
    tries = []

    def connect():
        tries.append(clock.now)
        if len(tries) == 1:
            raise ConnectionError("master down")
        return {"k": 1}

    calls = StoreCalls(connect, timeout=1.0, backoff=3.0, clock=clock)
    assert calls.call("get", lambda c: c["k"], 0) == 0
    assert calls.misses["error"] == 1 and "master down" in calls.last_error
    clock.now = 1.0
    assert calls.call("get", lambda c: c["k"], 0) == 0 and tries == [0.0]
    clock.now = 4.0
    assert calls.call("get", lambda c: c["k"], 0) == 1 and calls.connected
    calls.close()


def test_warm_connects_without_waiting():
    started = threading.Event()
    calls = StoreCalls(lambda: started.set() or "c", timeout=1.0)
    calls.warm()
    assert started.wait(2.0)
    assert calls.call("x", lambda c: c, None) == "c"
    calls.close()


def test_settings_are_checked():
    with pytest.raises(InvalidArgument, match="timeout"):
        StoreCalls(lambda: None, timeout=0)


def test_ready_waits_for_the_set_up_in_flight():
    gate = threading.Event()
    calls = StoreCalls(lambda: gate.wait(5) and "c", timeout=1.0)
    calls.warm()
    assert not calls.ready(0.05)  # still setting up: not connected, and no wait past 0.05 s
    gate.set()
    assert calls.ready(2.0) and calls.connected
    calls.close()
    failing = StoreCalls(lambda: 1 / 0, timeout=1.0)
    failing.warm()
    assert not failing.ready(2.0)  # the set-up failed: not ready, and no raise
    failing.close()


# ---- namespace cards -----------------------------------------------------------------------

NS_033 = (
    "embedding@model:tiny@revision:default@encoder:9718b4d865edd0070aac6f4dd005d93b"
    "@dtype:torch.float16@protocol:v3"
)
NS_034 = (
    "embedding@model:tiny@revision:default@encoder:"
    "4f11544c5ce21e6df33ae333e1855b5e3ee358528368671b86075ea77280697e@dtype:torch.float16"
    "@protocol:v3"
)
RULES = ("md5-list", "sha256-json")
CARD_OF_HUGE_TIME = (
    b'{"mmreuse_card": 1, "rule": "r", "vllm": "v", "namespace": "n", "written": '
    + b"9" * 400
    + b"}"
)


def cards(store, clock, namespace, rule, vllm, period=60.0):
    calls = StoreCalls(lambda: store, timeout=1.0)
    card = NamespaceCard(rule, vllm, namespace)
    return NamespaceCards(calls, card, RULES, period=period, clock=clock)


@pytest.mark.parametrize(
    ("namespace", "model"),
    [
        (NS_033, "embedding@model:tiny@revision:default@dtype:torch.float16@protocol:v3"),
        (NS_034, "embedding@model:tiny@revision:default@dtype:torch.float16@protocol:v3"),
        (  # a model without a multimodal config; a cache prefix
            "pfx@embedding@model:m@revision:r@encoder:encoder:default@dtype:torch.bfloat16"
            "@protocol:v3",
            "pfx@embedding@model:m@revision:r@dtype:torch.bfloat16@protocol:v3",
        ),
        ("my-shared-namespace", None),  # one a user set: no card
    ],
)
def test_the_card_key_is_the_namespace_without_its_encoder_hash(namespace, model):
    assert namespace_model(namespace) == model


def test_a_card_round_trips_and_junk_is_refused_by_name():
    card = NamespaceCard("sha256-json", "0.34.0", NS_034, 1.5)
    data = card.pack()
    assert len(data) < 400 and NamespaceCard.unpack(data) == card
    for junk, match in [
        (b"", "empty"),
        (b"x" * 5000, "over 4096"),
        (b"\xff\xfe", "not JSON"),
        (b"[" * 3000, "not JSON"),
        (b'{"rule": "md5-list"}', "not a namespace card"),
        (b'{"mmreuse_card": 1, "rule": 1, "vllm": "v", "namespace": "n", "written": 0}', "rule"),
        (
            b'{"mmreuse_card": 1, "rule": "r", "vllm": "v", "namespace": "n", "written": true}',
            "time",
        ),
        # a time that is no number of seconds: infinite, or an int too large for a float
        (
            b'{"mmreuse_card": 1, "rule": "r", "vllm": "v", "namespace": "n", "written": 1e999}',
            "time",
        ),
        (CARD_OF_HUGE_TIME, "time"),
    ]:
        with pytest.raises(StoreObjectError, match=match):
            NamespaceCard.unpack(junk)


@given(st.binary(max_size=300))
def test_any_bytes_are_a_card_or_refused(data):
    try:
        card = NamespaceCard.unpack(data)
    except StoreObjectError:
        return
    back = NamespaceCard.unpack(card.pack())  # what decodes is a card
    assert (back.rule, back.vllm, back.namespace) == (card.rule, card.vllm, card.namespace)


def test_two_rules_on_one_store_the_second_finds_the_first_by_name():
    store, clock = FakeMooncakeStore(), Clock()
    clock.now = 1_000_000.0
    old = cards(store, clock, NS_033, "md5-list", "0.33.0")
    assert old.start() == (True, None)  # alone: it writes its card
    assert [k for k in store.objects] == [old.key("md5-list", 1_000_000 // 60)]
    clock.now += 25
    new = cards(store, clock, NS_034, "sha256-json", "0.34.0")
    answered, other = new.start()
    assert answered and other == NamespaceCard("md5-list", "0.33.0", NS_033, 1_000_000.0)
    assert len(store.objects) == 1  # a refused instance leaves no card
    # and the other way round: the running one finds the newcomer's card at its refresh
    new.write()
    clock.now += 40
    assert old.due()
    answered, other = old.refresh()
    assert answered and (other.rule, other.vllm, other.namespace) == (
        "sha256-json",
        "0.34.0",
        NS_034,
    )


def test_the_same_rule_shares_one_card_and_finds_nothing():
    store, clock = FakeMooncakeStore(), Clock()
    e = cards(store, clock, NS_034, "sha256-json", "0.34.0")
    p = cards(store, clock, NS_034, "sha256-json", "0.34.0")
    assert e.start() == (True, None) and p.start() == (True, None)
    assert len(store.objects) == 1 and p.stats["written"] == 1  # its put met E's card: as good
    # 0.32 and 0.33 build namespaces by the same rule: the same card, no conflict
    v32 = cards(store, clock, NS_033, "md5-list", "0.32.0")
    v33 = cards(store, clock, NS_033, "md5-list", "0.33.0")
    store.objects.clear()
    assert v32.start() == (True, None) and v33.start() == (True, None)


def test_another_model_is_no_conflict():
    store, clock = FakeMooncakeStore(), Clock()
    cards(store, clock, NS_033, "md5-list", "0.33.0").start()
    other_model = NS_034.replace("model:tiny", "model:other")
    assert cards(store, clock, other_model, "sha256-json", "0.34.0").start() == (True, None)


def test_a_stale_card_is_ignored_and_removed_by_its_own_rule():
    store, clock = FakeMooncakeStore(), Clock()
    old = cards(store, clock, NS_033, "md5-list", "0.33.0")
    old.start()  # written at t=0 (bucket 0), then its instance stops
    clock.now = 119.0  # bucket 1: the card is one bucket old, still fresh
    new = cards(store, clock, NS_034, "sha256-json", "0.34.0")
    assert new.find_other()[1] is not None
    clock.now = 120.0  # bucket 2: two buckets old, stale
    assert new.start() == (True, None)
    # an instance of the old rule that keeps running removes its rule's cards 3 buckets old
    survivor = cards(store, clock, NS_033, "md5-list", "0.33.0")
    clock.now = 180.0
    survivor.write()
    assert old.key("md5-list", 0) not in store.objects


def test_a_card_from_a_clock_a_little_ahead_is_fresh():
    store, ahead, behind = FakeMooncakeStore(), Clock(), Clock()
    ahead.now, behind.now = 1_000.0 + 50, 1_000.0
    cards(store, ahead, NS_033, "md5-list", "0.33.0").start()  # bucket 17, reader's 16
    assert cards(store, behind, NS_034, "sha256-json", "0.34.0").start()[1] is not None


# ---- a card that does not count: logged once, ignored, and the look goes on ----

NOW = 1_000_000.0  # bucket 16666 of 60 s (40 s into it)
BUCKET = 16666


def newcomer(store, clock, caplog):
    """A 0.34 instance (rule sha256-json) looking for 0.33's cards (md5-list), its log kept."""
    caplog.set_level(logging.WARNING, logger="mmreuse.embedding_store")
    clock.now = NOW
    return cards(store, clock, NS_034, "sha256-json", "0.34.0")


def ignored_logs(caplog):
    return [r.getMessage() for r in caplog.records if "is ignored" in r.getMessage()]


@pytest.mark.parametrize(
    "junk",
    [
        b"\x00junk",
        b"x" * 5000,
        b'{"mmreuse_card": 1}',
        b'{"mmreuse_card": 1, "rule": "md5-list", "vllm": "0.33.0", "namespace": "n", '
        b'"written": 1e999}',
        CARD_OF_HUGE_TIME,
    ],
)
def test_junk_under_another_rules_key_is_ignored_and_start_writes_its_card(junk, caplog):
    store, clock = FakeMooncakeStore(), Clock()
    c = newcomer(store, clock, caplog)
    store.objects[c.key("md5-list", BUCKET)] = junk
    assert c.start() == (True, None)
    assert c.key("sha256-json", BUCKET) in store.objects  # it started: its own card written
    assert c.stats["ignored_undecodable"] == 1 and c.stats["found"] == 0
    [line] = ignored_logs(caplog)
    assert f"card under {c.key('md5-list', BUCKET)} is ignored: it is not a namespace card" in line


OTHER_MODEL = NS_033.replace("model:tiny", "model:other")


@pytest.mark.parametrize(
    ("card", "bucket", "reason"),
    [
        # the namespace of this very instance: no conflict, whatever its key says
        (NamespaceCard("md5-list", "0.33.0", NS_034, NOW), BUCKET, "own_namespace"),
        # written 57 years ago, or two minutes after its key's minute
        (NamespaceCard("md5-list", "0.33.0", NS_033, 1.0), BUCKET, "off_bucket"),
        (NamespaceCard("md5-list", "0.33.0", NS_033, NOW + 150), BUCKET, "off_bucket"),
        # its key's minute give or take one, yet more than two minutes from now
        (NamespaceCard("md5-list", "0.33.0", NS_033, NOW - 150), BUCKET - 1, "stale"),
        (NamespaceCard("md5-list", "0.33.0", NS_033, NOW + 130), BUCKET + 1, "stale"),
        # another model's namespace (or none of vLLM's) under this model's key
        (NamespaceCard("md5-list", "0.33.0", OTHER_MODEL, NOW), BUCKET, "other_model"),
        (NamespaceCard("md5-list", "0.33.0", "my-shared-namespace", NOW), BUCKET, "other_model"),
        # a rule that is not its key's (this instance's own, or one nobody knows)
        (NamespaceCard("sha256-json", "0.34.0", NS_033, NOW), BUCKET, "rule_mismatch"),
        (NamespaceCard("rule-x", "0.33.0", NS_033, NOW), BUCKET, "rule_mismatch"),
    ],
)
def test_a_card_contradicting_itself_or_its_key_is_ignored(card, bucket, reason, caplog):
    store, clock = FakeMooncakeStore(), Clock()
    c = newcomer(store, clock, caplog)
    store.objects[c.key("md5-list", bucket)] = card.pack()
    assert c.start() == (True, None)
    assert c.key("sha256-json", BUCKET) in store.objects
    assert c.stats[f"ignored_{reason}"] == 1 and c.stats["found"] == 0
    [line] = ignored_logs(caplog)
    assert f"card under {c.key('md5-list', bucket)} is ignored: " in line
    assert "vLLM '0.33.0'" in line or "vLLM '0.34.0'" in line  # what the card says, shown


def test_an_ignored_card_is_read_and_logged_once_not_at_every_look(caplog):
    store, clock = FakeMooncakeStore(), Clock()
    c = newcomer(store, clock, caplog)
    store.objects[c.key("md5-list", BUCKET)] = b"\x00junk"
    c.start()
    for _ in range(5):
        clock.now += 1
        c._due = float("-inf")
        assert c.refresh() == (True, None)
    assert Counter(store.calls)["get"] == 1  # read once; its key is still looked at
    assert len(ignored_logs(caplog)) == 1 and c.stats["ignored_undecodable"] == 1
    assert c.stats["looks"] == 6


@pytest.mark.parametrize(
    "decoy",
    [b"\x00junk", NamespaceCard("md5-list", "0.33.0", NS_034, 1.0).pack()],
)
def test_a_junk_card_does_not_hide_a_real_one_under_another_key(decoy, caplog):
    store, clock = FakeMooncakeStore(), Clock()
    c = newcomer(store, clock, caplog)
    store.objects[c.key("md5-list", BUCKET + 1)] = decoy  # the first key looked at
    real = NamespaceCard("md5-list", "0.33.0", NS_033, NOW - 30)
    store.objects[c.key("md5-list", BUCKET)] = real.pack()
    assert c.start() == (True, real)
    assert c.key("sha256-json", BUCKET) not in store.objects  # refused: no card of its own
    assert len(ignored_logs(caplog)) == 1


@pytest.mark.parametrize(
    ("written", "bucket"),
    [(NOW - 100, BUCKET - 1), (NOW - 30, BUCKET), (NOW, BUCKET), (NOW + 50, BUCKET + 1)],
)
def test_namespace_card_of_the_other_version_still_refuses(written, bucket, caplog):
    store, clock = FakeMooncakeStore(), Clock()
    c = newcomer(store, clock, caplog)
    theirs = NamespaceCard("md5-list", "0.33.0", NS_033, written)
    store.objects[c.key("md5-list", bucket)] = theirs.pack()
    assert c.start() == (True, theirs)
    assert c.stats["found"] == 1 and ignored_logs(caplog) == []
    assert c.key("sha256-json", BUCKET) not in store.objects


class LossyStore(FakeMooncakeStore):
    """A store whose `get` answers b"" (Mooncake's answer to a failed get) `lose` times."""

    def __init__(self, lose: int) -> None:
        super().__init__()
        self.lose = lose

    def get(self, key: str) -> bytes:
        if self.lose:
            self.lose -= 1
            self._call("get")
            return b""
        return super().get(key)


def test_a_card_that_could_not_be_read_is_an_unanswered_look_not_an_ignored_card(caplog):
    store, clock = LossyStore(lose=1), Clock()
    c = newcomer(store, clock, caplog)
    theirs = NamespaceCard("md5-list", "0.33.0", NS_033, NOW)
    store.objects[c.key("md5-list", BUCKET)] = theirs.pack()
    assert c.start() == (False, None)  # not judged by a failed get: no card written either
    assert c.key("sha256-json", BUCKET) not in store.objects
    assert c.stats["unread"] == 1 and ignored_logs(caplog) == []
    assert c.refresh() == (True, theirs)  # read at the next look


def test_a_failing_store_is_an_unanswered_look_never_a_raise():
    store, clock = FakeMooncakeStore(), Clock()
    c = cards(store, clock, NS_034, "sha256-json", "0.34.0")
    store.fail = True
    assert c.start() == (False, None)
    assert store.calls == ["batch_is_exist"] and c.stats["unanswered"] == 1  # and no put
    assert c.refresh() == (False, None)  # backing off: no call at all, and no card written
    assert c.stats["unwritten"] == 1


def test_a_card_costs_one_look_each_half_period_and_one_put_each_period():
    store, clock = FakeMooncakeStore(), Clock()
    c = cards(store, clock, NS_034, "sha256-json", "0.34.0", period=60.0)
    c.start()
    seen = []
    for t in range(0, 600):  # ten minutes of steps, one a second
        clock.now = float(t)
        if c.due():
            c.refresh()
            seen.append(t)
    assert seen == list(range(30, 600, 30))
    counts = Counter(store.calls)
    # 20 looks (one batch_is_exist of 3 keys each), one put per bucket, each followed by the
    # remove of the rule's card 3 buckets before (found or not): at most 3 cards stay
    assert counts == {"batch_is_exist": 20, "put": 10, "remove": 10}
    assert len(store.objects) <= 3

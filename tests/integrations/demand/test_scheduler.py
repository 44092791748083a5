"""DemandScheduler against vLLM's real Scheduler (oracle venvs, 0.33.0 and 0.34.0:
tools/oracle/demand_scheduler_check.py runs both side by side on one multimodal stream with a
small KV pool and encoder cache): identical scheduling, side-effect-free answers that are exact
when nothing runs between answer and admission, sound proofs, and a residency index equal to
vLLM's prefix cache after every step; one admission record per request, however often it is
preempted and resumed."""

from __future__ import annotations

import json

import pytest

from tests.support.oracle import oracle_json, oracle_lines
from tests.support.paths import REPO


@pytest.mark.oracle
@pytest.mark.parametrize("seed, async_", [(0, 0), (5, 0), (0, 1)], ids=["s0", "s5", "async-s0"])
def test_demand_scheduler_against_vllms_scheduler(oracle_python, seed, async_):
    """Under async scheduling DemandScheduler is itself an AsyncScheduler (vLLM's base then)."""
    py = oracle_python
    c = oracle_json(
        py,
        str(REPO / "tools/oracle/demand_scheduler_check.py"),
        str(seed),
        "120",
        str(async_),
        timeout=600,
    )
    assert c["scheduler"] == ("AsyncDemandScheduler" if async_ else "DemandScheduler")
    assert c["output_mismatch"] == 0, c  # behaves exactly as vLLM's scheduler
    assert c["side_effects"] == 0, c  # answering changes nothing in P
    assert c["index_mismatch"] == 0 and c["stats"]["index_mismatches"] == 0, c
    assert c["exact_mismatch"] == 0 and c["exact_checked"] >= 30, c
    assert c["unsound"] == 0, c
    # the stream exercises what the answers are about
    assert c["kv_hits"] >= 20 and c["reused"] >= 20 and c["e_compute"] >= 100, c
    st = c["stats"]
    assert st["admitted"] >= 100 and sum(st["changed"].values()) >= 3, st
    assert st["proof_valid"] + sum(st["changed"].values()) == st["admitted"], st
    assert c["socket_answers"] == 2 and c["socket_errors"] == 1, c
    # admission records: one per request, its first C, the answer's classes, the items P
    # encoded while its first prefill was open
    assert c["records"] == c["admitted_requests"] >= st["admitted"], c
    assert c["duplicate_records"] == 0 and c["record_c_mismatch"] == 0, c
    assert c["record_answer_mismatch"] == 0 and c["record_encoded_mismatch"] == 0, c


@pytest.mark.oracle
@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_a_preempted_request_is_recorded_and_counted_once(oracle_python, runner):
    """Preemptions forced on vLLM's real scheduler (a KV pool too small for the requests
    decoding together, prefill chunked): a request preempted then resumed keeps the one
    admission record of its first admission (its C), which also gets the items encoded for it
    after it resumed while its first prefill was not done; the demand counters count each
    request once. vLLM lists a resumed request with the new ones (0.34; 0.33 on Model Runner
    V2) or with the resumed ones (0.33 on V1): the same records either way."""
    c = oracle_json(
        oracle_python,
        str(REPO / "tools/oracle/demand_scheduler_check.py"),
        "preemption",
        "0",
        runner,
        timeout=600,
    )
    if "skipped" in c:  # Model Runner V1 is gone from 0.34 on
        assert runner == "v1" and c["vllm"] != "0.33.0", c
        pytest.skip(c["skipped"])
    assert c["output_mismatch"] == 0 and c["index_mismatch"] == 0 and c["unfinished"] == 0, c
    # the stream exercises it: many resumptions, some before the first prefill was done, with
    # items encoded for such a request after it resumed
    resumed = c["resumed_as_new"] + c["resumed_as_resumed"]
    assert resumed >= 10 and c["resumed_while_prefilling"] >= 2, c
    assert c["encoded_after_resume"] >= 1, c
    assert c["v2_model_runner"] == (runner == "v2" or c["vllm"] != "0.33.0"), c
    assert c["resumed_as_resumed" if not c["v2_model_runner"] else "resumed_as_new"] == resumed
    # one record per request, as of its first admission
    assert c["records"] == c["admitted_requests"] == c["requests"], c
    assert c["duplicate_records"] == 0 and c["record_c_mismatch"] == 0, c
    assert c["record_encoded_mismatch"] == 0, c
    # every request was answered and sent with its demand id: each counted once
    st = c["stats"]
    assert st["admitted"] == c["requests"], c
    assert st["proof_valid"] + sum((st["changed"] or {}).values()) == st["admitted"], c


@pytest.mark.oracle
def test_rule_s_is_what_vllms_scheduler_does(oracle_python):
    """A request's own allocation evicts the freeable entry its later item would reuse: vLLM
    encodes that item again, and compute_demand says so with the cache's space (rule S)."""
    py = oracle_python
    lines = oracle_lines(py, str(REPO / "tools/oracle/self_eviction_check.py"))
    cases = {c["case"]: c for c in map(json.loads, lines[-2:])}
    evicted, kept = cases["X then C"], cases["X then D"]
    for c in (evicted, kept):
        assert c["cache_before"] == {"freeable": ["C", "D"], "free": 0}, c
        assert c["rule_s"]["needs_encoder"] == c["vllm_encoded"], c  # exact, both ways
    assert evicted["vllm_encoded"] == [0, 1] and evicted["rule_s"]["self_evicted"] == ["C", "D"]
    assert evicted["without_rule_s"]["needs_encoder"] == [0]  # what the rule corrects
    assert kept["vllm_encoded"] == [0] and kept["rule_s"]["classes"] == ["e_compute", "p_local"]


_HYBRID_CHECK = """
import json, types
from mmreuse.integrations.demand.index_feed import IndexFeed
ns = lambda **kw: types.SimpleNamespace(**kw)
out = {}
for groups in (1, 2):
    pool = ns(num_gpu_blocks=8, _insert_block_hash=None, _remove_cached_block_hashes=None,
              reset_prefix_cache=None)
    stand_in = ns(
        kv_cache_manager=ns(enable_caching=True, block_pool=pool),
        kv_cache_config=ns(kv_cache_groups=[object()] * groups),
        block_size=16,
    )
    feed = IndexFeed(stand_in)
    out[groups] = [feed.index is not None, feed.note]
print(json.dumps(out))
"""


@pytest.mark.oracle
def test_a_hybrid_attention_p_turns_its_index_off(oracle_python):
    """DemandScheduler's residency index follows one KV cache group: with two (hybrid
    attention) it would prove coverage another group evicted, so it is off, saying why."""
    got = oracle_json(oracle_python, "-c", _HYBRID_CHECK, timeout=300)
    assert got["1"][0] is True
    assert (
        got["2"] == [False, got["2"][1]] and "2 KV cache groups (hybrid attention)" in got["2"][1]
    )


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 5])
def test_a_snapshot_and_the_events_after_its_stamp_are_the_whole_stream(oracle_python, seed):
    """DemandScheduler's KV snapshot, taken after update_from_output and between schedule and
    update_from_output (the pool's events for the next batch undone), bootstraps a view that
    equals the view of every batch vLLM published from 0, at every later step."""
    c = oracle_json(
        oracle_python, str(REPO / "tools/oracle/snapshot_check.py"), str(seed), "120", timeout=600
    )
    assert c["mismatch"] == 0 and c["stamp_mismatch"] == 0, c
    # the stream exercises it: many snapshots, some with events pending, over several chunks
    assert c["snapshots"] >= 50 and c["pending_at_snapshot"] >= 2 and c["chunked"] >= 20, c
    assert c["batches"] >= 20 and c["max_blocks"] >= 20, c
    assert "publishes no KV events" in c["no_events_error"], c
    # the encoder cache's snapshot (EventfulEncoderCacheManager in the scheduler), 2 a chunk,
    # through P's demand endpoint and the manager's own (E's), alternately
    assert c["ec_mismatch"] == 0 and c["ec_snapshots"] >= 50 and c["ec_entries_max"] >= 3, c
    assert "publishes no events" in c["no_ec_events_error"], c
    assert "ECSnapshotQuery only" in c["ec_endpoint_kv_error"], c
    # taking one holds the engine's lock: an unchanged P shares its last, a changed one waits
    assert c["unchanged_shared"] and c["changed"] and c["changed_limited"], c
    # the encoder cache's too, through either endpoint (E's, P's demand endpoint)
    assert c["ec_unchanged_shared"] and c["ec_changed_limited"], c


_IDENTIFIERS_CHECK = """
import json, random, sys
sys.path.insert(0, sys.argv[1])
import msgspec
import demand_scheduler_check as dsc
from vllm.config import KVEventsConfig
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from mmreuse.demand_query import KVSnapshot, SnapshotQuery, decode_answer, encode
from mmreuse.errors import InvalidArgumentType
from mmreuse.events import RemoteKVIndex
from mmreuse.events.identifiers import chunk_identifiers
from mmreuse.events.wire import decode_batch
from mmreuse.integrations import snapshots
from mmreuse.integrations.vllm import DemandScheduler

flag = {"value": True}
plain = dsc.VllmConfig
def with_flag(**kw):  # make_scheduler's config, with "snapshot_identifiers"
    ours = dict(kw["additional_config"]["mmreuse"])
    if flag["value"] is not None:
        ours["snapshot_identifiers"] = flag["value"]
    kw["additional_config"] = {"mmreuse": ours}
    return plain(**kw)
dsc.VllmConfig = with_flag

def scheduler():
    return dsc.make_scheduler(DemandScheduler, dsc.tiny_model_dir(), num_blocks=40,
        cache_size=96, kv_events=KVEventsConfig(enable_kv_cache_events=True, publisher="null"))

def snapshot(sched, sid):
    chunks, offset = [], 0
    while True:
        chunk = decode_answer(sched._answers.handle(encode(SnapshotQuery(sid, offset))))
        assert isinstance(chunk, KVSnapshot), chunk
        chunks.append(chunk)
        offset += len(chunk.block_ids)
        if offset >= chunk.total:
            return chunks

seed = int(sys.argv[2])
rng = random.Random(seed)
snapshots.SNAPSHOT_MIN_INTERVAL_S = 0.0
init_none_hash(sha256)
hasher = get_request_block_hasher(dsc.BLOCK, sha256)
sched = scheduler()
sched._kv_snapshots.chunk = 7
batches = []
counted = sched.kv_event_publisher.publish
def record(batch):
    batches.append(msgspec.msgpack.encode(batch))
    counted(batch)
sched.kv_event_publisher.publish = record
full = RemoteKVIndex("full", track_identifiers=True)
views = []  # (stamp, bootstrapped view)
c = {"snapshots": 0, "followed": 0, "with_identifiers": 0, "max_identifiers": 0,
     "mismatch": 0, "p_mismatch": 0, "chunked": 0}
applied = 0

def take(where):
    chunks = snapshot(sched, f"s{len(views)}-{where}")
    first = chunks[0]
    ids = [i for ch in chunks for i in ch.block_ids]
    counts = [n for ch in chunks for n in ch.counts]
    c["snapshots"] += 1
    c["chunked"] += len(chunks) > 1
    c["followed"] += all(ch.identifiers_followed for ch in chunks)
    merged = {}
    for ch in chunks:
        merged.update(chunk_identifiers(ch))
    c["with_identifiers"] += bool(merged)
    c["max_identifiers"] = max(c["max_identifiers"], len({x for v in merged.values() for x in v}))
    view = RemoteKVIndex("boot", track_identifiers=True)
    view.load(ids, counts, identifiers=merged if first.identifiers_followed else None)
    views.append((first.stamp, view))

def catch_up():
    global applied
    for seq in range(applied, len(batches)):
        batch = decode_batch(batches[seq])
        full.apply(batch)
        for stamp, view in views:
            if seq >= stamp:
                view.apply(batch)
    applied = len(batches)
    want = (full.counts(), full.identifiers(), full.identifiers_known())
    c["mismatch"] += sum(
        (v.counts(), v.identifiers(), v.identifiers_known()) != want for _, v in views)
    c["p_mismatch"] += sched._kv_snapshots.identifiers.carriers() != full.carriers()

stream = dsc.Stream(rng)
rid = 0
for _turn in range(int(sys.argv[3])):
    for _ in range(rng.choice([1, 1, 2, 3])):
        tokens, items = stream.next()
        sched.add_request(dsc.request(f"r{rid}", tokens, items, hasher))
        rid += 1
    for _ in range(4):
        out = sched.schedule()
        if rng.random() < 0.15:
            take("mid")
        sched.update_from_output(out, dsc.runner_output(out))
        if rng.random() < 0.15:
            take("after")
        catch_up()
c["batches"] = len(batches)
c["full_known"] = full.identifiers_known()
c["full_identifiers"] = len(full.identifiers())
# without the setting (the default) a snapshot says it followed none; a setting that is not
# a JSON boolean stops P at start-up
flag["value"] = None
quiet = scheduler()
c["default_followed"] = decode_answer(quiet._answers.handle(encode(SnapshotQuery("q")))).identifiers_followed
flag["value"] = "yes"
try:
    scheduler()
    c["non_bool"] = "started"
except InvalidArgumentType as e:
    c["non_bool"] = str(e)
print(json.dumps(c))
"""


@pytest.mark.oracle
@pytest.mark.parametrize("seed", [0, 3])
def test_a_snapshot_carries_the_identifiers_of_every_event_from_0(oracle_python, seed):
    """With `snapshot_identifiers`, DemandScheduler's KV snapshot (taken after
    update_from_output, and between schedule and update_from_output: events pending) carries
    the identifiers its blocks carry, as of its stamp: a view loaded from it, then every batch
    from its stamp on, has the identifiers (and counts) of the view of every batch vLLM
    published from 0, at every later step; P's own follower equals that view after each step."""
    c = oracle_json(
        oracle_python,
        "-c",
        _IDENTIFIERS_CHECK,
        str(REPO / "tools/oracle"),
        str(seed),
        "100",
        timeout=600,
    )
    assert c["mismatch"] == 0 and c["p_mismatch"] == 0, c
    assert c["followed"] == c["snapshots"] >= 40 and c["chunked"] >= 10, c
    # the stream exercises it: vLLM publishes its mm keys, snapshots name several images
    assert c["full_known"] and c["with_identifiers"] >= 20 and c["max_identifiers"] >= 3, c
    assert c["default_followed"] is False, c
    assert "snapshot_identifiers" in c["non_bool"] and "true or false" in c["non_bool"], c

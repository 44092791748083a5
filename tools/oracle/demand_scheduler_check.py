"""Run in a vLLM oracle venv (0.33.0, 0.34.0; PYTHONPATH = the mmreuse checkout):
`DemandScheduler` against vLLM's real `Scheduler`, side by side, on the same multi-turn
multimodal stream (real `Request`s, a small KV pool and encoder cache so that evictions happen).

    python tools/oracle/demand_scheduler_check.py [SEED TURNS ASYNC]
    python tools/oracle/demand_scheduler_check.py preemption [SEED [v1|v2|default]]

Checked, and printed as one JSON line of counts:
- behaviour: both schedulers produce the same SchedulerOutput every step (requests, tokens,
  encoder inputs, freed encoder entries);
- answers are side-effect free: P's block pool (free-queue order, ref counts, cached map),
  prefix-cache stats and encoder cache are identical before and after every answer;
- answers are exact: for each request answered just before it is added, P's C at admission and
  the items P encodes itself equal the answer's;
- proofs are sound: an admitted request whose proof still held got the answer's C;
- the residency index equals vLLM's prefix cache after every step (`check_index`);
- admission records: one per request, as `Truth` says;
- the answer thread: queries over the real ROUTER socket, malformed ones get DemandErrors.
`preemption` forces preemptions instead (see `preemption`): one record per request however
often it is preempted and resumed, and demand counters that count each request once.

Where the two vLLMs differ, the check reads what this one has: `ModelRunnerOutput`'s fields
(0.34 dropped `req_id_to_index`), the prefix-cache map through its public `contain` (0.34
holds block ids), where a resumed request is listed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import socket
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import torch
import vllm
import zmq
from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItem, PlaceholderRange
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.structured_output import StructuredOutputManager

from mmreuse.demand_query import (
    DemandAnswer,
    DemandError,
    DemandQuery,
    QueryItem,
    RecordsQuery,
    StatsQuery,
    decode_answer,
    encode,
)
from mmreuse.integrations.control import ControlServer
from mmreuse.integrations.vllm import DemandScheduler

BLOCK = 16
DEBUG = False
PAD = 999  # the image placeholder token


def tiny_model_dir() -> str:
    d = Path(tempfile.mkdtemp(prefix="mmreuse-demand-model-"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1024,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 4096,
        "torch_dtype": "float32", "rms_norm_eps": 1e-6,
    }))  # fmt: skip
    return str(d)


def make_scheduler(
    cls,
    model: str,
    num_blocks: int,
    cache_size: int,
    async_: bool = False,
    kv_events=None,
    max_batched: int = 2048,
):
    model_config = ModelConfig(
        model=model, dtype="float16", seed=42, skip_tokenizer_init=True, max_model_len=2048
    )
    sched = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=max_batched, max_model_len=2048,
        enable_chunked_prefill=True, async_scheduling=async_, is_encoder_decoder=False,
        watermark=0.0,
    )  # fmt: skip
    cache = CacheConfig(block_size=BLOCK, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)  # fmt: skip
    vllm_config = VllmConfig(scheduler_config=sched, model_config=model_config, cache_config=cache,
                             additional_config={"mmreuse": {"admission_records": True}},
                             kv_events_config=kv_events,
                             device_config=DeviceConfig(device="cpu"))  # fmt: skip
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])  # fmt: skip
    cache.num_gpu_blocks = num_blocks
    s = cls(vllm_config=vllm_config, kv_cache_config=kv, block_size=BLOCK, log_stats=True,
            structured_output_manager=StructuredOutputManager(vllm_config))  # fmt: skip
    s.encoder_cache_manager = EncoderCacheManager(cache_size=cache_size)
    s.max_num_encoder_input_tokens = 2048
    return s


def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return sk.getsockname()[1]


class Stream:
    """Multi-turn conversations over a pool of images; each turn resends the history."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.images = {f"img-{i}": rng.choice([16, 24, 40]) for i in range(10)}
        self.convs: list[tuple[list[int], list[tuple[str, int, int]]]] = []

    def next(self) -> tuple[list[int], list[tuple[str, int, int]]]:
        rng = self.rng
        if not self.convs or rng.random() < 0.3:
            self.convs.append(([1, 2, 3] + [rng.randrange(4, 900) for _ in range(20)], []))
        k = rng.randrange(len(self.convs))
        tokens, items = self.convs[k]
        tokens, items = list(tokens), list(items)
        for _ in range(rng.choice([0, 1, 1, 2])):
            ident = rng.choice(list(self.images))
            n = self.images[ident]
            items.append((ident, len(tokens), n))
            tokens += [PAD] * n
        tokens += [rng.randrange(4, 900) for _ in range(rng.randrange(5, 30))]
        self.convs[k] = (tokens, items)
        return tokens, items


def request(rid: str, tokens, items, hasher, demand_id: str | None = None, max_tokens: int = 2):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                            extra_args={"mmreuse_demand_id": demand_id} if demand_id else None)  # fmt: skip
    # Each identifier a str object of its own, as a request decoded from the front end has
    # (vLLM's pickle-based hash memoizes one object named twice: another hash).
    feats = [
        MultiModalFeatureSpec(
            data=MultiModalKwargsItem.dummy(),
            modality="image",
            identifier=ident.encode().decode(),
            mm_position=PlaceholderRange(off, n),
        )
        for ident, off, n in items
    ]
    from vllm.v1.request import Request

    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=params,
                   pooling_params=None, mm_features=feats or None, block_hasher=hasher)  # fmt: skip


def query(qid: str, tokens, items) -> DemandQuery:
    return DemandQuery(qid, list(tokens), [QueryItem(i, o, n) for i, o, n in items])


def pool_state(s) -> tuple:
    pool = s.kv_cache_manager.block_pool
    q, order = pool.free_block_queue, []
    node = q.fake_free_list_head.next_free_block
    while node is not None and node is not q.fake_free_list_tail:
        order.append(node.block_id)
        node = node.next_free_block
    cached = cached_entries(pool)
    stats = s.kv_cache_manager.prefix_cache_stats
    ecm = s.encoder_cache_manager
    return (
        order, [b.ref_cnt for b in pool.blocks], [b.block_hash for b in pool.blocks], cached,
        (stats.requests, stats.queries, stats.hits) if stats else None,
        {k: sorted(v) for k, v in ecm.cached.items()}, list(ecm.freeable.items()),
        ecm.num_free_slots, ecm.num_freeable_slots, list(ecm.freed), len(pool.kv_event_queue),
    )  # fmt: skip


def cached_entries(pool) -> list[tuple[bytes, int]]:
    """The prefix cache's (key, block id) entries, through the map's public `contain` (its
    storage differs: blocks in 0.33, block ids and a duplicates map in 0.34): each block's
    own hash and the extra keys the pool notes for it, where the map holds that block under
    them; and the map's size, so that an entry no block names still shows."""
    m = pool.cached_block_hash_to_block
    extra = getattr(pool, "cached_block_hashes_by_block", {})
    found = []
    for b in pool.blocks:
        keys = ([] if b.block_hash is None else [b.block_hash]) + sorted(extra.get(b.block_id, ()))
        found += [(bytes(k), b.block_id) for k in keys if m.contain(k, b.block_id)]
    return [*sorted(found), (b"len", len(m))]


def output_key(out) -> tuple:
    return (
        [(r.req_id, r.num_computed_tokens) for r in out.scheduled_new_reqs],
        sorted(out.num_scheduled_tokens.items()),
        sorted((k, sorted(v)) for k, v in out.scheduled_encoder_inputs.items()),
        sorted(out.free_encoder_mm_hashes),
        out.total_num_scheduled_tokens,
    )


# ModelRunnerOutput's fields: vLLM 0.34 dropped `req_id_to_index` (update_from_output indexes
# req_ids itself); 0.33 requires it
_RUNNER_FIELDS = {f.name for f in dataclasses.fields(ModelRunnerOutput)}


def runner_output(out) -> ModelRunnerOutput:
    ids = list(out.num_scheduled_tokens)
    extra = {}
    if "req_id_to_index" in _RUNNER_FIELDS:
        extra["req_id_to_index"] = {r: i for i, r in enumerate(ids)}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=[], **extra)  # fmt: skip


class Truth:
    """What vLLM's scheduler did, step by step, that P's admission records must say: per
    request the C of its first admission and the items encoded for it while that first
    prefill was open (a record's `encoded`: a request preempted then resumed keeps its one
    record, which gets what is encoded for it until its prompt is computed once), and its
    resumptions (listed with the new requests by 0.34 and 0.33 on Model Runner V2, with the
    resumed ones by 0.33 on V1)."""

    def __init__(self, sched) -> None:
        self.sched = sched  # vLLM's own scheduler, driven like P's
        self.admitted: dict[str, int] = {}  # request -> C when first scheduled
        self.encoded: dict[str, set[int]] = {}  # request -> items encoded, over all steps
        self.first_prefill: dict[str, set[int]] = {}  # ... while its first prefill was open
        self.prefilled: set[str] = set()  # requests whose first prefill is done
        self.resumed_as_new = self.resumed_as_resumed = 0
        self.resumed_while_prefilling = 0  # resumptions before the first prefill was done
        self.encoded_after_resume = 0  # items encoded for those once resumed
        self._open_resumed: set[str] = set()  # resumed before their first prefill was done

    def saw(self, out) -> None:
        """One step's SchedulerOutput (after schedule, before update_from_output)."""
        resumed: set[str] = set(getattr(out.scheduled_cached_reqs, "resumed_req_ids", ()))
        self.resumed_as_resumed += len(resumed)
        for r in out.scheduled_new_reqs:
            if r.req_id in self.admitted:
                self.resumed_as_new += 1
                resumed.add(r.req_id)
            self.admitted.setdefault(r.req_id, r.num_computed_tokens)
        self.resumed_while_prefilling += len(resumed - self.prefilled)
        self._open_resumed |= resumed - self.prefilled
        for r, inputs in out.scheduled_encoder_inputs.items():
            self.encoded.setdefault(r, set()).update(inputs)
            if r not in self.prefilled:
                self.first_prefill.setdefault(r, set()).update(inputs)
                self.encoded_after_resume += len(inputs) if r in self._open_resumed else 0
        for r in self.admitted:  # the prompt scheduled whole once: the record closes
            req = self.sched.requests.get(r)
            if req is None or req.num_computed_tokens >= req.num_prompt_tokens:
                self.prefilled.add(r)

    def check_records(self, records, c: dict) -> None:
        """P's records against it: one per admitted request, its first C, its items."""
        by_name = {r.request_id: r for r in records}
        c["records"] = len(records)
        c["admitted_requests"] = len(self.admitted)
        c["duplicate_records"] = len(records) - len(by_name)
        c["record_c_mismatch"] = sum(
            1
            for n, a in self.admitted.items()
            if n not in by_name or by_name[n].num_computed_tokens != a
        )
        c["record_encoded_mismatch"] = sum(
            1 for n, r in by_name.items() if set(r.encoded) != self.first_prefill.get(n, set())
        )
        c["resumed_as_new"] = self.resumed_as_new
        c["resumed_as_resumed"] = self.resumed_as_resumed
        c["resumed_while_prefilling"] = self.resumed_while_prefilling
        c["encoded_after_resume"] = self.encoded_after_resume


def lockstep(ours, ref, truth, c: dict) -> None:
    """One engine step of DemandScheduler (`ours`) and vLLM's scheduler (`ref`) side by side:
    their outputs compared, `truth` fed vLLM's, the index checked against P's prefix cache."""
    a, b = ours.schedule(), ref.schedule()
    c["output_mismatch"] += output_key(a) != output_key(b)
    truth.saw(b)
    ours.update_from_output(a, runner_output(a))
    ref.update_from_output(b, runner_output(b))
    c["steps"] += 1
    st = msgspec.msgpack.decode(ours._answers.handle(encode(StatsQuery("s", check_index=True))))
    c["index_mismatch"] += st["index_mismatches"]


def main(seed: int = 0, turns: int = 160, async_: int = 0) -> dict:
    rng = random.Random(seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    model = tiny_model_dir()
    ref_cls = AsyncScheduler if async_ else Scheduler
    ours = make_scheduler(DemandScheduler, model, num_blocks=40, cache_size=96, async_=bool(async_))
    ref = make_scheduler(ref_cls, model, num_blocks=40, cache_size=96, async_=bool(async_))
    stream = Stream(rng)
    c = {"steps": 0, "answers": 0, "exact_checked": 0, "exact_mismatch": 0, "side_effects": 0,
         "output_mismatch": 0, "index_mismatch": 0, "unsound": 0, "kv_hits": 0, "reused": 0,
         "e_compute": 0, "socket_answers": 0, "socket_errors": 0}  # fmt: skip
    c["scheduler"] = type(ours).__name__
    c["vllm"] = vllm.__version__
    rid = 0
    truth = Truth(ref)
    admitted, encoded = truth.admitted, truth.encoded
    checked: list[tuple[str, DemandAnswer]] = []  # answered while P was idle, added first

    def step() -> None:
        lockstep(ours, ref, truth, c)

    for turn in range(turns):
        batch = [stream.next() for _ in range(rng.choice([1, 1, 2, 3]))]
        idle = not ours.has_requests()
        answers = []
        for tokens, items in batch:
            qid = f"q{turn}-{len(answers)}"
            before = pool_state(ours)
            raw = ours._answers.handle(encode(query(qid, tokens, items)))
            if pool_state(ours) != before:
                c["side_effects"] += 1
            ans = decode_answer(raw, query(qid, tokens, items))
            assert isinstance(ans, DemandAnswer), ans
            c["answers"] += 1
            c["kv_hits"] += ans.num_computed_tokens > 0
            c["reused"] += len(ans.p_local_reuse)
            c["e_compute"] += sum(1 for x in ans.items if x.item_class == "e_compute")
            answers.append((qid, ans))
        for k, ((tokens, items), (qid, ans)) in enumerate(zip(batch, answers, strict=True)):
            name = f"r{rid}"
            rid += 1
            ours.add_request(request(name, tokens, items, hasher, qid))
            ref.add_request(request(name, tokens, items, hasher))
            if idle and k == 0:  # nothing can change P between its answer and its admission
                checked.append((name, ans))
        for _ in range(4):
            step()
    for _ in range(50):  # drain (a prompt longer than the whole KV pool waits for ever)
        if not ours.has_requests():
            break
        step()
    for name, ans in checked:
        if ans.encoder_cache_short:  # spread over steps: the answer holds for the first only
            c["exact_skipped_short"] = c.get("exact_skipped_short", 0) + 1
            continue
        expect = {i for i, x in enumerate(ans.items) if x.item_class.needs_e}
        c["exact_checked"] += 1
        if admitted.get(name) != ans.num_computed_tokens or encoded.get(name, set()) != expect:
            c["exact_mismatch"] += 1
            if DEBUG:
                print("MISMATCH", name, admitted.get(name), ans.num_computed_tokens,
                      encoded.get(name), expect, ans.items, file=sys.stderr)  # fmt: skip
    # admission records: one per admitted request, with the C it was first admitted with;
    # for the requests answered while P was idle, the classes the answer gave
    recs = decode_answer(ours._answers.handle(encode(RecordsQuery("r", 0, 65536))))
    truth.check_records(recs.records, c)
    by_name = {r.request_id: r for r in recs.records}
    c["record_answer_mismatch"] = sum(
        1
        for n, ans in checked
        if not ans.encoder_cache_short
        and [x.item_class for x in by_name[n].items] != [x.item_class for x in ans.items]
    )
    st = msgspec.msgpack.decode(ours._answers.handle(encode(StatsQuery("s", check_index=True))))
    c["stats"] = st
    # soundness, counted at admission inside the scheduler: a proof that held, another C
    c["unsound"] = st.get("valid_hit_shorter", 0)

    # the answer thread, over the real socket
    port = free_port()
    server = ControlServer(f"tcp://127.0.0.1:{port}", ours._answers.handle)
    server.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    tokens, items = stream.next()
    frames = [encode(query("sock-1", tokens, items)), b"\x00garbage", encode(StatsQuery("sock-2"))]
    for f in frames:
        dealer.send(f)
    poller = zmq.Poller()
    poller.register(dealer, zmq.POLLIN)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and c["socket_answers"] + c["socket_errors"] < 3:
        if poller.poll(200):
            msg = decode_answer(dealer.recv())
            c["socket_errors" if isinstance(msg, DemandError) else "socket_answers"] += 1
    server.stop()
    dealer.close(0)
    return c


def preemption(seed: int = 0, requests: int = 40, runner: str = "default") -> dict:
    """Preemptions forced on vLLM's real scheduler: a KV pool (14 blocks) too small for the
    requests running together as they decode, prefill chunked (48 tokens a step) and a small
    encoder cache, so that requests are preempted while decoding and while prefilling, and
    resume. DemandScheduler, side by side with vLLM's Scheduler: the same outputs, one
    admission record per request (its first admission's C, the items encoded while its
    first prefill was open, a resumption before that included), and its demand counters
    (each request answered first) count each request once. `runner`: "v1" / "v2" set
    VLLM_USE_V2_MODEL_RUNNER (0.33 lists a resumed request with the resumed ones on V1, with
    the new ones on V2; 0.34 has V2 only)."""
    if not hasattr(VllmConfig, "use_v2_model_runner"):  # 0.34 on: Model Runner V2 only
        if runner == "v1":
            return {"vllm": vllm.__version__, "skipped": "this vLLM has no Model Runner V1"}
    elif runner != "default":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    rng = random.Random(seed)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    model = tiny_model_dir()
    kw = {"num_blocks": 14, "cache_size": 48, "max_batched": 24}
    ours, ref = make_scheduler(DemandScheduler, model, **kw), make_scheduler(Scheduler, model, **kw)
    images = {f"img-{i}": rng.choice([8, 16, 24]) for i in range(8)}
    c = {"vllm": vllm.__version__, "v2_model_runner": getattr(ref, "use_v2_model_runner", True),
         "steps": 0, "output_mismatch": 0, "index_mismatch": 0, "requests": 0}  # fmt: skip
    truth = Truth(ref)

    def step() -> None:
        lockstep(ours, ref, truth, c)

    for k in range(requests):
        tokens = [1, 2, 3 + k % 7] + [rng.randrange(4, 900) for _ in range(rng.randrange(4, 20))]
        items = []
        for _ in range(rng.choice([1, 2, 2])):
            ident = rng.choice(sorted(images))
            items.append((ident, len(tokens), images[ident]))
            tokens += [PAD] * images[ident] + [rng.randrange(4, 900) for _ in range(4)]
        name, qid = f"r{k}", f"q{k}"
        answer = decode_answer(ours._answers.handle(encode(query(qid, tokens, items))))
        assert isinstance(answer, DemandAnswer), answer
        max_tokens = rng.randrange(8, 40)
        ours.add_request(request(name, tokens, items, hasher, qid, max_tokens))
        ref.add_request(request(name, tokens, items, hasher, None, max_tokens))
        c["requests"] += 1
        for _ in range(rng.choice([1, 2, 3])):
            step()
    for _ in range(400):  # drain
        if not ours.has_requests():
            break
        step()
    c["unfinished"] = ours.get_num_unfinished_requests()
    recs = decode_answer(ours._answers.handle(encode(RecordsQuery("r", 0, 65536))))
    truth.check_records(recs.records, c)
    st = msgspec.msgpack.decode(ours._answers.handle(encode(StatsQuery("s"))))
    c["stats"] = {k: st.get(k) for k in ("admitted", "proof_valid", "changed")}
    return c


if __name__ == "__main__":
    if sys.argv[1:2] == ["preemption"]:  # preemption SEED RUNNER
        seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
        print(json.dumps(preemption(seed, runner=sys.argv[3] if len(sys.argv) > 3 else "default")))
    else:
        print(json.dumps(main(*[int(a) for a in sys.argv[1:]])))

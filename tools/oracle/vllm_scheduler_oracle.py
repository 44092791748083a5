"""Ask vLLM's real scheduler (0.33.0, 0.34.0) what it does with a request's encoder inputs.

Runs inside the oracle venv (vLLM installed), as a JSON-lines server:

    $ORACLE_PYTHON tools/oracle/vllm_scheduler_oracle.py < cases.jsonl

Per case it builds a real `Request` (through EngineCoreRequest and the msgpack wire, as
tools/oracle/hash_oracle.py does) with the case's `mm_features`, a real `EncoderCacheManager`
that holds the case's P-local identifiers (referenced, or freed to freeable), and an EC
connector stub whose `has_cache_item` answers from a set. It then calls vLLM's own
`Scheduler._try_schedule_encoder_inputs` over the whole remaining prompt [C, N) with an ample
budget, on a small stand-in for the scheduler (the method only reads scheduler_config,
encoder_cache_manager, ec_connector, is_encoder_decoder and the mismatch hook).

Case: {"occurrences": [{"identifier", "offset", "length", "is_embed"}], "num_prompt_tokens",
"num_computed_tokens", "p_local": {id: n}, "p_local_freeable": [id], "p_external": [id],
"is_encoder_decoder": bool}
Result: {"encode": [i], "load": [i], "duplicate": [i], "cache_hit": [i], "rejected": bool,
"embeds_in_window": [k per occurrence, vLLM's get_embeds_indices_in_range over the window]}
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import hash_oracle  # the project's vLLM oracle: imports vLLM, builds its requests

    V = hash_oracle.vllm_api()
    torch = V.torch
    from vllm.multimodal.utils import get_mm_features_in_window
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager, EncoderDecoderCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def feature(o):
        mask = o.get("is_embed")
        return V.MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=o["identifier"],
            mm_position=V.PlaceholderRange(
                offset=o["offset"],
                length=o["length"],
                is_embed=None if mask is None else torch.tensor(mask, dtype=torch.bool),
            ),
            mm_hash=None,
        )

    def request(req_id, n, feats):
        ecr = V.EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=hash_oracle.wire_tokens([0] * n),  # 0.34: int32 array
            mm_features=feats or None,
            sampling_params=V.SamplingParams(max_tokens=16),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        return V.Request.from_engine_core_request(V.wire(ecr), block_hasher=None)

    for line in sys.stdin:
        if not line.strip():
            continue
        case = json.loads(line)
        n, c = case["num_prompt_tokens"], case["num_computed_tokens"]
        encdec = case.get("is_encoder_decoder", False)
        req = request("r", n, [feature(o) for o in case["occurrences"]])
        cache_size = 10**9
        mgr = EncoderDecoderCacheManager(cache_size) if encdec else EncoderCacheManager(cache_size)
        if not encdec:
            for k, (ident, num) in enumerate(sorted(case["p_local"].items())):
                holder = request(
                    f"holder-{k}", num, [feature({"identifier": ident, "offset": 0, "length": num})]
                )
                mgr.allocate(holder, 0)
                if ident in case["p_local_freeable"]:
                    mgr.free_encoder_input(holder, 0)
        hits: list[int] = []
        check = mgr.check_and_update_cache

        def spy(r, i, _check=check, _hits=hits):
            ok = _check(r, i)
            if ok:
                _hits.append(i)
            return ok

        mgr.check_and_update_cache = spy
        external = set(case["p_external"])
        stand_in = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(disable_chunked_mm_input=False),
            encoder_cache_manager=mgr,
            ec_connector=None
            if encdec
            else types.SimpleNamespace(
                has_cache_item=lambda ident, _external=external: ident in _external
            ),
            is_encoder_decoder=encdec,
            encoder_cache_mismatch_reqs=set(),
        )
        stand_in._reject_on_encoder_cache_embed_mismatch = types.MethodType(
            Scheduler._reject_on_encoder_cache_embed_mismatch, stand_in
        )
        out = {
            "encode": [],
            "load": [],
            "duplicate": [],
            "cache_hit": [],
            "rejected": False,
            "embeds_in_window": [],
        }
        if req.mm_features:
            encode, _, _, load, dup = Scheduler._try_schedule_encoder_inputs(
                stand_in, req, c, n - c, 10**9, shift_computed_tokens=0
            )
            out.update(
                encode=encode,
                load=load,
                duplicate=dup,
                cache_hit=hits,
                rejected=bool(stand_in.encoder_cache_mismatch_reqs),
            )
            lo, hi = get_mm_features_in_window(req.mm_features, start=c, end=n)
            for i, f in enumerate(req.mm_features):
                k = 0
                if lo <= i < hi and f.mm_position.offset + f.mm_position.length > c:
                    pos = f.mm_position
                    s, e = pos.get_embeds_indices_in_range(
                        max(0, c - pos.offset), min(pos.length, n - pos.offset)
                    )
                    k = e - s
                out["embeds_in_window"].append(k)
        sys.stdout.write(json.dumps(out) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())

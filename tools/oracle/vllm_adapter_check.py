"""Run mmreuse.integrations.vllm on real vLLM objects (inside an oracle venv: 0.33.0, 0.34.0).

PYTHONPATH=<repo> $ORACLE_PYTHON tools/oracle/vllm_adapter_check.py   -> one JSON object
"""

import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import hash_oracle

    from mmreuse.integrations.vllm import availability_from_engine, demand_for_request

    V = hash_oracle.vllm_api()
    torch = V.torch
    from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

    def feature(ident, offset, length, mask=None):
        return V.MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=ident,
            mm_position=V.PlaceholderRange(
                offset=offset,
                length=length,
                is_embed=None if mask is None else torch.tensor(mask, dtype=torch.bool),
            ),
            mm_hash=None,
        )

    def request(req_id, n, feats):
        ecr = V.EngineCoreRequest(
            request_id=req_id,
            prompt_token_ids=hash_oracle.wire_tokens([0] * n),  # 0.34: int32 array
            mm_features=feats,
            sampling_params=V.SamplingParams(max_tokens=16),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        return V.Request.from_engine_core_request(V.decoder.decode(V.encoder.encode(ecr)), None)

    mgr = EncoderCacheManager(10_000)
    held = request("held", 20, [feature("B", 0, 10), feature("F", 10, 6)])
    mgr.allocate(held, 0)
    mgr.allocate(held, 1)
    mgr.free_encoder_input(held, 1)  # F: unreferenced, freeable
    connector = types.SimpleNamespace(has_cache_item=lambda ident: ident == "C")
    req = request(
        "r",
        120,
        [
            feature("A", 0, 16),
            feature("B", 50, 10),
            feature("C", 70, 10),
            feature("F", 80, 6),
            feature("E", 99, 11, [True] * 5 + [False] * 6),
        ],
    )
    res = demand_for_request(req, 48, encoder_cache_manager=mgr, ec_connector=connector)
    avail = availability_from_engine(mgr, connector, ["A", "C"])
    print(
        json.dumps(
            {
                "classes": [d.klass.name for d in res.decisions],
                "num_embeds": [d.num_embeds for d in res.decisions],
                "evictable": [d.evictable for d in res.decisions],
                "e_demand": res.e_demand,
                "p_loads": res.p_loads,
                "p_local_reuse": res.p_local_reuse,
                "p_local": avail.p_local,
                "freeable": sorted(avail.p_local_freeable),
                "p_external": sorted(avail.p_external),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

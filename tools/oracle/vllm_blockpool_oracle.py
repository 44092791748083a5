"""Drive vLLM's real BlockPool (0.33.0, 0.34.0; prefix cache with KV events on), record what it says.

Runs inside the oracle venv:  $ORACLE_PYTHON tools/oracle/vllm_blockpool_oracle.py SEED
Prints JSON steps, in order: {"batch": base64 msgpack KVEventBatch} for the events the pool
emitted, and {"tokens": [...], "expected": k} where k is how many leading blocks of that
prompt vLLM's own prefix cache (BlockPool.get_cached_block) hits at that moment.
Requests share prefixes, finish at random (their blocks become evictable), new ones evict
the least recently used; sometimes the whole cache is reset (AllBlocksCleared).
"""

import base64
import json
import os
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    seed = int(sys.argv[1])
    import hash_oracle  # the project's vLLM oracle: imports vLLM
    import msgspec

    V = hash_oracle.vllm_api()
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.block_pool import BlockPool

    os.environ["PYTHONHASHSEED"] = "0"
    fn = V.hashing.get_hash_fn_by_name("sha256")
    V.kcu.init_none_hash(fn)
    hasher = V.kcu.get_request_block_hasher(16, fn)
    pool = BlockPool(
        num_gpu_blocks=64, enable_caching=True, hash_block_size=16, enable_kv_cache_events=True
    )
    enc = msgspec.msgpack.Encoder()
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5000) for _ in range(rng.randrange(16, 300))] for _ in range(6)]
    steps, live = [], []

    def hit(req):
        k = 0
        for h in req.block_hashes:
            if pool.get_cached_block(h, [0]) is None:
                break
            k += 1
        return k

    def flush(ts):
        events = pool.take_events()
        if events:
            payload = enc.encode(KVEventBatch(ts=ts, events=events, data_parallel_rank=0))
            steps.append({"batch": base64.b64encode(payload).decode()})

    for i in range(150):
        tokens = rng.choice(prefixes)[: rng.randrange(16, 400)] + [
            rng.randrange(5000) for _ in range(rng.randrange(0, 60))
        ]
        ecr = V.EngineCoreRequest(
            request_id=f"r{i}",
            prompt_token_ids=tokens,
            mm_features=None,
            sampling_params=V.SamplingParams(max_tokens=1),
            pooling_params=None,
            arrival_time=0.0,
            lora_request=None,
            cache_salt=None,
            data_parallel_rank=None,
        )
        req = V.Request.from_engine_core_request(ecr, block_hasher=hasher)
        k = hit(req)
        steps.append({"tokens": tokens, "expected": k})
        while live and (
            rng.random() < 0.5 or pool.get_num_free_blocks() < len(req.block_hashes) + 1
        ):
            blocks = live.pop(rng.randrange(len(live)))
            pool.free_blocks(reversed(blocks))
        cached = [pool.get_cached_block(h, [0])[0] for h in req.block_hashes[:k]]
        pool.touch(cached)
        need = len(req.block_hashes) - k + 1  # + the partial tail block
        if need > pool.get_num_free_blocks():
            pool.free_blocks(reversed(cached))
            flush(float(i))
            continue
        blocks = cached + pool.get_new_blocks(need)
        pool.cache_full_blocks(req, blocks, k, len(req.block_hashes), 16, 0)
        live.append(blocks)
        if rng.random() < 0.03:
            for blocks in live:
                pool.free_blocks(reversed(blocks))
            live.clear()
            pool.reset_prefix_cache()
        flush(float(i))
    print(json.dumps(steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())

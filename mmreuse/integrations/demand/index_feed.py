"""P's residency index (`BlockIndex`, on the KV cache's device), fed by P's block pool itself.

The pool's two choke points for prefix-cache entries (`_insert_block_hash`,
`_remove_cached_block_hashes`) and `reset_prefix_cache` are exactly where vLLM emits its
`BlockStored` / `BlockRemoved` / `AllBlocksCleared`: hooked there, the index follows P's prefix
cache (group 0, primary hashes). The hooks only append; the changes are applied in batches
before the index is read (`sync`: one residency update per run of a kind).
"""

from __future__ import annotations

import logging
from typing import Any

from ...blockhash import to_event_id
from ...residency import BlockIndex

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["SYNC_INDEX_AFTER", "IndexFeed"]

SYNC_INDEX_AFTER = 512  # pending block-pool changes that make a step apply them (bounded memory)


class IndexFeed:
    """The index and the block pool's changes not yet applied to it. `engine`: vLLM's scheduler
    (its `kv_cache_manager`, `block_size`, `hash_block_size`, `kv_cache_config`). `index` is
    None where P cannot keep one; `note` says where it is, or why not."""

    def __init__(self, engine: Any) -> None:
        # the block pool's stores (hash, block) and removals (None, block), in order
        self.ops: list[tuple[bytes | None, int]] = []
        self.index, self.note = self._make(engine)

    def _make(self, engine: Any) -> tuple[BlockIndex | None, str]:
        manager = engine.kv_cache_manager
        pool = manager.block_pool
        if not getattr(manager, "enable_caching", False):
            return None, "off: prefix caching is disabled"
        if getattr(engine, "hash_block_size", engine.block_size) != engine.block_size:
            return None, "off: hash blocks differ from KV blocks"
        groups = getattr(getattr(engine, "kv_cache_config", None), "kv_cache_groups", None) or ()
        if len(groups) > 1:  # hybrid attention: a block can leave one group and stay in another
            return None, (
                f"off: {len(groups)} KV cache groups (hybrid attention); the index follows "
                "one group and would prove coverage another group has evicted"
            )
        device = "cpu"
        try:
            from vllm.platforms import current_platform

            if current_platform.device_type == "cuda":
                import torch

                if torch.cuda.is_available():
                    device = f"cuda:{torch.cuda.current_device()}"
        except Exception:  # the CPU index answers the same; say where it is
            logger.exception("mmreuse: residency index on the CPU")
        index = BlockIndex(pool.num_gpu_blocks, device)
        self._hook(pool, index)
        return index, device

    def _hook(self, pool: Any, index: BlockIndex) -> None:
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        insert, remove, reset = (
            pool._insert_block_hash,
            pool._remove_cached_block_hashes,
            pool.reset_prefix_cache,
        )
        ops = self.ops

        def _insert_block_hash(key: Any, block: Any, *args: Any, **kwargs: Any) -> None:
            primary = block.block_hash is None
            insert(key, block, *args, **kwargs)
            if primary and block.block_hash == key and get_group_id(key) == 0:
                ops.append((get_block_hash(key), block.block_id))

        def _remove_cached_block_hashes(block: Any) -> Any:
            removed = remove(block)
            if removed:
                ops.append((None, block.block_id))
            return removed

        def reset_prefix_cache(*args: Any, **kwargs: Any) -> bool:
            ok = reset(*args, **kwargs)
            if ok:
                ops.clear()
                index.clear()
            return ok

        pool._insert_block_hash = _insert_block_hash
        pool._remove_cached_block_hashes = _remove_cached_block_hashes
        pool.reset_prefix_cache = reset_prefix_cache

    def sync(self) -> BlockIndex | None:
        """The index, with the block pool's changes since the last read applied in order."""
        index, ops = self.index, self.ops
        if index is None or not ops:
            return index
        _, hash_in = index.maps()
        i = 0
        while i < len(ops):
            j, blocks, hashes = i, [], list[Any]()
            if ops[i][0] is None:  # a run of removals
                while j < len(ops) and ops[j][0] is None:
                    blocks.append(ops[j][1])
                    j += 1
                index.evict_blocks([b for b in dict.fromkeys(blocks) if hash_in[b] is not None])
            else:  # a run of stores, each block once per call
                seen: set[int] = set()
                while j < len(ops) and ops[j][0] is not None and ops[j][1] not in seen:
                    hashes.append(ops[j][0])
                    blocks.append(ops[j][1])
                    seen.add(ops[j][1])
                    j += 1
                index.store_many(hashes, blocks)
            i = j
        ops.clear()
        return index

    def mismatches(self, pool: Any) -> int:
        """Blocks where the index differs from vLLM's prefix cache (`pool`: group 0, primary
        hashes): the hash a block holds, and whether vLLM's map finds that block under it."""
        from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

        index = self.sync()
        if index is None:
            return 0
        _, hash_in = index.maps()
        bad = 0
        for block in pool.blocks:
            key = block.block_hash
            want = None
            if (
                key is not None
                and get_group_id(key) == 0
                and pool.cached_block_hash_to_block.contain(key, block.block_id)
            ):
                want = to_event_id(get_block_hash(key))
            if hash_in[block.block_id] != want:
                bad += 1
        return bad

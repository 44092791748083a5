"""How long one P's KV batch with many identifiers per block holds a proxy's event loop.

The third review's M2 case: a batch of `--events` BlockStored (one block each) whose extra keys
name `--idents` distinct short identifiers ("i0", "i1", ..., offset 0), about 14 MB at the
defaults. Reports, best of `--repeat`:

- `decode_s` / `apply_s`: `decode_batch` and `RemoteKVIndex(track_identifiers=True).apply`
  alone, and the memory the index keeps after the apply (tracemalloc);
- `loop_wait_s`: an asyncio loop that calls `may_hold` (the request path's read) every 10 ms
  while another thread decodes and applies the batch: its longest wait past the 10 ms;
- `loop_wait_untouched_s`: the same loop without touching the index (the GIL's part alone).

    PYTHONPATH=. .venv/bin/python benchmarks/kv_batch_stall.py
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import threading
import time
import tracemalloc

from mmreuse.events import BlockStored, KVEventBatch, RemoteKVIndex, decode_batch, encode_batch


def make_payload(events: int, idents: int) -> bytes:
    keys = tuple((f"i{j}", 0) for j in range(idents))
    batch = KVEventBatch(
        ts=0.0,
        events=[
            BlockStored(
                block_hashes=[i + 1],
                parent_block_hash=None,
                token_ids=[],
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[keys],
            )
            for i in range(events)
        ],
    )
    return encode_batch(batch)


def alone(payload: bytes) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    batch = decode_batch(payload)
    t1 = time.perf_counter()
    idx = RemoteKVIndex(track_identifiers=True)
    idx.apply(batch)
    t2 = time.perf_counter()
    del batch
    gc.collect()
    tracemalloc.start()
    idx = RemoteKVIndex(track_identifiers=True)
    idx.apply(decode_batch(payload))
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return t1 - t0, t2 - t1, kept


def loop_wait(payload: bytes, touch: bool) -> float:
    """The longest wait past 10 ms of a loop that reads the index every 10 ms while a thread
    decodes and applies `payload`."""
    idx = RemoteKVIndex(track_identifiers=True)
    done = threading.Event()

    def subscriber() -> None:
        idx.apply(decode_batch(payload))
        done.set()

    async def ticker() -> float:
        """Every 10 ms, from before the thread starts to after it ends: the longest gap."""
        worst, last = 0.0, time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.01)
            if touch:
                idx.may_hold("i7")
            now = time.perf_counter()
            worst, last = max(worst, now - last - 0.01), now
        return worst

    async def reader() -> float:
        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.05)
        thread = threading.Thread(target=subscriber)
        thread.start()  # the new thread may take the GIL at once: inside the ticker's gap
        worst = await task
        thread.join()
        return worst

    return asyncio.run(reader())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=8000)
    ap.add_argument("--idents", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    payload = make_payload(args.events, args.idents)
    print(f"payload {len(payload) / 1e6:.1f} MB ({args.events} x {args.idents} identifiers)")
    runs = [alone(payload) for _ in range(args.repeat)]
    print(f"decode_s {min(r[0] for r in runs):.3f}  apply_s {min(r[1] for r in runs):.3f}")
    print(f"kept by the index {runs[0][2] / 1e6:.1f} MB")
    touched = min(loop_wait(payload, True) for _ in range(args.repeat))
    untouched = min(loop_wait(payload, False) for _ in range(args.repeat))
    print(f"loop_wait_s {touched:.3f}  loop_wait_untouched_s {untouched:.3f}")


if __name__ == "__main__":
    main()

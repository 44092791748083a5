"""Where one huge chat request's work falls in `mmreuse proxy`: on the event loop, or off it.

A request of `--parts` text parts (60 characters each) and one image, as the review's
loop-stall case (300,000 parts, 27 MB). Times, best of `--repeat`, each step the proxy does for
it: the JSON decode and the part walk (`scan_parts`), which run in a thread for a body over
`OFF_LOOP_BYTES`, and the rewrite for P and the encoding of P's body, which stay on the loop.

    .venv/bin/python benchmarks/proxy_big_request.py [--parts 300000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import msgspec

from mmreuse.proxy.app import OFF_LOOP_BYTES
from mmreuse.proxy.media import item_uuid, rewrite_for_decode, scan_parts


def best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    content = [{"type": "image_url", "image_url": {"url": "http://i.invalid/a.png"}}]
    content += [{"type": "text", "text": "x" * 60} for _ in range(args.parts)]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    decode_s, req = best(lambda: msgspec.json.decode(body), args.repeat)
    scan_s, items = best(lambda: scan_parts(req), args.repeat)
    uuids = [item_uuid(i) for i in items]
    meta = {0: [{"modality": "image", "metadata": {"image_grid_thw": [1, 2, 2]},
                 "mm_hash": "h", "transfer_id": None}]}  # fmt: skip
    rewrite_s, out = best(lambda: rewrite_for_decode(req, meta, frozenset(), uuids, items), 3)
    encode_s, _ = best(lambda: msgspec.json.encode(out), args.repeat)
    off = len(body) > OFF_LOOP_BYTES
    print(f"body {len(body) / 1e6:.1f} MB, {args.parts} parts")
    print(f"decode {decode_s * 1e3:7.1f} ms  ({'thread' if off else 'loop'})")
    print(f"scan   {scan_s * 1e3:7.1f} ms  ({'thread' if off else 'loop'})")
    print(f"rewrite{rewrite_s * 1e3:7.1f} ms  (loop)")
    print(f"encode {encode_s * 1e3:7.1f} ms  (loop)")
    on_loop = rewrite_s + encode_s + (0 if off else decode_s + scan_s)
    print(
        f"on the loop: {on_loop * 1e3:.0f} ms of {(decode_s + scan_s + rewrite_s + encode_s) * 1e3:.0f}"
    )


if __name__ == "__main__":
    main()

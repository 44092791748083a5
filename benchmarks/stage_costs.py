"""What each EPD stage costs on this bed under a model profile, beside a GPU deployment's
published figures, and the ratios between them (issue 41: a CPU bed's figures carry to a GPU
only where its stage costs keep a GPU's proportions).

Starts 1 E + 1 P (PD) of `--profile` on the Mooncake Store (each in its own process group,
stopped at the end) and sends every photograph of `mmreuse.cluster.photos` `--rounds` times,
each time under new uuids (so no cache of any kind holds it), one request at a time:

  E   the photo alone to E (as the proxy's E sub-request): E's frontend time (media decode and
      the HF image processor, from E's own histograms: TTFT less queue and prefill) and its
      engine time (schedule -> done: the ViT forward and the put to the store) = **encode**;
  R   P's render of the request (`/v1/chat/completions/render`, the proxy's `index`/`demand`
      render; another uuid, so P's processor cache cannot hold it): its latency at the client =
      **render**;
  P   the request to P, its uuid E's: P's engine time (the embedding loaded from the store, then
      the prefill of every prompt token) = **prefill + load**;
  T   the same number of prompt tokens as text to P (`/v1/completions`, token ids, fresh):
      **prefill** alone;
  X   the **transfer**: E's put and P's get of the embedding, as the connector times them (its
      `log_transfers` lines in E's and P's logs).

With a profile whose `store_link` is set (`serving`), the store's traffic is paced to it (unless
`--no-pace`): the script runs itself again in a network namespace of its own for that
(`mmreuse.cluster.netshape`; root, or unprivileged user namespaces).

Per photo-size bucket the medians, per image and per token, then the ratios that decide the
RFC's questions beside a GPU's (`GPU` below: vLLM #41267, Qwen2.5-VL-7B on an H100 at 1080p:
encode ~167 ms for ~2,700 image tokens, prefill 126 ms for 2,718 tokens; vLLM #50390/#50411:
Qwen2VLImageProcessor 5.9-12.2 ms at 1024x1024 on CPU; vLLM #47302: a 19.3 MB embedding in ~21
ms at the Store's 912 MiB/s).

    .venv/bin/python benchmarks/stage_costs.py [--profile serving] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from live_render_cost import _metrics, _post, process_cpu_ns

from mmreuse.cluster import Cluster, get_profile
from mmreuse.cluster.model import IMAGE_PAD_ID
from mmreuse.cluster.netshape import StoreLink, in_private_netns, reexec_in_private_netns
from mmreuse.cluster.photos import PHOTOS, load_photos, photo_url
from mmreuse.embedding_store import transfers
from mmreuse.render import RENDER_PATH, render_body

# A GPU deployment's stage costs, as published (docs: BENCHMARKS.md, "Stage costs of the
# serving profile", with their sources and conditions): per image of `GPU_IMAGE_TOKENS`.
GPU_IMAGE_TOKENS = 2691  # Qwen2.5-VL-7B, a 1080p photo (1932x1092 after resize)
GPU = {
    "encode_ms": 167.0,  # vLLM #41267 (inferred by its author from the other spans)
    "render_ms": 12.2,  # vLLM #50411: Qwen2VLImageProcessor at 1024x1024, before its fix
    "prefill_ms_per_token": 126.0 / 2718,  # vLLM #41267, the whole prompt
    "transfer_ms": 21.0,  # vLLM #47302: 19.3 MB at the Store's 912 MiB/s to P
    "put_ms": 19.3e6 / (694 * (1 << 20)) * 1e3,  # vLLM #47302: E -> Store at 694 MiB/s
}
GPU_RATIOS = {
    "encode / render": GPU["encode_ms"] / GPU["render_ms"],
    "prefill per token / encode per token": GPU["prefill_ms_per_token"]
    / (GPU["encode_ms"] / GPU_IMAGE_TOKENS),
    "transfer / encode": GPU["transfer_ms"] / GPU["encode_ms"],
    "put / encode": GPU["put_ms"] / GPU["encode_ms"],
}


def _transfer(log: Path, op: str, uuid: str, timeout: float = 10.0) -> tuple[int, float]:
    """(bytes, ms) of the connector's `op` of the item `uuid`, from its instance's log."""
    deadline = time.monotonic() + timeout
    while True:
        for t in transfers(log.read_text(errors="replace")):
            if t.op == op and t.key.endswith(":" + uuid):
                return t.size, t.ms
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {op} of {uuid} logged in {log} after {timeout} s")
        time.sleep(0.05)


def _engine_ms(url: str, before: dict[str, float]) -> tuple[dict[str, float], float, float]:
    """(counters after, frontend ms, engine ms) of the one request sent since `before`: the
    engine's TTFT less queue and prefill is the frontend's; queue + prefill is the engine's."""
    deadline = time.monotonic() + 10.0
    while True:
        after = _metrics(url)
        done = all(after[f"{h}_count"] >= before[f"{h}_count"] + 1 for h in ("ttft", "prefill"))
        if done or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    d = {k: after[k] - before[k] for k in after}
    engine = (d["queue_sum"] + d["prefill_sum"]) * 1e3
    return after, d["ttft_sum"] * 1e3 - engine, engine


def _chat(url_of_photo: str, uuid: str, max_tokens: int = 1) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url_of_photo}, "uuid": uuid},
                    {"type": "text", "text": "What is in the picture? Answer briefly."},
                ],
            }
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


def run(
    profile_name: str, rounds: int, run_dir: Path, link: StoreLink | None
) -> list[dict[str, Any]]:
    profile = get_profile(profile_name)
    load_photos()  # every photo checked (its licence statement included)
    photos = PHOTOS
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)
    with Cluster(
        run_dir, encoders=1, prefills=1, ec_connector="mooncake", profile=profile, store_link=link
    ) as c:
        e, p = c.instances["E0"], c.instances["P0"]
        eu, pu = e.spec.url, p.spec.url
        # one warm-up of each path (the first request pays one-off costs)
        warm = photo_url(0)
        _post(eu + "/v1/chat/completions", _chat(warm, f"warm-{time.time_ns()}"))
        _post(pu + RENDER_PATH, render_body(_chat(warm, f"warm-r-{time.time_ns()}")))
        _post(pu + "/v1/chat/completions", _chat(warm, f"warm-p-{time.time_ns()}"))
        for r in range(rounds):
            order = list(range(len(photos)))
            rng.shuffle(order)
            for i in order:
                photo = photos[i]
                data = photo_url(i)
                uuid = f"sc-{r}-{i}-{time.time_ns()}"
                row: dict[str, Any] = {"round": r, "photo": photo.file}
                before = _metrics(eu)
                _post(eu + "/v1/chat/completions", _chat(data, uuid))
                _, row["e_frontend_ms"], row["encode_ms"] = _engine_ms(eu, before)
                row["embedding_bytes"], row["put_ms"] = _transfer(e.log_path, "put", uuid)
                c0 = process_cpu_ns(p.pid)
                t0 = time.perf_counter()
                rendered = json.loads(
                    _post(pu + RENDER_PATH, render_body(_chat(data, uuid + "-render")))
                )
                row["render_ms"] = (time.perf_counter() - t0) * 1e3
                row["render_cpu_ms"] = (process_cpu_ns(p.pid) - c0) / 1e6
                ids = rendered["token_ids"]
                row["prompt_tokens"] = len(ids)
                row["image_tokens"] = ids.count(IMAGE_PAD_ID)
                before = _metrics(pu)
                _post(pu + "/v1/chat/completions", _chat(data, uuid))
                _, row["p_frontend_ms"], row["p_engine_ms"] = _engine_ms(pu, before)
                size, row["get_ms"] = _transfer(p.log_path, "get", uuid)
                assert size == row["embedding_bytes"], (size, row["embedding_bytes"])
                text = [rng.randrange(1, 256) for _ in range(len(ids))]
                before = _metrics(pu)
                _post(
                    pu + "/v1/completions",
                    {"model": "tiny", "prompt": text, "max_tokens": 1, "temperature": 0},
                )
                _, _, row["text_prefill_ms"] = _engine_ms(pu, before)
                rows.append(row)
                print(
                    f"  r{r} {photo.file:24} {row['image_tokens']:5} tok  encode "
                    f"{row['encode_ms']:7.1f}  render {row['render_ms']:6.1f}  prefill "
                    f"{row['text_prefill_ms']:7.1f}  put {row['put_ms']:6.1f}  get {row['get_ms']:6.1f} ms",
                    file=sys.stderr,
                    flush=True,
                )
    return rows


def report(
    rows: list[dict[str, Any]], profile_name: str, link: StoreLink | None
) -> tuple[str, dict[str, Any]]:
    """The markdown table (per image, at the bed's median image) and the ratios."""
    med = statistics.median

    def m(key: str) -> float:
        return med(r[key] for r in rows)

    tokens = m("image_tokens")
    encode_tok = med(r["encode_ms"] / r["image_tokens"] for r in rows)
    prefill_tok = med(r["text_prefill_ms"] / r["prompt_tokens"] for r in rows)
    bed = {
        "encode / render": med(r["encode_ms"] / r["render_ms"] for r in rows),
        "prefill per token / encode per token": prefill_tok / encode_tok,
        "transfer / encode": med(r["get_ms"] / r["encode_ms"] for r in rows),
        "put / encode": med(r["put_ms"] / r["encode_ms"] for r in rows),
    }
    lines = [
        f"profile `{profile_name}`, {len(rows)} images (median {tokens:.0f} image tokens, "
        f"{m('embedding_bytes') / 1e6:.2f} MB embedding); the store's link "
        + (
            "not paced"
            if link is None
            else f"paced: put {link.put_mibps}, get {link.get_mibps} MiB/s"
        ),
        "",
        "| stage (one image) | this bed, median | a GPU deployment (published) |",
        "|---|---|---|",
        f"| E's encode (engine: ViT + put) | {m('encode_ms'):.1f} ms ({encode_tok * 1e3:.0f} us "
        f"a token) | {GPU['encode_ms']:.0f} ms for {GPU_IMAGE_TOKENS} tokens "
        f"({GPU['encode_ms'] / GPU_IMAGE_TOKENS * 1e3:.0f} us a token), vLLM #41267 |",
        f"| E's frontend (decode + HF processor) | {m('e_frontend_ms'):.1f} ms | |",
        f"| P's render | {m('render_ms'):.1f} ms ({m('render_cpu_ms'):.1f} ms CPU) | "
        f"{GPU['render_ms']:.1f} ms at 1024x1024 on CPU, vLLM #50411 |",
        f"| P's prefill | {prefill_tok * 1e3:.0f} us a token ({m('text_prefill_ms'):.1f} ms for "
        f"{m('prompt_tokens'):.0f}) | {GPU['prefill_ms_per_token'] * 1e3:.0f} us a token, "
        "vLLM #41267 |",
        f"| embedding store -> P (P's get) | {m('get_ms'):.1f} ms for "
        f"{m('embedding_bytes') / 1e6:.2f} MB | {GPU['transfer_ms']:.0f} ms for 19.3 MB, "
        "vLLM #47302 |",
        f"| embedding E -> store (E's put, in its encode) | {m('put_ms'):.1f} ms | "
        f"{GPU['put_ms']:.0f} ms, vLLM #47302 |",
        "",
        "| ratio | this bed | GPU | bed / GPU |",
        "|---|---|---|---|",
    ]
    for k, v in bed.items():
        g = GPU_RATIOS[k]
        lines.append(f"| {k} | {v:.2f} | {g:.2f} | {v / g:.2f} |")
    return "\n".join(lines), {"bed": bed, "gpu": GPU_RATIOS, "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", default="serving")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--no-pace", action="store_true", help="leave the store's link unpaced")
    args = ap.parse_args()
    link = None if args.no_pace else get_profile(args.profile).store_link
    if link is not None and not in_private_netns():
        reexec_in_private_netns()
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mmreuse-stages-")))
        run_dir = Path(args.run_dir) if args.run_dir else tmp / "cluster"
        rows = run(args.profile, args.rounds, run_dir, link)
    text, summary = report(rows, args.profile, link)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

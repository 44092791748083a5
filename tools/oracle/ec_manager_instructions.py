"""`ec_manager_cost.py`'s drive under callgrind: the instructions `EventfulEncoderCacheManager`
adds per call over vLLM's own `EncoderCacheManager`, a figure the machine's load does not move.

Each manager drives the same scripted requests twice (vLLM's, then the plug-in's, twice); the
second pass of each runs inside `min()` (vLLM's) or `max()` (the plug-in's), so that callgrind,
collecting only inside those two builtins, counts each pass on its own:

    PYTHONHASHSEED=0 PYTHONPATH=. HF_HUB_OFFLINE=1 valgrind --tool=callgrind \\
        --separate-threads=yes --collect-atstart=no \\
        --toggle-collect=builtin_max --toggle-collect=builtin_min \\
        --callgrind-out-file=/tmp/cg.ec.out \\
        ~/.cache/mmreuse/venv-oracle-0.33.0/bin/python tools/oracle/ec_manager_instructions.py
    callgrind_annotate --inclusive=yes /tmp/cg.ec.out-01 | grep -E "builtin_(max|min)"

Added per call = (max's instructions - min's) / the manager calls the tool's drive makes
(19,546 for its default script).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ec_manager_cost as cost
from vllm.v1.core.encoder_cache_manager import EncoderCacheManager

from mmreuse.integrations.vllm import EventfulEncoderCacheManager


def main() -> None:
    requests = cost.script()
    config = SimpleNamespace(
        additional_config={"mmreuse": {"encoder_cache_events_endpoint": f"tcp://*:{cost.port()}"}},
        parallel_config=SimpleNamespace(data_parallel_rank=0),
    )
    makes = {
        "vllm": lambda: EncoderCacheManager(cache_size=160),
        "mmreuse": lambda: EventfulEncoderCacheManager.create_manager(
            cache_size=160, vllm_config=config
        ),
    }
    for k, name in enumerate(("vllm", "mmreuse", "vllm", "mmreuse")):
        manager = makes[name]()
        for r in requests:
            r.__dict__.pop("_mmreuse_request_keys", None)
        if k < 2:  # warm-up passes, not counted
            print(name, cost.drive(manager, requests)[1])
        else:
            wrap = min if name == "vllm" else max
            calls: list[int] = []
            wrap([0], key=lambda _, m=manager: calls.append(cost.drive(m, requests)[1]) or 0)
            print(name, calls[0], "calls, counted")
        if getattr(manager, "publisher", None) is not None:
            manager.publisher.shutdown()


if __name__ == "__main__":
    main()

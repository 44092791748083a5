"""`mmreuse proxy`: a demand-aware EPD proxy, a drop-in for vLLM's reference
`disagg_epd_proxy.py` (static mode), with `--policy index` (send E only what the chosen P/PD
still needs, from its live KV view), `demand` (ask P first, from its `DemandScheduler`) and
`opportunistic` (E at once, abandoned where P's answer rules it out), and Prometheus metrics. Torch-free: aiohttp, msgspec, pyzmq (`mmreuse[proxy]`).

    from mmreuse.proxy import build_app, parse_args
    app = build_app(parse_args(["--encode-servers-urls", E, "--decode-servers-urls", PD]))
"""

from .config import ProxyConfig, parse_args

__all__ = ["ProxyConfig", "build_app", "parse_args", "run"]


def __getattr__(name: str):  # the aiohttp side loads only when asked (config stays light)
    if name == "build_app":
        from .server import build_app

        return build_app
    if name == "run":
        from .workers import run

        return run
    raise AttributeError(name)

"""A deployment given by URLs (`mmreuse bench-cluster --encode-urls ... --pd-urls ...`), in
the shape of a started `mmreuse.cluster.Cluster` that bench-cluster's runs use."""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RemoteSpec:
    name: str
    role: str
    url: str
    demand_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class RemoteInstance:
    spec: RemoteSpec


class Unreachable(RuntimeError):
    """A deployment given by URLs does not answer: the message names the server."""


class RemoteCluster:
    """A deployment given by URLs (`bench-cluster --encode-urls ... --pd-urls ...`), in the
    shape `run_policy` uses: every PD runs DemandScheduler with admission records and serves
    vLLM's dev reset endpoints (VLLM_SERVER_DEV_MODE=1); E's store and the servers' logs are
    not reachable from here, so no store is emptied and the real forwards are not read
    (`e_forwards_probe` None: the attributed ones stand)."""

    ec_dir = None

    def __init__(
        self,
        encode_urls: Sequence[str],
        pd_urls: Sequence[str],
        demand_endpoints: Sequence[str],
        proxy_flags: Sequence[str] = (),
    ) -> None:
        if not encode_urls or not pd_urls:
            raise ValueError("--encode-urls and --pd-urls: at least one URL each")
        if len(demand_endpoints) != len(pd_urls):
            raise ValueError(
                f"--demand-endpoints: {len(demand_endpoints)} for {len(pd_urls)} --pd-urls, "
                "one each (their DemandScheduler endpoints, aligned)"
            )
        self.instances: dict[str, RemoteInstance] = {}
        for i, url in enumerate(encode_urls):
            self.instances[f"E{i}"] = RemoteInstance(
                RemoteSpec(f"E{i}", "encoder", url.rstrip("/"))
            )
        for i, (url, ep) in enumerate(zip(pd_urls, demand_endpoints, strict=True)):
            self.instances[f"P{i}"] = RemoteInstance(
                RemoteSpec(f"P{i}", "prefill", url.rstrip("/"), ep)
            )
        self._flags = list(proxy_flags)

    def check_reachable(self, timeout: float = 10.0) -> None:
        """Each server answers GET /health; else an Unreachable naming the instance, its URL
        and what to check, before any policy runs."""
        for inst in self.instances.values():
            spec = inst.spec
            try:
                with urllib.request.urlopen(f"{spec.url}/health", timeout=timeout) as r:
                    r.read()
            except urllib.error.HTTPError as exc:
                raise Unreachable(
                    f"{spec.name} at {spec.url}: GET /health answered {exc.code}: is it a vLLM "
                    "server, and healthy?"
                ) from None
            except (urllib.error.URLError, OSError) as exc:
                reason = getattr(exc, "reason", exc)
                raise Unreachable(
                    f"{spec.name} at {spec.url} does not answer (GET /health: {reason}): check "
                    "the URL, that the server is up and that this machine can reach it"
                ) from None

    def proxy_args(self) -> list[str]:
        es = [i.spec.url for i in self.instances.values() if i.spec.role == "encoder"]
        ps = [i.spec for i in self.instances.values() if i.spec.role == "prefill"]
        return [
            "--encode-servers-urls", ",".join(es),
            "--decode-servers-urls", ",".join(p.url for p in ps),
            "--demand-endpoints", ",".join(str(p.demand_endpoint) for p in ps),
            *self._flags,
        ]  # fmt: skip

    def probe(self) -> None:
        return None


__all__ = ["RemoteCluster", "RemoteInstance", "RemoteSpec", "Unreachable"]

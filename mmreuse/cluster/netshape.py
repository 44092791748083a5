"""Pacing the embedding store's traffic, so that moving an embedding E -> store -> P costs on
this bed what it costs a GPU deployment beside its encode.

On loopback the Mooncake Store moves a serving-profile embedding (0.5-2.5 MB) in a few ms,
about 0.01 of an encode, where a GPU deployment's transfer is ~0.13 of one (vLLM #47302's
Store rates for #41267's 19.3 MB embedding). `StoreLink` is a rate for each direction; `pace`
puts the store holder's TCP traffic (and only it: requests, KV events and everything else stay
at loopback speed) through an HTB class of that rate on `lo`. It changes the network namespace
it runs in, so it refuses to run in the machine's own: `reexec_in_private_netns` runs a command
again in a namespace of its own (root, or an unprivileged user namespace), where `lo` is
private and goes away with the command.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from ..errors import InvalidArgument
from ..validate import check_float, check_int

__all__ = ["StoreLink", "in_private_netns", "pace", "reexec_in_private_netns"]

_REEXEC_MARK = "MMREUSE_PRIVATE_NETNS"
_DEV = "lo"


class NetshapeError(RuntimeError):
    """The namespace or the pacing could not be set up (the message says what to do)."""


@dataclass(frozen=True, slots=True)
class StoreLink:
    """The store's link as a rate each way, in MiB/s: `put` (E -> the store's holder) and `get`
    (the holder -> P)."""

    put_mibps: float
    get_mibps: float

    def __post_init__(self) -> None:
        check_float("put_mibps", self.put_mibps, 0, lo_open=True)
        check_float("get_mibps", self.get_mibps, 0, lo_open=True)


def in_private_netns() -> bool:
    """Whether this process's network namespace is not the machine's: not the one it was
    re-executed from (`reexec_in_private_netns`), or else not PID 1's."""
    try:
        mine = os.readlink("/proc/self/ns/net")
        outer = os.environ.get(_REEXEC_MARK) or os.readlink("/proc/1/ns/net")
    except OSError:  # /proc/1's hidden from here: cannot tell, so not private
        return False
    return mine != outer


def this_command() -> list[str]:
    """This Python command, to run again: `python -m PKG.MOD ...` as it was started (its
    argv[0] is then the module's path, which run as a script loses its package)."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:
        name = spec.name.removesuffix(".__main__")
        return [sys.executable, "-m", name, *sys.argv[1:]]
    return [sys.executable, *sys.argv]


def reexec_in_private_netns(argv: Sequence[str] | None = None) -> NoReturn:
    """Replace this process by `argv` (default: this Python command again) run in a network
    namespace of its own with `lo` up. Root gets a plain one; another user an unprivileged user
    namespace mapping it to root (where the kernel allows them)."""
    if os.environ.get(_REEXEC_MARK):
        raise NetshapeError("re-executed into a private network namespace, yet not in one")
    try:
        outer = os.readlink("/proc/self/ns/net")
    except OSError as exc:
        raise NetshapeError(f"cannot read this process's network namespace: {exc}") from exc
    unshare = shutil.which("unshare")
    if unshare is None or shutil.which("ip") is None or shutil.which("tc") is None:
        raise NetshapeError("pacing the store needs unshare, ip and tc (util-linux, iproute2)")
    args = list(argv) if argv is not None else this_command()
    flags = ["--net"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--net"]
    os.environ[_REEXEC_MARK] = outer  # what the new one must differ from
    script = 'ip link set lo up && exec "$@"'
    os.execv(unshare, [unshare, *flags, "--", "sh", "-c", script, "sh", *args])


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise NetshapeError(f"tc {' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _bits(mibps: float) -> str:
    return f"{round(mibps * (1 << 20) * 8)}bit"


def pace(ports: Iterable[int], link: StoreLink) -> None:
    """Send TCP traffic to `ports` (puts: the store's holder listens there) at `link.put_mibps`
    and from them (gets) at `link.get_mibps`, everything else on `lo` as before. Replaces an
    earlier pacing; only in a private network namespace."""
    wanted = sorted({check_int("port", p, 1, 65535) for p in ports})
    if not wanted:
        raise InvalidArgument("ports must name at least one port of the store's holder")
    if not in_private_netns():
        raise NetshapeError(
            "pacing changes lo's queueing for the whole network namespace: run it in one of its "
            "own (netshape.reexec_in_private_netns, or `unshare --net`)"
        )
    subprocess.run(["tc", "qdisc", "del", "dev", _DEV, "root"], capture_output=True, check=False)
    # HTB (the kernels here have htb, tbf and u32; not prio or netem): class 1:2 everything
    # else, unpaced; 1:3 puts; 1:4 gets
    _tc("qdisc", "add", "dev", _DEV, "root", "handle", "1:", "htb", "default", "2")
    _tc("class", "add", "dev", _DEV, "parent", "1:", "classid", "1:2", "htb", "rate", "100gbit")
    for band, mibps in ((3, link.put_mibps), (4, link.get_mibps)):
        rate = _bits(mibps)
        _tc("class", "add", "dev", _DEV, "parent", "1:", "classid", f"1:{band}", "htb",
            "rate", rate, "ceil", rate)  # fmt: skip
    for port in wanted:
        for field, band in (("dport", 3), ("sport", 4)):
            _tc("filter", "add", "dev", _DEV, "parent", "1:", "protocol", "ip", "prio", "1",
                "u32", "match", "ip", field, str(port), "0xffff", "flowid", f"1:{band}")  # fmt: skip


def unpace() -> None:
    """Take any pacing off `lo` (no error where there is none)."""
    subprocess.run(["tc", "qdisc", "del", "dev", _DEV, "root"], capture_output=True, check=False)

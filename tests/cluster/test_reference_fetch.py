"""mmreuse.cluster.reference without the network: a fake simple index and sdist served from a temp
dir through file:// URLs (urllib's own opener), plus a patched opener to prove the cache is used."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from mmreuse.cluster import reference
from mmreuse.errors import InvalidArgument, InvalidArgumentType

VERSION = reference.DEFAULT_VERSION  # the fake index serves the default version
TOP = f"vllm-{VERSION}"
EXAMPLE = f"{TOP}/examples/disaggregated/disaggregated_encoder"
PROXY_SRC = b"# the reference proxy\nprint('proxy')\n"


def _add(tar: tarfile.TarFile, name: str, data: bytes = b"x", **kw: object) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mode = 0o644
    for key, value in kw.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data) if info.isfile() else None)


def make_sdist(path: Path, extra: tuple[tuple[str, bytes, dict[str, object]], ...] = ()) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        _add(tar, f"{TOP}/setup.py", b"setup()")
        _add(tar, f"{TOP}/vllm/__init__.py", b"")
        _add(tar, f"{TOP}/examples/other/thing.py", b"other")
        _add(tar, f"{EXAMPLE}/{reference.PROXY_FILE}", PROXY_SRC)
        _add(tar, f"{EXAMPLE}/README.md", b"readme")
        _add(tar, f"{EXAMPLE}/sub/helper.sh", b"#!/bin/sh\n", mode=0o755)
        for name, data, kw in extra:
            _add(tar, name, data, **kw)
    return path


def make_index(root: Path, sdist: Path, sha: str | None = None, size: bool = True) -> str:
    entry = {
        "filename": f"vllm-{VERSION}.tar.gz",
        "url": sdist.as_uri(),
        "hashes": {"sha256": sha or hashlib.sha256(sdist.read_bytes()).hexdigest()},
    }
    if size:
        entry["size"] = sdist.stat().st_size
    other = {
        "filename": "vllm-0.32.0.tar.gz",
        "url": "file:///nope",
        "hashes": {"sha256": "0" * 64},
    }
    index = root / "index.json"
    index.write_text(json.dumps({"name": "vllm", "files": [other, entry]}))
    return index.as_uri()


@pytest.fixture
def served(tmp_path: Path) -> tuple[Path, str]:
    sdist = make_sdist(tmp_path / "serve" / f"vllm-{VERSION}.tar.gz")
    return tmp_path / "cache", make_index(tmp_path / "serve", sdist)


def test_fetch_extracts_only_the_example_folder_and_stamps(served: tuple[Path, str]) -> None:
    cache, index = served
    path = reference.fetch_reference(VERSION, cache, index_url=index)
    dest = cache / f"vllm-{VERSION}"
    assert path == dest / reference.PROXY_FILE
    assert path.read_bytes() == PROXY_SRC
    files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    assert files == [reference.STAMP_NAME, "README.md", reference.PROXY_FILE, "sub/helper.sh"]
    assert (dest / "sub/helper.sh").stat().st_mode & 0o111
    stamp = json.loads((dest / reference.STAMP_NAME).read_text())
    assert stamp["version"] == VERSION
    assert stamp["files"][reference.PROXY_FILE] == hashlib.sha256(PROXY_SRC).hexdigest()
    # No tarball, partial download or staging folder is left behind.
    leftovers = [
        p.name for p in cache.iterdir() if p.name != dest.name and not p.name.endswith(".lock")
    ]
    assert leftovers == []


def test_stamp_reuse_makes_no_request(
    served: tuple[Path, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, index = served
    first = reference.fetch_reference(VERSION, cache, index_url=index)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached copy should have been used")

    monkeypatch.setattr(reference.urllib.request, "urlopen", no_network)
    assert reference.fetch_reference(VERSION, str(cache), index_url=index) == first


def test_edited_copy_is_fetched_again(served: tuple[Path, str]) -> None:
    cache, index = served
    path = reference.fetch_reference(VERSION, cache, index_url=index)
    path.write_text("# edited\n")
    assert reference.fetch_reference(VERSION, cache, index_url=index).read_bytes() == PROXY_SRC


def test_sha_mismatch_is_refused_and_nothing_kept(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path / "serve" / f"vllm-{VERSION}.tar.gz")
    index = make_index(tmp_path / "serve", sdist, sha="ab" * 32)
    cache = tmp_path / "cache"
    with pytest.raises(reference.ReferenceFetchError, match="sha256 mismatch") as err:
        reference.fetch_reference(VERSION, cache, index_url=index)
    assert err.value.url == sdist.as_uri()
    assert sdist.as_uri() in str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert not (cache / f"vllm-{VERSION}").exists()
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_size_mismatch_is_refused(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path / "serve" / f"vllm-{VERSION}.tar.gz")
    index_path = Path(make_index(tmp_path / "serve", sdist)[len("file://") :])
    data = json.loads(index_path.read_text())
    data["files"][1]["size"] += 1
    index_path.write_text(json.dumps(data))
    with pytest.raises(reference.ReferenceFetchError, match="the index says"):
        reference.fetch_reference(VERSION, tmp_path / "cache", index_url=index_path.as_uri())


@pytest.mark.parametrize(
    "name",
    [
        f"{EXAMPLE}/../../../../../escape.py",
        "../escape/examples/disaggregated/disaggregated_encoder/x.py",
        "/abs/examples/disaggregated/disaggregated_encoder/x.py",
        f"{TOP}/elsewhere/../../escape.py",
    ],
)
def test_path_traversal_is_refused(tmp_path: Path, name: str) -> None:
    sdist = make_sdist(tmp_path / "serve" / f"vllm-{VERSION}.tar.gz", ((name, b"evil", {}),))
    index = make_index(tmp_path / "serve", sdist)
    with pytest.raises(reference.ReferenceFetchError, match="unsafe member path"):
        reference.fetch_reference(VERSION, tmp_path / "cache", index_url=index)
    assert not (tmp_path / "escape.py").exists()
    assert not list(tmp_path.rglob("escape.py"))
    assert not (tmp_path / "cache" / f"vllm-{VERSION}").exists()


def test_links_in_the_example_folder_are_refused(tmp_path: Path) -> None:
    link = (f"{EXAMPLE}/link.py", b"", {"type": tarfile.SYMTYPE, "linkname": "/etc/passwd"})
    sdist = make_sdist(tmp_path / "serve" / f"vllm-{VERSION}.tar.gz", (link,))
    index = make_index(tmp_path / "serve", sdist)
    with pytest.raises(reference.ReferenceFetchError, match="link or special file"):
        reference.fetch_reference(VERSION, tmp_path / "cache", index_url=index)


def test_sdist_without_the_proxy_is_refused(tmp_path: Path) -> None:
    sdist = tmp_path / "serve" / f"vllm-{VERSION}.tar.gz"
    sdist.parent.mkdir()
    with tarfile.open(sdist, "w:gz") as tar:
        _add(tar, f"{EXAMPLE}/README.md", b"readme")
    index = make_index(tmp_path / "serve", sdist)
    with pytest.raises(reference.ReferenceFetchError, match="no examples/"):
        reference.fetch_reference(VERSION, tmp_path / "cache", index_url=index)


def test_network_and_index_failures_name_the_url(tmp_path: Path) -> None:
    missing = (tmp_path / "absent.json").as_uri()
    with pytest.raises(reference.ReferenceFetchError, match="cannot open") as err:
        reference.fetch_reference(VERSION, tmp_path / "cache", index_url=missing)
    assert err.value.url == missing
    bad = tmp_path / "bad.json"
    bad.write_text("<html>not json</html>")
    with pytest.raises(reference.ReferenceFetchError, match="not a simple JSON index"):
        reference.fetch_reference(VERSION, tmp_path / "cache", index_url=bad.as_uri())
    sdist = make_sdist(tmp_path / "serve" / f"vllm-{VERSION}.tar.gz")
    index = make_index(tmp_path / "serve", sdist)
    with pytest.raises(reference.ReferenceFetchError, match=r"no vllm-9\.9\.9\.tar\.gz listed"):
        reference.fetch_reference("9.9.9", tmp_path / "cache", index_url=index)


@pytest.mark.parametrize(
    ("kwargs", "exc", "field"),
    [
        ({"version": 33}, InvalidArgumentType, "version"),
        ({"version": "../0.33.0"}, InvalidArgument, "version"),
        ({"version": "0.33.0/x"}, InvalidArgument, "version"),
        ({"version": ""}, InvalidArgument, "version"),
        ({"cache_dir": 5}, InvalidArgumentType, "cache_dir"),
        ({"cache_dir": True}, InvalidArgumentType, "cache_dir"),
        ({"cache_dir": ""}, InvalidArgument, "cache_dir"),
        ({"index_url": "ftp://x/"}, InvalidArgument, "index_url"),
        ({"index_url": b"https://x/"}, InvalidArgumentType, "index_url"),
    ],
)
def test_bad_arguments(tmp_path: Path, kwargs: dict[str, object], exc: type, field: str) -> None:
    kwargs.setdefault("cache_dir", tmp_path)
    with pytest.raises(exc, match=f"^{field}"):
        reference.fetch_reference(**kwargs)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []  # nothing created before the checks passed


def test_reference_python_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="mmreuse cluster install"):
        reference.reference_python(tmp_path / "no-venv")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    site = venv / "lib" / "python3.11" / "site-packages"
    for dep in reference.REFERENCE_DEPS:
        if dep != "uvloop":
            (site / dep).mkdir(parents=True)
    with pytest.raises(RuntimeError, match=r"lacks uvloop.*mmreuse cluster install"):
        reference.reference_python(venv)
    (site / "uvloop").mkdir()
    assert reference.reference_python(venv) == venv / "bin" / "python"


def test_main_prints_the_path(served: tuple[Path, str], capsys: pytest.CaptureFixture[str]) -> None:
    cache, index = served
    assert reference.main(["--cache-dir", str(cache), "--index-url", index]) == 0
    assert capsys.readouterr().out.strip() == str(cache / f"vllm-{VERSION}" / reference.PROXY_FILE)
    assert reference.main(["--cache-dir", str(cache), "--version", "bad/"]) == 1
    assert "version must be" in capsys.readouterr().err

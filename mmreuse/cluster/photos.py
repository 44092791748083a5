"""Real photographs for the real-cluster bench: sample images that scikit-image ships in its wheel
(`skimage/data/`), read at run time from the installed package (the `bench` extra), never copied
into this repository. Sent as they ship (JPEG or PNG bytes, 59-528 KB, in a base64 data URL),
so that the proxy's render, P's processor and E's pay real decode costs.

Only images whose licence scikit-image's own documentation states as public domain or CC0 are
used (`PHOTOS`; docs/bench-cluster.md has the table). Each entry carries the sentence of
scikit-image's docstring for that image (`skimage/data/_fetchers.py`, the function that loads
the file) that states its licence, and `load_photos` refuses to serve an image whose loader's
docstring no longer says so: a scikit-image release that changed an image, or its licence,
stops the bench rather than sending it.
"""

from __future__ import annotations

import ast
import base64
import hashlib
import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..errors import InvalidArgument
from ..validate import check_str, fail_value

__all__ = [
    "MAX_BYTES",
    "MIN_BYTES",
    "PHOTOS",
    "Photo",
    "PhotosUnavailable",
    "load_photos",
    "loader_docstrings",
    "photo_dir",
    "photo_for",
    "photo_url",
]

MIN_BYTES = 20_000  # smaller than a real photo: nothing to decode
MAX_BYTES = 600_000  # larger ones would dominate a 2-core run
_FETCHERS = "_fetchers.py"  # scikit-image's loaders, one function (and docstring) per image
_MAGIC = {"image/png": b"\x89PNG\r\n\x1a\n", "image/jpeg": b"\xff\xd8\xff"}


@dataclass(frozen=True, slots=True)
class Photo:
    """One sample image of scikit-image: its file in `skimage/data/`, what it shows, who made
    it, its licence, where scikit-image took it from, and `statement`, the licence sentence of
    scikit-image's docstring for it (whitespace-normalised), checked on load."""

    file: str
    mime: str
    subject: str
    author: str
    licence: str  # "CC0-1.0" or "public domain"
    origin: str
    statement: str


PHOTOS: tuple[Photo, ...] = (
    Photo(
        "chelsea.png", "image/png", "Chelsea the cat", "Stefan van der Walt", "CC0-1.0",
        "scikit-image", "No copyright restrictions. CC0 by the photographer (Stefan van der Walt).",
    ),
    Photo(
        "coffee.png", "image/png", "a cup of coffee", "Rachel Michetti", "CC0-1.0",
        "courtesy of Pikolo Espresso Bar",
        "No copyright restrictions. CC0 by the photographer (Rachel Michetti).",
    ),
    Photo(
        "rocket.jpg", "image/jpeg", "Falcon 9 launching DSCOVR", "SpaceX", "public domain",
        "https://www.flickr.com/photos/spacexphotos/16511594820/",
        "The image was captured by SpaceX and `released in the public domain",
    ),
    Photo(
        "hubble_deep_field.jpg", "image/jpeg", "the Hubble eXtreme Deep Field", "NASA",
        "public domain", "http://hubblesite.org/newscenter/archive/releases/2012/37/image/a/",
        "The image was captured by NASA and `may be freely used in the public domain",
    ),
    Photo(
        "retina.jpg", "image/jpeg", "a human retina (fundus photograph)", "Mikael Häggström",
        "CC0-1.0",
        "https://commons.wikimedia.org/wiki/File:Fundus_photograph_of_normal_left_eye.jpg",
        "This file is made available under the Creative Commons CC0 1.0 Universal Public "
        "Domain Dedication.",
    ),
    Photo(
        "camera.png", "image/png", "a cameraman (grey levels)", "Lav Varshney", "CC0-1.0",
        "scikit-image", "No copyright restrictions. CC0 by the photographer (Lav Varshney).",
    ),
    Photo(
        "clock_motion.png", "image/png", "a wall clock, motion-blurred (grey levels)",
        "Stefan van der Walt", "public domain", "scikit-image",
        "Released into the public domain by the photographer (Stefan van der Walt).",
    ),
    Photo(
        "brick.png", "image/png", "a brick wall (grey levels)", "CC0Textures (Bricks25)",
        "CC0-1.0", "https://cc0textures.com/view.php?tex=Bricks25",
        "licensed under the Creative Commons CC0 License.",
    ),
)  # fmt: skip


class PhotosUnavailable(RuntimeError):
    """scikit-image is not installed, or does not ship a photo as `PHOTOS` describes it: the
    message says which, and what to install."""


def photo_dir() -> Path:
    """`skimage/data/` of the installed scikit-image, found without importing it (its import
    pulls scipy and more; only the files are needed)."""
    spec = importlib.util.find_spec("skimage")
    if spec is None or not spec.submodule_search_locations:
        raise PhotosUnavailable(
            "the bench's photographs come from scikit-image's sample images: install it "
            "(pip install 'mmreuse[bench]', or scikit-image>=0.25)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "data"


def _normalise(text: str) -> str:
    return " ".join(text.split())


def loader_docstrings(source: str) -> dict[str, str]:
    """Per data file (`"chelsea.png"`), the whitespace-normalised docstring of the function in
    scikit-image's `_fetchers.py` source whose body names `"data/<file>"` (its loader)."""
    out: dict[str, str] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.FunctionDef):
            continue
        doc = ast.get_docstring(node) or ""
        for sub in ast.walk(node):
            if (
                isinstance(sub, ast.Constant)
                and isinstance(sub.value, str)
                and sub.value.startswith("data/")
            ):
                out.setdefault(sub.value.removeprefix("data/"), _normalise(doc))
    return out


def _check(photo: Photo, data: bytes, docs: dict[str, str]) -> None:
    """Refuse a photo whose bytes or licence statement are not what `PHOTOS` says."""
    if not MIN_BYTES <= len(data) <= MAX_BYTES:
        raise PhotosUnavailable(
            f"skimage/data/{photo.file}: {len(data)} bytes, outside [{MIN_BYTES}, {MAX_BYTES}]"
        )
    if not data.startswith(_MAGIC[photo.mime]):
        raise PhotosUnavailable(f"skimage/data/{photo.file}: not a {photo.mime} file")
    doc = docs.get(photo.file)
    if doc is None or _normalise(photo.statement) not in doc:
        raise PhotosUnavailable(
            f"skimage/data/{photo.file}: scikit-image's docstring for it no longer states "
            f"{photo.statement!r}; its licence must be checked again before it is used"
        )


@cache
def load_photos() -> tuple[bytes, ...]:
    """Every photo's bytes as shipped, in `PHOTOS`' order, each checked (size, file type, and
    its licence statement in scikit-image's own docstring); PhotosUnavailable otherwise."""
    folder = photo_dir()
    try:
        docs = loader_docstrings((folder / _FETCHERS).read_text("utf-8"))
        out = []
        for photo in PHOTOS:
            data = (folder / photo.file).read_bytes()
            _check(photo, data, docs)
            out.append(data)
    except OSError as exc:
        raise PhotosUnavailable(
            f"scikit-image's sample images cannot be read ({exc}): reinstall scikit-image>=0.25"
        ) from None
    return tuple(out)


@cache
def photo_url(index: int) -> str:
    """Photo `index` of `PHOTOS` as a `data:<mime>;base64,...` URL of its shipped bytes."""
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(PHOTOS):
        fail_value("index", f"an int in [0, {len(PHOTOS)})", index)
    data = load_photos()[index]
    return f"data:{PHOTOS[index].mime};base64," + base64.b64encode(data).decode("ascii")


def photo_for(ident: str) -> int:
    """Which photo shows image `ident` (a simulator image id): its sha256, modulo the photos,
    so one id is always one photo and the ids of a stream spread over all of them."""
    ident = check_str("ident", ident, nonempty=True)
    try:
        raw = ident.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(f"ident must be valid Unicode, got {ident!r}") from None
    return int.from_bytes(hashlib.sha256(raw).digest()[:8], "big") % len(PHOTOS)

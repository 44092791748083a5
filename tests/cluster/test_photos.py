"""The bench's photographs (mmreuse.cluster.photos): read from the installed scikit-image as
shipped, each checked against the licence statement of scikit-image's own docstring, and
refused when that statement, the size or the file type is not what the table says."""

from __future__ import annotations

import base64
import shutil
from collections import Counter

import pytest

from mmreuse.cluster import photos
from mmreuse.cluster.photos import (
    MAX_BYTES,
    MIN_BYTES,
    PHOTOS,
    PhotosUnavailable,
    load_photos,
    loader_docstrings,
    photo_dir,
    photo_for,
    photo_url,
)
from mmreuse.errors import InvalidArgument

needs_skimage = pytest.mark.skipif(
    photos.importlib.util.find_spec("skimage") is None,
    reason="scikit-image (the bench extra) is not installed",
)


def test_the_table_holds_only_public_domain_or_cc0_images_each_once():
    assert len({p.file for p in PHOTOS}) == len(PHOTOS) >= 6
    assert {p.licence for p in PHOTOS} <= {"CC0-1.0", "public domain"}
    assert {p.mime for p in PHOTOS} == {"image/png", "image/jpeg"}  # both decoders are paid
    for p in PHOTOS:
        assert p.file.endswith(".png" if p.mime == "image/png" else ".jpg")
        assert p.author and p.subject and p.origin and p.statement


@needs_skimage
def test_every_photo_loads_as_shipped_and_its_licence_is_stated_by_scikit_image():
    data = load_photos()
    folder = photo_dir()
    docs = loader_docstrings((folder / "_fetchers.py").read_text("utf-8"))
    for p, raw in zip(PHOTOS, data, strict=True):
        assert raw == (folder / p.file).read_bytes()  # the bytes as shipped, not re-encoded
        assert MIN_BYTES <= len(raw) <= MAX_BYTES
        assert " ".join(p.statement.split()) in docs[p.file], p.file
    url = photo_url(2)
    head, b64 = url.split(",", 1)
    assert head == f"data:{PHOTOS[2].mime};base64"
    assert base64.b64decode(b64) == data[2]


def test_loader_docstrings_finds_each_files_loader():
    source = '''
def cat():
    """A cat.

    No copyright   restrictions.
    CC0 by someone.
    """
    return _load("data/cat.png")


def other():
    return _load("data/other.jpg", as_gray=True)

alias = cat
'''
    assert loader_docstrings(source) == {
        "cat.png": "A cat. No copyright restrictions. CC0 by someone.",
        "other.jpg": "",
    }


def fake_skimage(tmp_path, monkeypatch, *, statement=None, size=None, drop=None):
    """A copy of the photos and a _fetchers.py stating their licences, as photo_dir."""
    folder = tmp_path / "data"
    folder.mkdir()
    funcs = []
    for i, p in enumerate(PHOTOS):
        text = statement if statement is not None and i == 0 else p.statement
        funcs.append(f'def f{i}():\n    """{text}"""\n    return _load("data/{p.file}")\n')
        magic = photos._MAGIC[p.mime]
        n = size if size is not None and i == 0 else 30_000
        if p.file != drop:
            (folder / p.file).write_bytes(magic + b"\0" * (n - len(magic)))
    (folder / "_fetchers.py").write_text("\n".join(funcs))
    monkeypatch.setattr(photos, "photo_dir", lambda: folder)
    photos.load_photos.cache_clear()
    return folder


@pytest.fixture(autouse=True)
def fresh_cache():
    photos.load_photos.cache_clear()
    photos.photo_url.cache_clear()
    yield
    photos.load_photos.cache_clear()
    photos.photo_url.cache_clear()


def test_fake_photos_load(tmp_path, monkeypatch):
    fake_skimage(tmp_path, monkeypatch)
    assert [len(x) for x in load_photos()] == [30_000] * len(PHOTOS)


@pytest.mark.parametrize(
    ("kw", "words"),
    [
        ({"statement": "All rights reserved."}, "no longer states"),
        ({"size": 1000}, "outside"),
        ({"size": MAX_BYTES + 1}, "outside"),
        ({"drop": PHOTOS[3].file}, "cannot be read"),
    ],
)
def test_a_photo_not_as_the_table_says_is_refused(tmp_path, monkeypatch, kw, words):
    fake_skimage(tmp_path, monkeypatch, **kw)
    with pytest.raises(PhotosUnavailable, match=words):
        load_photos()


def test_a_file_of_another_type_is_refused(tmp_path, monkeypatch):
    folder = fake_skimage(tmp_path, monkeypatch)
    jpeg = next(p for p in PHOTOS if p.mime == "image/jpeg")
    png = next(p for p in PHOTOS if p.mime == "image/png")
    shutil.copy(folder / png.file, folder / jpeg.file)
    with pytest.raises(PhotosUnavailable, match=f"{jpeg.file}: not a image/jpeg file"):
        load_photos()


def test_without_scikit_image_the_message_says_what_to_install(monkeypatch):
    monkeypatch.setattr(photos.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(PhotosUnavailable, match=r"mmreuse\[bench\]"):
        photo_dir()


def test_one_id_one_photo_and_ids_spread_over_all():
    assert photo_for("img-1") == photo_for("img-1")
    counts = Counter(photo_for(f"img-{i}") for i in range(2000))
    assert set(counts) == set(range(len(PHOTOS)))
    assert min(counts.values()) > 2000 / len(PHOTOS) / 2
    with pytest.raises(InvalidArgument, match=r"^ident"):
        photo_for("")
    with pytest.raises(InvalidArgument, match=r"^index"):
        photo_url(len(PHOTOS))

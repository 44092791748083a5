"""mmreuse.integrations.vllm: on duck-typed stand-ins here, and on real vLLM objects in the oracle venv."""

import json
import os
import subprocess
import types
from pathlib import Path

import pytest

pytest.importorskip("torch")
import torch

from mmreuse import BlockHasher, Klass, MMOccurrence
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.integrations.vllm import (
    availability_from_engine,
    demand_for_request,
    from_render,
    from_render_json,
    occurrences_from_request,
)

from .oracle_client import REPO, require_oracle


def feature(ident, offset, length, mask=None):
    pos = types.SimpleNamespace(
        offset=offset, length=length, is_embed=None if mask is None else torch.tensor(mask)
    )
    return types.SimpleNamespace(identifier=ident, modality="image", mm_position=pos)


def test_occurrences_from_request():
    req = types.SimpleNamespace(
        mm_features=[feature("A", 2, 3, [True, False, True])], num_tokens=10
    )
    assert occurrences_from_request(req) == [MMOccurrence("A", 2, 3, (True, False, True))]
    assert occurrences_from_request(types.SimpleNamespace(mm_features=None)) == []
    with pytest.raises(ValueError, match="mm_features"):
        occurrences_from_request(object())


def test_availability_from_engine_stand_ins():
    mgr = types.SimpleNamespace(
        cached={"A": {"r1"}, "B": set()}, num_embeds_by_hash={"A": 4, "B": 9}
    )
    conn = types.SimpleNamespace(has_cache_item=lambda i: i.startswith("x"))
    a = availability_from_engine(mgr, conn, ["x1", "y"], e_cached=["z"])
    assert a.p_local == {"A": 4, "B": 9} and a.p_local_freeable == {"B"}
    assert a.p_external == {"x1"} and a.e_cached == {"z"}
    with pytest.raises(ValueError, match="has_cache_item"):
        availability_from_engine(None, object(), ["x"])


def test_demand_for_request_stand_ins():
    req = types.SimpleNamespace(
        mm_features=[feature("A", 0, 16), feature("B", 20, 8)], num_tokens=40
    )
    mgr = types.SimpleNamespace(cached={"B": {"r"}}, num_embeds_by_hash={"B": 8})
    res = demand_for_request(req, 16, encoder_cache_manager=mgr)
    assert [d.klass for d in res.decisions] == [Klass.KV_COVERED, Klass.P_LOCAL] and res.skip_e


@pytest.mark.oracle
def test_adapter_on_real_vllm_objects():
    py, _ = require_oracle()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [str(py), str(Path(__file__).parent / "vllm_adapter_check.py")],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["classes"] == ["KV_COVERED", "P_LOCAL", "P_EXTERNAL", "P_LOCAL", "E_COMPUTE"]
    assert got["num_embeds"] == [16, 10, 10, 6, 5]
    assert got["evictable"] == [False, False, False, True, False]
    assert got["e_demand"] == [["E", True]] and got["p_loads"] == ["C"]
    assert got["p_local_reuse"] == ["B", "F"]
    assert got["p_local"] == {"B": 10, "F": 6} and got["freeable"] == ["F"]
    assert got["p_external"] == ["C"]


# ---- hostile input (issue #11) -----------------------------------------------------------


@pytest.mark.parametrize(
    "manager",
    [
        {},
        "encoder-cache",
        object(),
        types.SimpleNamespace(cached={}),  # no num_embeds_by_hash
        types.SimpleNamespace(cached=["A"], num_embeds_by_hash={"A": 1}),
    ],
    ids=["dict", "str", "object", "no-counts", "cached-list"],
)
def test_a_wrong_encoder_cache_manager_is_not_read_as_empty(manager):
    with pytest.raises(InvalidArgumentType, match=r"^encoder_cache_manager must be vLLM's"):
        availability_from_engine(manager)
    req = types.SimpleNamespace(mm_features=[feature("A", 0, 4)], num_tokens=8)
    with pytest.raises(InvalidArgumentType, match=r"^encoder_cache_manager"):
        demand_for_request(req, 0, encoder_cache_manager=manager)


def test_encoder_cache_contents_are_checked():
    for counts, cls, match in (
        ({}, InvalidArgument, r"num_embeds_by_hash\['A'\] is missing"),
        ({"A": "3"}, InvalidArgumentType, r"num_embeds_by_hash\['A'\] must be an int, got str"),
        ({"A": 0}, InvalidArgument, r"num_embeds_by_hash\['A'\] must be >= 1, got 0"),
    ):
        mgr = types.SimpleNamespace(cached={"A": set()}, num_embeds_by_hash=counts)
        with pytest.raises(cls, match="^encoder_cache_manager." + match):
            availability_from_engine(mgr)


def test_encoder_decoder_cache_manager_keeps_no_reusable_cache():
    class EncoderCacheManager:
        pass

    class EncoderDecoderCacheManager(EncoderCacheManager):  # vLLM's: no `cached` at all
        def __init__(self):
            self.cache_size = 8

    assert availability_from_engine(EncoderDecoderCacheManager()).p_local == {}


@pytest.mark.parametrize("answer", [1, 0, "yes", None, [True]])
def test_a_non_bool_has_cache_item_is_not_trusted(answer):
    conn = types.SimpleNamespace(has_cache_item=lambda ident: answer)
    with pytest.raises(
        InvalidArgumentType, match=r"^ec_connector.has_cache_item\('img-1'\) must be a bool, got "
    ):
        availability_from_engine(None, conn, ["img-1"])


def test_identifiers_are_strs():
    conn = types.SimpleNamespace(has_cache_item=lambda ident: True)
    with pytest.raises(InvalidArgumentType, match=r"^identifiers\[1\] must be a str, got int 7"):
        availability_from_engine(None, conn, ["a", 7])
    with pytest.raises(InvalidArgumentType, match=r"^identifiers must be an iterable"):
        availability_from_engine(None, conn, 7)
    assert availability_from_engine(None, conn, (i for i in ["a"])).p_external == {"a"}


# ---- from_render: vLLM's /v1/chat/completions/render body (mm_payload "none") --------------


def _render(token_ids, hashes, places, **extra):
    """The shape vLLM 0.33's render returns (GenerateRequest.features = MultiModalFeatures)."""
    return {
        "request_id": "chatcmpl-1",
        "token_ids": token_ids,
        "features": {
            "mm_hashes": hashes,
            "mm_placeholders": {
                m: [{"offset": o, "length": n} for o, n in r] for m, r in places.items()
            },
            "kwargs_data": None,
            "mm_metadata": None,
        },
        "cache_salt": None,
        **extra,
    }


PAD, VPAD = 268, 269


def test_from_render_gives_vllms_order_and_identifiers():
    tokens = [1] * 97 + [PAD] * 16 + [2] * 14 + [PAD] * 16 + [3] * 31
    body = _render(tokens, {"image": ["img-red2", "img-green2"]}, {"image": [(97, 16), (127, 16)]})
    out = from_render(body)
    assert out.token_ids == tuple(tokens) and out.cache_salt is None
    assert [(m.identifier, m.offset, m.length, m.is_embed) for m in out.occurrences] == [
        ("img-red2", 97, 16, None),
        ("img-green2", 127, 16, None),
    ]
    # the same blocks as hashing the request directly
    h = BlockHasher("sha256", 32, seed="0")
    direct = [MMOccurrence("img-red2", 97, 16), MMOccurrence("img-green2", 127, 16)]
    assert h.hash_prompt(list(out.token_ids), mm=list(out.occurrences)) == h.hash_prompt(
        tokens, mm=direct
    )


def test_from_render_sorts_across_modalities_by_offset():
    tokens = [0] * 40
    body = _render(
        tokens,
        {"audio": ["a0"], "image": ["i0", "i1"]},
        {"audio": [(20, 4)], "image": [(30, 2), (5, 3)]},
    )
    out = from_render(body, dense_modalities={"image", "audio"})
    assert [(m.identifier, m.modality) for m in out.occurrences] == [
        ("i1", "image"),
        ("a0", "audio"),
        ("i0", "image"),
    ]


def test_from_render_sparse_modality_needs_its_embed_token():
    tokens = [5] * 10 + [VPAD, VPAD, 7, VPAD, VPAD, 8] + [5] * 4
    body = _render(tokens, {"video": ["v0"]}, {"video": [(10, 6)]}, cache_salt="t")
    with pytest.raises(InvalidArgument, match="is_embed"):
        from_render(body)
    occ = from_render(body, embed_token_ids={"video": VPAD}).occurrences[0]
    assert occ.is_embed == (True, True, False, True, True, False) and occ.num_embeds == 4
    assert from_render(body, embed_token_ids={"video": VPAD}).cache_salt == "t"


def test_from_render_text_only_and_model_objects():
    assert from_render({"token_ids": [1, 2, 3], "features": None}).occurrences == ()

    class Model:  # a pydantic GenerateRequest stand-in
        def model_dump(self):
            return _render([0] * 8, {"image": ["x"]}, {"image": [(2, 4)]})

    assert from_render(Model()).occurrences[0].identifier == "x"


@pytest.mark.parametrize(
    "body,cls,match",
    [
        ("not a body", InvalidArgumentType, "render"),
        ({"token_ids": "123"}, InvalidArgumentType, "token_ids"),
        ({"token_ids": [1, -2]}, InvalidArgument, r"token_ids\[1\]"),
        ({"token_ids": [1, True]}, InvalidArgumentType, r"token_ids\[1\]"),
        (
            _render([0] * 8, {"image": ["x", "y"]}, {"image": [(0, 2)]}),
            InvalidArgument,
            "2 mm_hashes",
        ),
        (_render([0] * 8, {"image": ["x"]}, {"image": [(6, 4)]}), InvalidArgument, "past the 8"),
        (_render([0] * 8, {"image": [""]}, {"image": [(0, 2)]}), InvalidArgument, "mm_hashes"),
        (_render([0] * 8, {"image": ["x"]}, {"image": [(0, 0)]}), InvalidArgument, "length"),
        (_render([0] * 8, {"video": ["x"]}, {"image": [(0, 2)]}), InvalidArgument, "modalities"),
        ({"token_ids": [1], "cache_salt": 5}, InvalidArgumentType, "cache_salt"),
    ],
)
def test_from_render_refuses(body, cls, match):
    with pytest.raises(cls, match=match):
        from_render(body)


@pytest.mark.parametrize(
    "body",
    [
        _render([0] * 8, {"image": ["x"]}, {"image": [(2, 4)]}),
        _render(
            list(range(300, 340)),
            {"image": ["a", "b"], "audio": ["c"]},
            {"image": [(0, 4), (20, 4)], "audio": [(10, 3)]},
        ),
        {"token_ids": [5, 6, 7], "cache_salt": "tenant"},
        {"token_ids": []},
    ],
)
def test_from_render_json_equals_from_render(body):
    import json

    assert from_render_json(json.dumps(body).encode()) == from_render(body)


@pytest.mark.parametrize(
    "payload,cls,match",
    [
        (b'{"token_ids": [1, -2]}', InvalidArgument, r"token_ids\[1\]"),
        (b'{"token_ids": [1, true]}', InvalidArgument, r"token_ids\[1\]"),
        (b'{"token_ids": [1, 2.5]}', InvalidArgument, r"token_ids\[1\]"),
        (b'{"token_ids": [9223372036854775808]}', InvalidArgument, r"token_ids\[0\]"),
        (b'{"token_ids": "123"}', InvalidArgument, "token_ids"),
        (b'{"features": {}}', InvalidArgument, "token_ids"),
        (b'{"token_ids": [1, 2', InvalidArgument, "not JSON"),
        (b"[1, 2]", InvalidArgument, "object"),
        (b'{"token_ids": [1], "cache_salt": 5}', InvalidArgument, "cache_salt"),
        ("a str", InvalidArgumentType, "payload"),
    ],
)
def test_from_render_json_refuses(payload, cls, match):
    with pytest.raises(cls, match=match):
        from_render_json(payload)

"""mmreuse.render: vLLM's render answer (`/v1/chat/completions/render`, mm_payload "none") and
the body that asks for it."""

import pytest

from mmreuse import BlockHasher, MMOccurrence
from mmreuse.errors import InvalidArgument, InvalidArgumentType
from mmreuse.identity import RequestIdentity
from mmreuse.render import RENDER_PATH, RenderedPrompt, from_render, from_render_json, render_body

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


# ---- render_body: the render request for a chat request ---------------------------------------


def test_render_body_strips_streaming_and_connector_handles():
    request = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": {"do_remote_prefill": True},
        "ec_transfer_params": {"ec_items": {}},
        "cache_salt": "t",
    }
    body = render_body(request)
    assert body == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "cache_salt": "t",
        "mm_payload": "none",
    }
    assert "stream" in request and "mm_payload" not in request  # the client's body is untouched
    assert RENDER_PATH == "/v1/chat/completions/render"
    with pytest.raises(InvalidArgumentType, match=r"^request must be a chat request body"):
        render_body([("model", "m")])


# ---- the request's identity: salt from render, LoRA from the caller ----------------------------


def test_rendered_identity_carries_the_salt_and_a_lora():
    body = {"token_ids": list(range(40)), "features": None, "cache_salt": "tenant-a"}
    r = from_render(body)
    assert r.identity == RequestIdentity(cache_salt="tenant-a") and r.cache_salt == "tenant-a"
    assert from_render({"token_ids": [1, 2]}).identity == RequestIdentity()
    lora = r.with_identity(RequestIdentity("tenant-a", "sql-lora", "/adapters/sql"))
    assert lora.identity.lora_name == "sql-lora" and lora.cache_salt == "tenant-a"
    h = BlockHasher("sha256", 16, seed="0")
    tokens = list(r.token_ids)
    assert h.hash_prompt(tokens, **lora.identity.hash_kwargs()) == h.hash_prompt(
        tokens, cache_salt="tenant-a", lora_name="sql-lora", lora_path="/adapters/sql"
    )
    # the adapter keys every block: an adapter request is never planned on the base's blocks
    base = h.hash_prompt(tokens, **r.identity.hash_kwargs())
    assert not set(base) & set(h.hash_prompt(tokens, **lora.identity.hash_kwargs()))
    with pytest.raises(InvalidArgumentType, match=r"^identity must be a RequestIdentity"):
        r.with_identity("tenant-a")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lora_path": "/x"}, r"^lora_path='/x' given without lora_name"),
        ({"lora_int_id": 3}, r"^lora_int_id=3 given without lora_name"),
        ({"lora_name": ""}, r"^lora_name"),
        ({"cache_salt": 7}, r"^cache_salt"),
        ({"lora_name": "a", "lora_int_id": 0}, r"^lora_int_id"),
    ],
)
def test_identity_refuses(kwargs, match):
    with pytest.raises((InvalidArgument, InvalidArgumentType), match=match):
        RequestIdentity(**kwargs)


def test_rendered_prompt_equality_keeps_occurrences():
    occ = MMOccurrence("img", 1, 4)
    assert RenderedPrompt((0,) * 6, (occ,)) == RenderedPrompt((0,) * 6, (occ,), RequestIdentity())

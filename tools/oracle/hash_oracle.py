#!/usr/bin/env python3
"""Block hashes from the real vLLM (0.33.0, 0.34.0), for checking mmreuse against it.

Runs inside an oracle venv that tools/oracle/setup.sh builds (one per vLLM version). It hashes nothing itself: for
each case it builds a real `EngineCoreRequest`, sends it through vLLM's msgpack wire (as the
API server does to the engine core; `"wire": false` skips that), seeds `NONE_HASH` with vLLM's
`init_none_hash` under the case's PYTHONHASHSEED, and lets `Request.from_engine_core_request`
with `get_request_block_hasher` hash the prompt, then `append_output_token_ids` hash each step.

    hash_oracle.py CASE.json | -          one case object (or a JSON list of them) -> result(s)
    hash_oracle.py --jsonl                 one case per stdin line -> one result per line
    hash_oracle.py --debug ...             adds each block's parent, extra keys and preimage
    hash_oracle.py --none-hash FN [SEED]   vLLM's NONE_HASH (no SEED: PYTHONHASHSEED unset)
    hash_oracle.py --self-test             what setup.sh runs

Library use (same venv): `sys.path.insert(0, "<repo>/tools/oracle"); import hash_oracle`, then
`hash_oracle.compute(case)`; `vllm_api()` gives the vLLM classes for scripts that build their own
requests. tests/support/strategies.py generates cases; tests/data/vllm-0.33.0-vectors.json holds some.

A case (JSON object; defaults after `=`; "id", "description", "tags", "group", "expected" are
ignored, any other key is an error):
    hash_fn = "sha256"    sha256 | sha256_cbor | xxhash | xxhash_cbor
    seed = null           PYTHONHASHSEED as a string; null = unset (not with xxhash*: vLLM then
                          draws a random NONE_HASH seed)
    block_size = 16, lookahead = 0
    tokens                the whole sequence; null only for a pure prompt-embeds prompt
    steps = null          [prompt length, size of each later append...]; the rest comes last
    mm = []               [{"identifier", "offset", "length", "is_embed": null | [bool]*length,
                            "modality": "image", "mm_hash": null}]
    lora = null           {"name", "path" (non-empty), "int_id": 1}
    cache_salt = null
    prompt_embeds = null  {"data": [[float]]} or {"rows", "dim", "seed"}, + "dtype": float32 |
                          float16 | bfloat16; rows = the prompt length (see Embeds.tensor)
    prompt_is_token_ids = null   a bool per prompt position (needs tokens and prompt_embeds)
    wire = true
The answer: {"hashes": [hex], "none_hash", "num_blocks", "vllm_version"}, see `compute`; in
--jsonl mode a failed case answers {"error": "..."}.
Exit status: 2 for a malformed case, 1 when vLLM refuses a case (e.g. a token id the msgpack
wire cannot carry).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import cache
from typing import Any

VLLM_VERSIONS = ("0.33.0", "0.34.0")  # the oracle venvs tools/oracle/setup.sh builds
HASH_FNS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DTYPES = ("float32", "float16", "bfloat16")
CASE_FIELDS = frozenset(
    {
        "hash_fn",
        "seed",
        "block_size",
        "lookahead",
        "tokens",
        "mm",
        "lora",
        "cache_salt",
        "prompt_embeds",
        "prompt_is_token_ids",
        "steps",
        "wire",
    }
)
IGNORED_FIELDS = frozenset({"id", "description", "tags", "group", "expected"})
MM_FIELDS = frozenset({"identifier", "offset", "length", "is_embed", "modality", "mm_hash"})
LORA_FIELDS = frozenset({"name", "path", "int_id"})
EMBEDS_FIELDS = frozenset({"data", "rows", "dim", "seed", "dtype"})


class CaseError(ValueError):
    """A case that is malformed, or that asks for something vLLM cannot reproduce."""


# ---- vLLM ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VllmApi:
    """The vLLM modules and classes the oracles use, imported once (about 10 s)."""

    torch: Any
    vllm: Any
    kcu: Any  # vllm.v1.core.kv_cache_utils
    hashing: Any  # vllm.utils.hashing
    Request: Any
    EngineCoreRequest: Any
    MultiModalFeatureSpec: Any
    PlaceholderRange: Any
    LoRARequest: Any
    SamplingParams: Any
    encoder: Any  # MsgpackEncoder()
    decoder: Any  # MsgpackDecoder(EngineCoreRequest)

    def wire(self, request: Any) -> Any:
        """The request as the engine core receives it: through vLLM's msgpack encoder/decoder."""
        return self.decoder.decode(self.encoder.encode(request))


@cache
def vllm_api() -> VllmApi:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import vllm
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils import hashing
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    if vllm.__version__ not in VLLM_VERSIONS:
        print(
            f"hash_oracle: warning: vllm {vllm.__version__} imported, the oracle is for "
            f"{', '.join(VLLM_VERSIONS)}",
            file=sys.stderr,
        )
    return VllmApi(
        torch=torch,
        vllm=vllm,
        kcu=kv_cache_utils,
        hashing=hashing,
        Request=Request,
        EngineCoreRequest=EngineCoreRequest,
        MultiModalFeatureSpec=MultiModalFeatureSpec,
        PlaceholderRange=PlaceholderRange,
        LoRARequest=LoRARequest,
        SamplingParams=SamplingParams,
        encoder=MsgpackEncoder(),
        decoder=MsgpackDecoder(EngineCoreRequest),
    )


# ---- the case -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placeholder:
    """One multimodal item: vLLM hashes `identifier` and `offset`, nothing else here."""

    identifier: str
    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None
    modality: str = "image"
    mm_hash: str | None = None


@dataclass(frozen=True, slots=True)
class Lora:
    name: str
    path: str  # LoRARequest requires a non-empty path
    int_id: int = 1  # not hashed by 0.33.0


@dataclass(frozen=True, slots=True)
class Embeds:
    """Prompt embeddings: explicit `data` rows, or `rows` x `dim` seeded values (see `tensor`)."""

    rows: int
    dim: int
    data: tuple[tuple[float, ...], ...] | None = None
    seed: int = 0
    dtype: str = "float32"

    def tensor(self) -> Any:
        """Seeded values are exact in float32: x_k = (((seed*1000003 + k*2654435761) mod 2**32)
        >> 16) / 256 - 128, row-major for k < rows*dim; then cast to `dtype`."""
        torch = vllm_api().torch
        if self.data is not None:
            t = torch.tensor([list(r) for r in self.data], dtype=torch.float32)
        else:
            k = torch.arange(self.rows * self.dim, dtype=torch.int64)
            u = ((self.seed * 1000003 + k * 2654435761) % 2**32) >> 16
            t = (u.to(torch.float32) / 256 - 128).reshape(self.rows, self.dim)
        return t.to(getattr(torch, self.dtype)).contiguous()


@dataclass(frozen=True, slots=True)
class Case:
    """One request to hash. `tokens` is the whole sequence (prompt and later tokens); null only
    for a pure prompt-embeds prompt. `steps` = [prompt length, then the size of each append]
    (a remainder is appended last). `seed` is the PYTHONHASHSEED string, None = unset."""

    hash_fn: str = "sha256"
    seed: str | None = None
    block_size: int = 16
    lookahead: int = 0
    tokens: tuple[int, ...] | None = ()
    mm: tuple[Placeholder, ...] = ()
    lora: Lora | None = None
    cache_salt: str | None = None
    prompt_embeds: Embeds | None = None
    prompt_is_token_ids: tuple[bool, ...] | None = None
    steps: tuple[int, ...] | None = None
    wire: bool = True

    @property
    def num_tokens(self) -> int:
        """The whole sequence's length (a pure prompt-embeds prompt: its rows)."""
        if self.tokens is None:
            assert self.prompt_embeds is not None
            return self.prompt_embeds.rows
        return len(self.tokens)

    @property
    def prompt_len(self) -> int:
        return self.steps[0] if self.steps else self.num_tokens

    def chunks(self, steps: tuple[int, ...] | None) -> Iterator[list[int]]:
        """The token chunks appended after a prompt of steps[0] tokens."""
        if self.tokens is None or not steps:
            return
        pos = steps[0]
        sizes = list(steps[1:])
        if sum(steps) < len(self.tokens):
            sizes.append(len(self.tokens) - sum(steps))
        for n in sizes:
            yield list(self.tokens[pos : pos + n])
            pos += n


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _fields(obj: object, where: str, allowed: frozenset[str]) -> dict:
    if not isinstance(obj, dict):
        raise CaseError(f"{where} must be a JSON object, got {obj!r:.80}")
    unknown = set(obj) - allowed
    if unknown:
        raise CaseError(f"{where}: unknown keys {sorted(unknown)} (allowed: {sorted(allowed)})")
    return obj


def _int(x: object, where: str, low: int | None = None) -> int:
    if not _is_int(x) or (low is not None and x < low):  # type: ignore[operator]
        bound = "" if low is None else f" >= {low}"
        raise CaseError(f"{where} must be an int{bound}, got {x!r:.80}")
    return x  # type: ignore[return-value]


def _str(x: object, where: str, nullable: bool = False) -> Any:
    if (x is None and nullable) or isinstance(x, str):
        return x
    raise CaseError(f"{where} must be a string{' or null' if nullable else ''}, got {x!r:.80}")


def _bools(x: object, where: str, n: int) -> tuple[bool, ...]:
    if not isinstance(x, list) or len(x) != n or not all(isinstance(b, bool) for b in x):
        raise CaseError(f"{where} must be a list of {n} bools, got {x!r:.80}")
    return tuple(x)


def _placeholder(obj: object, where: str) -> Placeholder:
    f = _fields(obj, where, MM_FIELDS)
    length = _int(f.get("length"), f"{where}.length")
    mask = f.get("is_embed")
    return Placeholder(
        identifier=_str(f.get("identifier"), f"{where}.identifier"),
        offset=_int(f.get("offset"), f"{where}.offset"),
        length=length,
        is_embed=None if mask is None else _bools(mask, f"{where}.is_embed", length),
        modality=_str(f.get("modality", "image"), f"{where}.modality"),
        mm_hash=_str(f.get("mm_hash"), f"{where}.mm_hash", nullable=True),
    )


def _lora(obj: object) -> Lora:
    f = _fields(obj, "lora", LORA_FIELDS)
    path = _str(f.get("path"), "lora.path")
    if not path:
        raise CaseError("lora.path must be non-empty (vLLM's LoRARequest asserts it)")
    return Lora(
        name=_str(f.get("name"), "lora.name"),
        path=path,
        int_id=_int(f.get("int_id", 1), "lora.int_id", 1),
    )


def _embeds(obj: object) -> Embeds:
    f = _fields(obj, "prompt_embeds", EMBEDS_FIELDS)
    dtype = f.get("dtype", "float32")
    if dtype not in DTYPES:
        raise CaseError(f"prompt_embeds.dtype must be one of {DTYPES}, got {dtype!r}")
    data = f.get("data")
    if data is not None:
        ok = (
            isinstance(data, list)
            and data
            and all(
                isinstance(r, list)
                and r
                and len(r) == len(data[0])
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in r)
                for r in data
            )
        )
        if not ok:
            raise CaseError(
                f"prompt_embeds.data must be a non-empty 2-D list of numbers, got {data!r:.80}"
            )
        return Embeds(
            rows=len(data), dim=len(data[0]), data=tuple(tuple(r) for r in data), dtype=dtype
        )
    return Embeds(
        rows=_int(f.get("rows"), "prompt_embeds.rows", 1),
        dim=_int(f.get("dim"), "prompt_embeds.dim", 1),
        seed=_int(f.get("seed"), "prompt_embeds.seed"),
        dtype=dtype,
    )


def parse_case(obj: object) -> Case:
    """Check a case (the JSON schema of `Case`) and fill its defaults."""
    f = _fields(obj, "case", CASE_FIELDS | IGNORED_FIELDS)
    f = json.loads(json.dumps(f))  # fresh objects, as json.loads gives them to the CLI
    hash_fn = f.get("hash_fn", "sha256")
    if hash_fn not in HASH_FNS:
        raise CaseError(f"hash_fn must be one of {HASH_FNS}, got {hash_fn!r}")
    seed = _str(f.get("seed"), "seed", nullable=True)
    if seed is None and hash_fn.startswith("xxhash"):
        raise CaseError(
            f"seed null with {hash_fn}: vLLM 0.33.0 then seeds NONE_HASH from "
            "os.urandom, so the hashes cannot be reproduced"
        )
    embeds = None if f.get("prompt_embeds") is None else _embeds(f["prompt_embeds"])
    tokens = f.get("tokens")
    if tokens is None:
        if embeds is None:
            raise CaseError("tokens may be null only with prompt_embeds")
    elif not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise CaseError(f"tokens must be a list of ints or null, got {tokens!r:.80}")
    steps = f.get("steps")
    if steps is not None:
        if tokens is None:
            raise CaseError("steps need tokens (a pure prompt-embeds prompt has no steps)")
        if (
            not isinstance(steps, list)
            or not steps
            or not all(_is_int(s) and s >= 0 for s in steps)
        ):
            raise CaseError(f"steps must be a non-empty list of ints >= 0, got {steps!r:.80}")
        if sum(steps) > len(tokens):
            raise CaseError(f"steps add up to {sum(steps)}, more than the {len(tokens)} tokens")
    case = Case(
        hash_fn=hash_fn,
        seed=seed,
        block_size=_int(f.get("block_size", 16), "block_size", 1),
        lookahead=_int(0 if f.get("lookahead") is None else f["lookahead"], "lookahead", 0),
        tokens=None if tokens is None else tuple(tokens),
        mm=tuple(_placeholder(m, f"mm[{i}]") for i, m in enumerate(_mm_list(f.get("mm")))),
        lora=None if f.get("lora") is None else _lora(f["lora"]),
        cache_salt=_str(f.get("cache_salt"), "cache_salt", nullable=True),
        prompt_embeds=embeds,
        steps=None if steps is None else tuple(steps),
        wire=f.get("wire", True),
    )
    if not isinstance(case.wire, bool):
        raise CaseError(f"wire must be true or false, got {case.wire!r}")
    if embeds is not None and embeds.rows != case.prompt_len:
        raise CaseError(
            f"prompt_embeds has {embeds.rows} rows but the prompt has {case.prompt_len} tokens"
        )
    mask = f.get("prompt_is_token_ids")
    if mask is not None:
        if embeds is None or tokens is None:
            raise CaseError("prompt_is_token_ids needs both prompt_embeds and tokens")
        case = replace(
            case, prompt_is_token_ids=_bools(mask, "prompt_is_token_ids", case.prompt_len)
        )
    return case


def _mm_list(mm: object) -> list:
    if mm is None:
        return []
    if not isinstance(mm, list):
        raise CaseError(f"mm must be a list or null, got {mm!r:.80}")
    return mm


# ---- vLLM's answer ------------------------------------------------------------------------


def wire_tokens(tokens: Any) -> Any:
    """Prompt token ids as vLLM's frontend sends them: a list up to 0.33, an int32 numpy array
    from 0.34 on (its `EngineCoreRequest.prompt_token_ids` is an ndarray on the wire; an id
    outside int32 raises OverflowError there, as in vLLM's own `Request`)."""
    V = vllm_api()
    if "ndarray" not in str(V.EngineCoreRequest.__annotations__.get("prompt_token_ids", "")):
        return list(tokens)
    import numpy as np

    return np.asarray(list(tokens), dtype=np.int32)


def engine_core_request(case: Case, prompt_len: int | None = None) -> tuple[Any, Any]:
    """The case's first `prompt_len` tokens (default: its prompt) as a real EngineCoreRequest,
    and its prompt-embeds tensor (or None)."""
    V = vllm_api()
    torch = V.torch
    n = case.prompt_len if prompt_len is None else prompt_len
    features = [
        V.MultiModalFeatureSpec(
            data=None,
            modality=p.modality,
            identifier=p.identifier,
            mm_hash=p.mm_hash,
            mm_position=V.PlaceholderRange(
                offset=p.offset,
                length=p.length,
                is_embed=None if p.is_embed is None else torch.tensor(p.is_embed, dtype=torch.bool),
            ),
        )
        for p in case.mm
    ]
    lora = (
        None
        if case.lora is None
        else V.LoRARequest(
            lora_name=case.lora.name, lora_int_id=case.lora.int_id, lora_path=case.lora.path
        )
    )
    embeds = None if case.prompt_embeds is None else case.prompt_embeds.tensor()
    request = V.EngineCoreRequest(
        request_id="oracle",
        prompt_token_ids=None if case.tokens is None else wire_tokens(case.tokens[:n]),
        mm_features=features or None,
        sampling_params=V.SamplingParams(max_tokens=1 << 20),
        pooling_params=None,
        arrival_time=0.0,
        lora_request=lora,
        cache_salt=case.cache_salt,
        data_parallel_rank=None,
        prompt_embeds=embeds,
        prompt_is_token_ids=None
        if case.prompt_is_token_ids is None
        else list(case.prompt_is_token_ids),
    )
    return request, embeds


def _set_hash_seed(value: str | None) -> None:
    if value is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = value


@contextmanager
def hash_seed(seed: str | None) -> Iterator[None]:
    """PYTHONHASHSEED = seed (None: unset) in os.environ, where init_none_hash reads it."""
    saved = os.environ.get("PYTHONHASHSEED")
    _set_hash_seed(seed)
    try:
        yield
    finally:
        _set_hash_seed(saved)


def init_none_hash(hash_fn: str, seed: str | None) -> bytes:
    """Run vLLM's init_none_hash under PYTHONHASHSEED = seed; return its NONE_HASH."""
    V = vllm_api()
    with hash_seed(seed):
        V.kcu.init_none_hash(V.hashing.get_hash_fn_by_name(hash_fn))
    return bytes(V.kcu.NONE_HASH)


def none_hash(hash_fn: str, seed: str | None) -> str:
    """NONE_HASH as hex, with a case's checks on hash_fn and seed."""
    parse_case({"hash_fn": hash_fn, "seed": seed, "tokens": []})
    return init_none_hash(hash_fn, seed).hex()


def block_hashes(
    case: Case, steps: tuple[int, ...] | None, record: list | None = None
) -> list[bytes]:
    """request.block_hashes after vLLM hashed the prompt (steps[0] tokens, or all) and each
    appended chunk. `record` collects every (object, digest) vLLM's hasher asked for."""
    V = vllm_api()
    fn = V.hashing.get_hash_fn_by_name(case.hash_fn)
    hash_fn = fn
    if record is not None:

        def hash_fn(obj: Any) -> bytes:
            digest = fn(obj)
            record.append((obj, digest))
            return digest

    request, _ = engine_core_request(case, steps[0] if steps else case.num_tokens)
    if case.wire:
        request = V.wire(request)
    hasher = V.kcu.get_request_block_hasher(case.block_size, hash_fn, case.lookahead)
    req = V.Request.from_engine_core_request(request, block_hasher=hasher)
    for chunk in case.chunks(steps):
        if not chunk:
            req.update_block_hashes()
        else:  # one token is a decode step (an int), more a list
            req.append_output_token_ids(chunk[0] if len(chunk) == 1 else chunk)
    return [bytes(h) for h in req.block_hashes]


def preimage(hash_fn: str, obj: Any) -> bytes:
    """The bytes vLLM's hash function `hash_fn` digests for `obj` (vllm/utils/hashing.py)."""
    if hash_fn.endswith("_cbor"):
        import cbor2

        return cbor2.dumps(obj, canonical=True)
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _digest(hash_fn: str, data: bytes) -> bytes:
    if hash_fn.startswith("sha256"):
        return hashlib.sha256(data).digest()
    import xxhash

    return xxhash.xxh3_128_digest(data)


def _jsonable(x: Any) -> Any:
    """Extra keys as JSON: tuples become lists, lists {"$list": [...]}, bytes {"$bytes": hex}."""
    if isinstance(x, (bytes, bytearray, memoryview)):
        return {"$bytes": bytes(x).hex()}
    if isinstance(x, tuple):
        return [_jsonable(e) for e in x]
    if isinstance(x, list):
        return {"$list": [_jsonable(e) for e in x]}
    return x


def compute(case: dict, debug: bool = False) -> dict:
    """One case through vLLM: {"hashes", "none_hash", "num_blocks", "vllm_version"}, plus
    "prompt_embeds_sha256" with embeddings, "matches_one_shot" with steps (the incremental
    hashes equal those of the whole sequence at once) and, with debug, "blocks"."""
    c = parse_case(case)
    V = vllm_api()
    with hash_seed(c.seed):
        V.kcu.init_none_hash(V.hashing.get_hash_fn_by_name(c.hash_fn))
        record: list | None = [] if debug else None
        hashes = block_hashes(c, c.steps, record)
        out: dict[str, Any] = {
            "hashes": [h.hex() for h in hashes],
            "none_hash": bytes(V.kcu.NONE_HASH).hex(),
            "num_blocks": len(hashes),
            "vllm_version": V.vllm.__version__,
        }
        if c.prompt_embeds is not None:
            raw = c.prompt_embeds.tensor().view(V.torch.uint8).numpy().tobytes()
            out["prompt_embeds_sha256"] = hashlib.sha256(raw).hexdigest()
        if c.steps is not None:
            # all at once; with embeddings the prompt is fixed, so the rest comes in one chunk
            one_shot = None if c.prompt_embeds is None else c.steps[:1]
            out["matches_one_shot"] = block_hashes(c, one_shot) == hashes
        if record is not None:
            out["blocks"] = [_block_view(c.hash_fn, obj, digest) for obj, digest in record]
    return out


def _block_view(hash_fn: str, obj: Any, digest: bytes) -> dict:
    parent, tokens, extra_keys = obj
    pre = preimage(hash_fn, obj)
    return {
        "parent": bytes(parent).hex(),
        "tokens_len": len(tokens),
        "extra_keys": _jsonable(extra_keys),
        "preimage": pre.hex(),
        "preimage_verified": _digest(hash_fn, pre) == digest,
    }


# ---- self-test ----------------------------------------------------------------------------

# Hashes vLLM 0.33.0 gave for this case (one image across two 16-token blocks), cross-checked
# against plain hashlib + pickle of the objects vLLM hashed when this oracle was written.
SELF_TEST_CASE = {
    "hash_fn": "sha256",
    "seed": "0",
    "block_size": 16,
    "tokens": list(range(40)),
    "mm": [{"identifier": "abc", "offset": 5, "length": 20}],
}
SELF_TEST_HASHES = [
    "c73af69b387c325055ea9967ed44d81b74c8c5618356c680af5ad9ee31ced2a8",
    "d6fe1ca38058dbdd9a2a8fc837a34db0557b6b32f621da108cc4267bf60ba2a4",
]


def self_test() -> list[str]:
    """What does not hold (empty: all good)."""
    problems = []

    def expect(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    def seed_hash(seed: str) -> str:
        return hashlib.sha256(pickle.dumps(seed, protocol=pickle.HIGHEST_PROTOCOL)).hexdigest()

    expect(
        none_hash("sha256", None) == seed_hash("vllm-none-hash"),
        "NONE_HASH with PYTHONHASHSEED unset is not sha256(pickle('vllm-none-hash'))",
    )
    r = compute(SELF_TEST_CASE, debug=True)
    expect(r["none_hash"] == seed_hash("0"), "NONE_HASH for seed '0'")
    expect(r["hashes"] == SELF_TEST_HASHES, f"pinned hashes: got {r['hashes']}")
    expect(
        [b["parent"] for b in r["blocks"]] == [r["none_hash"], *r["hashes"][:-1]],
        "blocks do not chain from NONE_HASH",
    )
    expect(all(b["preimage_verified"] for b in r["blocks"]), "preimages do not re-hash")
    no_wire = compute({**SELF_TEST_CASE, "wire": False})
    expect(no_wire["hashes"] == r["hashes"], "hashes differ without the msgpack wire")
    stepped = compute({**SELF_TEST_CASE, "steps": [7, 1, 20]})
    expect(
        stepped["hashes"] == r["hashes"] and stepped["matches_one_shot"] is True,
        "incremental hashes differ from one-shot",
    )
    for fn in HASH_FNS[1:]:
        other = compute({**SELF_TEST_CASE, "hash_fn": fn}, debug=True)
        expect(
            other["num_blocks"] == 2 and all(b["preimage_verified"] for b in other["blocks"]),
            f"{fn}: preimages do not re-hash",
        )
    expect(
        compute({"tokens": None, "prompt_embeds": {"rows": 16, "dim": 2, "seed": 1}})["num_blocks"]
        == 1,
        "a pure prompt-embeds prompt",
    )
    try:
        compute({**SELF_TEST_CASE, "nonsense": 1})
        problems.append("an unknown case key was accepted")
    except CaseError:
        pass
    return problems


# ---- CLI ----------------------------------------------------------------------------------


def _error(e: Exception) -> dict:
    return {"error": f"{type(e).__name__}: {e}"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hash_oracle.py", description=__doc__.splitlines()[0])
    ap.add_argument("input", nargs="?", help="a case JSON file (an object or a list), - = stdin")
    ap.add_argument("--jsonl", action="store_true", help="serve: one case per stdin line")
    ap.add_argument("--debug", action="store_true", help="add per-block parent/extra keys/preimage")
    ap.add_argument("--none-hash", nargs="+", metavar=("FN", "SEED"), help="print vLLM's NONE_HASH")
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--indent", type=int, default=None, help="indent the JSON output")
    a = ap.parse_args(argv)
    if a.self_test:
        problems = self_test()
        for p in problems:
            print(f"hash_oracle self-test: FAILED: {p}", file=sys.stderr)
        print(
            f"hash_oracle self-test {'FAILED' if problems else 'OK'} "
            f"(vllm {vllm_api().vllm.__version__})"
        )
        return 1 if problems else 0
    if a.none_hash:
        if len(a.none_hash) > 2:
            ap.error("--none-hash takes FN and at most one SEED")
        fn, seed = a.none_hash[0], (a.none_hash[1:] or [None])[0]
        try:
            print(json.dumps({"hash_fn": fn, "seed": seed, "none_hash": none_hash(fn, seed)}))
        except CaseError as e:
            print(f"hash_oracle: {e}", file=sys.stderr)
            return 2
        return 0
    if a.jsonl:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                out = compute(json.loads(line), debug=a.debug)
            except Exception as e:  # answer every line; the client decides
                out = _error(e)
            sys.stdout.write(json.dumps(out) + "\n")
            sys.stdout.flush()
        return 0
    if not a.input:
        ap.print_usage(sys.stderr)
        return 2
    try:
        if a.input == "-":
            data = json.load(sys.stdin)
        else:
            with open(a.input) as fh:
                data = json.load(fh)
        out = (
            [compute(x, a.debug) for x in data]
            if isinstance(data, list)
            else compute(data, a.debug)
        )
    except (CaseError, json.JSONDecodeError) as e:
        print(f"hash_oracle: bad case: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # vLLM refused it, e.g. OverflowError on the msgpack wire
        print(f"hash_oracle: vLLM refused the case: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=a.indent))
    return 0


if __name__ == "__main__":
    sys.exit(main())

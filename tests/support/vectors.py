"""Turn an oracle case (the schema of tools/oracle/hash_oracle.py) into BlockHasher arguments."""

from __future__ import annotations

import json
from contextlib import contextmanager
from functools import cache

import torch

from mmreuse import BlockHasher, MMOccurrence

from .paths import DATA


@contextmanager
def token_writer(simd: bool):
    """Run the C++ fast path with its AVX-512 token writer on or off (off: the portable one)."""
    from mmreuse import _hashcore

    before = _hashcore.set_simd(simd)
    try:
        yield
    finally:
        _hashcore.set_simd(before)


@cache
def load_vectors(name: str) -> dict:
    return json.loads((DATA / name).read_text())


def seeded_embeds(rows: int, dim: int, seed: int, dtype: str = "float32") -> torch.Tensor:
    """The oracle's seeded embeddings: values exact in float32, then cast to dtype."""
    k = torch.arange(rows * dim, dtype=torch.int64)
    x = (((seed * 1000003 + k * 2654435761) % 2**32) >> 16).to(torch.float32) / 256 - 128
    return x.reshape(rows, dim).to(getattr(torch, dtype))


def case_embeds(spec: dict | None) -> torch.Tensor | None:
    if spec is None:
        return None
    dtype = spec.get("dtype", "float32")
    if "data" in spec:
        return torch.tensor(spec["data"], dtype=torch.float32).to(getattr(torch, dtype))
    return seeded_embeds(spec["rows"], spec["dim"], spec["seed"], dtype)


def case_tokens(case: dict) -> list[int]:
    """vLLM's all_token_ids for the case (zeros for embedding positions)."""
    tokens = case.get("tokens")
    embeds = case.get("prompt_embeds")
    if tokens is None:
        rows = case_embeds(embeds).shape[0]
        steps = case.get("steps")
        total = sum(steps) if steps else rows
        return [0] * total
    mask = case.get("prompt_is_token_ids")
    if mask is not None:
        n = len(mask)
        return [t if ok else 0 for t, ok in zip(tokens[:n], mask, strict=False)] + list(tokens[n:])
    return list(tokens)


def case_hasher(case: dict, scheme: str = "vllm-0.33", **kw) -> BlockHasher:
    return BlockHasher(
        case.get("hash_fn", "sha256"),
        case.get("block_size", 16),
        seed=case.get("seed"),
        lookahead=case.get("lookahead", 0),
        scheme=scheme,
        allow_any_token_id=True,
        **kw,
    )


def case_request(case: dict) -> dict:
    mm = [
        MMOccurrence(
            m["identifier"],
            m["offset"],
            m["length"],
            is_embed=m.get("is_embed"),
            modality=m.get("modality") or "image",
        )
        for m in case.get("mm") or []
    ]
    lora = case.get("lora")
    return {
        "mm": mm,
        "lora_name": lora["name"] if lora else None,
        "lora_path": lora.get("path") if lora else None,
        "lora_int_id": lora.get("int_id", 1) if lora else None,
        "cache_salt": case.get("cache_salt"),
        "prompt_embeds": case_embeds(case.get("prompt_embeds")),
    }


def hash_case(case: dict, scheme: str = "vllm-0.33", incremental: bool = True, **kw) -> list[str]:
    """Hex block hashes of the case, following its `steps` when incremental."""
    hasher = case_hasher(case, scheme, **kw)
    tokens = case_tokens(case)
    req = case_request(case)
    steps = case.get("steps")
    if steps and any(m.end > steps[0] for m in req["mm"]):
        # The oracle lets placeholders run past the prompt; mmreuse refuses that (a real vLLM
        # prompt holds its placeholders), so such cases are checked one-shot only.
        incremental = False
    if not incremental or not steps:
        return [h.hex() for h in hasher.hash_prompt(tokens, **req)]
    state = hasher.request(tokens[: steps[0]], **req)
    pos = steps[0]
    for n in steps[1:]:
        state.append_output_token_ids(tokens[pos : pos + n])
        pos += n
    if pos < len(tokens):
        state.append_output_token_ids(tokens[pos:])
    return [h.hex() for h in state.block_hashes]

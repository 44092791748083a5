"""Make block-hash test vectors for mmreuse's older hash schemes with the real older vLLM code.

For each (scheme, vLLM version) below it downloads the released wheel (`pip download --no-deps
vllm==X`, cached in ~/.cache/mmreuse/wheels), extracts vLLM's own hashing code from it
(vllm/v1/core/kv_cache_utils.py, the hash functions, get_mm_features_in_window, tensor_data),
executes those functions unchanged, and runs them on random requests through a stand-in
`Request` that carries exactly the attributes the hasher reads (the same calls vLLM's Request
makes: the hasher runs at construction and after each append). Strings come from json.loads, so
object identity (which pickle's memo sees) is as after vLLM's msgpack wire.

    python tools/make_scheme_vectors.py            # writes tests/data/vllm-<X>-scheme-vectors.json

Needs torch, cbor2 and xxhash (the project's venv has them). Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import ast
import bisect
import hashlib
import json
import os
import pickle
import random
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NewType, Optional, Union, overload

import torch

REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MMREUSE_WHEEL_CACHE", Path.home() / ".cache/mmreuse/wheels"))

# (scheme, vLLM version whose code makes the vectors, hash functions that version offers)
TARGETS = [
    ("vllm-0.33", "0.31.0", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
    ("vllm-0.30", "0.30.0", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
    ("vllm-0.28", "0.19.0", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
    ("vllm-0.18", "0.17.0", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
    ("vllm-0.11", "0.11.1", ("sha256", "sha256_cbor")),
    ("vllm-0.11", "0.16.0", ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")),
    ("vllm-0.10", "0.11.0", ("sha256", "sha256_cbor")),
]
# Schemes whose NONE_HASH for an unset seed is reproducible (sha256*: "vllm-none-hash").
DEFAULT_SEED_SCHEMES = {"vllm-0.33", "vllm-0.30"}
NO_EMBEDS = {"vllm-0.10"}
LORA_BY_INT_ID = {"vllm-0.10"}

KV_NAMES = {
    "DEFAULT_NONE_HASH_SEED",
    "_NON_CRYPTO_HASH_FUNCTIONS",
    "_CBOR_HASH_FUNCTIONS",
    "_NONE_HASH_SEED",
    "resolve_none_hash_seed",
    "init_none_hash",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "hash_block_tokens",
    "get_request_block_hasher",
}
WANTED_FILES = [
    "vllm/v1/core/kv_cache_utils.py",
    "vllm/utils/hashing.py",
    "vllm/utils/__init__.py",
    "vllm/multimodal/utils.py",
    "vllm/v1/utils.py",
]


def wheel_for(version: str) -> Path:
    CACHE.mkdir(parents=True, exist_ok=True)
    found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    if not found:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                f"vllm=={version}",
                "-d",
                str(CACHE),
            ],
            check=True,
        )
        found = sorted(CACHE.glob(f"vllm-{version}-*.whl"))
    return found[0]


def extract_sources(version: str) -> tuple[dict[str, str], str]:
    """The wanted source files of the wheel, and the wheel's sha256."""
    src_dir = CACHE / f"hashsrc-{version}"
    meta = src_dir / "wheel.sha256"
    if not meta.exists():
        whl = wheel_for(version)
        src_dir.mkdir(parents=True, exist_ok=True)
        with zipfile.ZipFile(whl) as z:
            names = set(z.namelist())
            for f in WANTED_FILES:
                if f in names:
                    (src_dir / f.replace("/", "__")).write_bytes(z.read(f))
        meta.write_text(hashlib.sha256(whl.read_bytes()).hexdigest())
    out = {}
    for f in WANTED_FILES:
        p = src_dir / f.replace("/", "__")
        if p.exists():
            out[f] = p.read_text()
    return out, meta.read_text().strip()


def top_level(source: str, names: set[str]) -> str:
    """The source of the named top-level definitions and assignments, in file order."""
    out = []
    for node in ast.parse(source).body:
        name = getattr(node, "name", None)
        if name is None and isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = getattr(target, "id", None)
        if name in names:
            out.append(ast.unparse(node))
    return "from __future__ import annotations\n" + "\n\n".join(out)


class _Logger:
    def warning(self, *a, **k):
        pass

    info = debug = warning_once = info_once = warning


def load_vllm_hashing(version: str) -> tuple[dict[str, Any], str]:
    """vLLM `version`'s own hashing functions, executed from the wheel's source."""
    src, wheel_sha = extract_sources(version)
    import cbor2

    ns: dict[str, Any] = dict(
        Any=Any,
        Callable=Callable,
        Optional=Optional,
        Union=Union,
        Sequence=Sequence,
        Iterable=Iterable,
        Iterator=Iterator,
        overload=overload,
        NewType=NewType,
        BlockHash=lambda x: x,
        os=os,
        hashlib=hashlib,
        pickle=pickle,
        bisect=bisect,
        logger=_Logger(),
        Request=object,
        cbor2=cbor2,
        torch=torch,
    )
    if "vllm/utils/hashing.py" in src:
        hns: dict[str, Any] = {"__name__": "vllm_hashing"}
        exec(compile(src["vllm/utils/hashing.py"], "hashing.py", "exec"), hns)
    else:
        hns = dict(ns)
        exec(
            top_level(
                src["vllm/utils/__init__.py"], {"sha256", "sha256_cbor", "get_hash_fn_by_name"}
            ),
            hns,
        )
    for k in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "get_hash_fn_by_name"):
        if k in hns:
            ns[k] = hns[k]
    if "vllm/multimodal/utils.py" in src:
        exec(top_level(src["vllm/multimodal/utils.py"], {"get_mm_features_in_window"}), ns)
    if "vllm/v1/utils.py" in src:
        exec(top_level(src["vllm/v1/utils.py"], {"tensor_data"}), ns)
    exec(top_level(src["vllm/v1/core/kv_cache_utils.py"], KV_NAMES), ns)
    return ns, wheel_sha


class _Pos:
    def __init__(self, offset, length, is_embed):
        self.offset, self.length, self.is_embed = offset, length, is_embed


class _Feature:
    def __init__(self, f):
        self.identifier = f["identifier"]
        self.modality = f.get("modality", "image")
        self.mm_position = _Pos(f["offset"], f["length"], None)


class _Lora:
    def __init__(self, d):
        self.lora_name, self.lora_path, self.lora_int_id = d["name"], d["path"], d["int_id"]


class StandInRequest:
    """The attributes vLLM's hasher reads from a Request, updated as Request does."""

    def __init__(self, case: dict, prompt_len: int, hasher, embeds):
        self._all_token_ids = list(case["tokens"][:prompt_len])
        self.mm_features = [_Feature(f) for f in case.get("mm") or []]
        self.mm_hashes = [f.identifier for f in self.mm_features]  # <= 0.10.2 read these
        self.mm_positions = [f.mm_position for f in self.mm_features]
        self.lora_request = _Lora(case["lora"]) if case.get("lora") else None
        self.cache_salt = case.get("cache_salt")
        self.prompt_embeds = embeds
        self._prompt_embeds_per_block_hashes: dict = {}
        self.block_hashes: list = []
        self._hasher = hasher
        self.block_hashes.extend(hasher(self))

    @property
    def num_tokens(self):
        return len(self._all_token_ids)

    @property
    def all_token_ids(self):
        return self._all_token_ids

    def append_output_token_ids(self, tokens):
        self._all_token_ids.extend(tokens)
        self.block_hashes.extend(self._hasher(self))


def seeded_embeds(rows: int, dim: int, seed: int, dtype: str) -> torch.Tensor:
    k = torch.arange(rows * dim, dtype=torch.int64)
    x = (((seed * 1000003 + k * 2654435761) % 2**32) >> 16).to(torch.float32) / 256 - 128
    return x.reshape(rows, dim).to(getattr(torch, dtype))


def vllm_hashes(ns: dict, case: dict) -> tuple[list[str], str]:
    seed = case["seed"]
    saved = os.environ.get("PYTHONHASHSEED")
    try:
        if seed is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = seed
        fn = ns["get_hash_fn_by_name"](case["hash_fn"])
        ns["init_none_hash"](fn)
        none_hash = ns["NONE_HASH"]
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    hasher = ns["get_request_block_hasher"](case["block_size"], fn)
    steps = case.get("steps") or [len(case["tokens"])]
    pe = case.get("prompt_embeds")
    embeds = seeded_embeds(pe["rows"], pe["dim"], pe["seed"], pe["dtype"]) if pe else None
    c = json.loads(json.dumps(case))  # fresh string objects, as off vLLM's wire
    req = StandInRequest(c, steps[0], hasher, embeds)
    pos = steps[0]
    for n in steps[1:]:
        req.append_output_token_ids(c["tokens"][pos : pos + n])
        pos += n
    if pos < len(c["tokens"]):
        req.append_output_token_ids(c["tokens"][pos:])
    return [bytes(h).hex() for h in req.block_hashes], bytes(none_hash).hex()


IDENTIFIERS = [
    "0cf457e24a479f02fd4d34540389f720f0807dcff92a7562108165b2637ea82f",
    "5a0717cb6596468ea1dffa86011f9b0f497348d80421835b51799f9aeb455642",
    "a",
    "b",
    "é",
    "ā",
    "img",
    "x" * 300,
]


def random_case(rng: random.Random, scheme: str, fns: Sequence[str]) -> dict:
    fn = rng.choice(fns)
    seeds = ["0", "42", "12345", "random", ""]
    if scheme in DEFAULT_SEED_SCHEMES and fn.startswith("sha256"):
        seeds.append(None)
    bs = rng.choice([1, 2, 3, 4, 7, 16, 16, 16, 32, 64])
    n = rng.randrange(0, 400)
    tokens = [
        rng.randrange(2**63)
        if rng.random() < 0.03
        else rng.choice([rng.randrange(256), rng.randrange(65536), rng.randrange(152000)])
        for _ in range(n)
    ]
    steps = None
    prompt_len = n
    if n and rng.random() < 0.4:
        prompt_len = rng.randrange(0, n + 1)
        steps, rest = [prompt_len], n - prompt_len
        while rest > 0:
            k = min(rest, rng.choice([1, 1, 2, 5, 16, 33]))
            steps.append(k)
            rest -= k
    mm, pos = [], 0
    for _ in range(rng.randrange(0, 7)):
        pos += rng.choice([0, 0, 1, 3, 16, 17, 40])
        length = rng.choice([1, 2, 5, 15, 16, 17, 33, 64])
        if pos + length > prompt_len:
            break
        mm.append({"identifier": rng.choice(IDENTIFIERS), "offset": pos, "length": length})
        tokens[pos : pos + length] = [151655] * length
        pos += length
    case: dict[str, Any] = {
        "hash_fn": fn,
        "seed": rng.choice(seeds),
        "block_size": bs,
        "lookahead": 0,
        "tokens": tokens,
    }
    if mm:
        case["mm"] = mm
    if steps:
        case["steps"] = steps
    if rng.random() < 0.3:
        case["lora"] = {
            "name": rng.choice(["L1", "a", "adapter-ü", "img"]),
            "path": rng.choice(["/p", "/loras/a"]),
            "int_id": rng.randrange(1, 99),
        }
    if rng.random() < 0.3:
        case["cache_salt"] = rng.choice(["", "s", "a", "salt", "tenant-ü"])
    if scheme not in NO_EMBEDS and prompt_len and rng.random() < 0.15:
        case["prompt_embeds"] = {
            "rows": prompt_len,
            "dim": rng.randrange(1, 9),
            "seed": rng.randrange(100),
            "dtype": rng.choice(["float32", "bfloat16", "float16"]),
        }
    return case


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=250, help="random cases per vLLM version")
    ap.add_argument("--seed", type=int, default=20261130)
    ap.add_argument("--out", type=Path, default=REPO / "tests/data")
    args = ap.parse_args()
    for scheme, version, fns in TARGETS:
        ns, wheel_sha = load_vllm_hashing(version)
        rng = random.Random(f"{args.seed}-{version}")
        vectors = []
        for i in range(args.count):
            case = random_case(rng, scheme, fns)
            hashes, none_hash = vllm_hashes(ns, case)
            vectors.append(
                {
                    "id": f"random/{i}",
                    "case": case,
                    "expected": {"hashes": hashes, "none_hash": none_hash},
                }
            )
        doc = {
            "format": "mmreuse-scheme-vectors/1",
            "scheme": scheme,
            "vllm_version": version,
            "wheel_sha256": wheel_sha,
            "random_seed": args.seed,
            "made_by": "tools/make_scheme_vectors.py",
            "vectors": vectors,
        }
        path = args.out / f"vllm-{version}-scheme-vectors.json"
        path.write_text(json.dumps(doc, separators=(",", ":")) + "\n")
        print(f"{path.relative_to(REPO)}: {len(vectors)} vectors ({scheme}, vLLM {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

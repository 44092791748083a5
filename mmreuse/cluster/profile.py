"""The model profiles the CPU cluster serves: the tiny one the fast test tiers use, and a
serving-shape one whose images are hundreds to thousands of tokens.

A profile is the random-weight model's architecture and sizes (Qwen2-VL, or Qwen2.5-VL, whose
ViT attends within windows in all but a few blocks, so that its cost grows linearly with an
image's tokens as on the GPU deployments the figures come from; both with Qwen2-VL's
image-processor rules: patch 14, merge 2, a token is 28x28 pixels) and how its servers run
(dtype, context length, KV cache, which core each role is bound to). `tiny` turns a photograph into 4-16 tokens
on a 1-block, 64-wide ViT: fast, but its stage costs are nothing like a GPU deployment's.
`serving` keeps the photographs' own sizes (256-1,280 tokens, as ServeGen's mm-image traffic:
median 405, p90 1,224) and sizes the ViT and the LM so that, on this 2-core bed, encoding an
image costs several times rendering it and prefill per token is of the order of encode per
token, as on a GPU (BENCHMARKS.md, "Stage costs of the serving profile").
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InvalidArgument
from ..validate import check_int
from .netshape import StoreLink

__all__ = ["ARCHITECTURES", "PROFILES", "SERVING", "TINY", "ModelProfile", "get_profile"]

ARCHITECTURES = {  # model_type -> the class vLLM and transformers build
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
}
DTYPES = ("bfloat16", "float32")
TOKEN_PIXELS = 28 * 28  # Qwen2-VL: a 14-pixel patch, 2x2 patches merged into one token
# Qwen2-VL-7B's M-RoPE split of a 128-wide head (temporal, height, width); a profile's head
# keeps its proportions (it must sum to head_dim / 2)
_MROPE_7B = (16, 24, 24)


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """One model and how its servers run.

    `architecture`: a key of ARCHITECTURES; `dtype`: the weights' and activations' (bfloat16 is
    slow on a CPU without AVX-512 BF16; float32 runs alike on every machine kind here). LM:
    `hidden` wide, `layers` deep, `heads` query heads over `kv_heads` KV heads, `intermediate`
    MLP width. ViT: `vit_depth` blocks of `vit_width` with `vit_heads` heads and an MLP
    `vit_mlp_ratio` times wide (Qwen2.5-VL: full attention in the blocks `vit_full_blocks`,
    windows of 112 pixels elsewhere); its merger emits `hidden`-wide embeddings (an image's embedding is
    tokens x hidden values of `dtype`). Images are resized into
    [`min_pixels`, `max_pixels`] (Qwen2-VL's smart_resize). Servers: `max_model_len` tokens of
    context, `kv_cache_gib` GiB of KV cache (vLLM-CPU's VLLM_CPU_KVCACHE_SPACE), and
    `bind_cores`: E's and P's OpenMP threads each on a core of their own (E on the first, P
    on the last) instead of vLLM-CPU's `nobind`. `store_link`: the pace of the embedding
    store's traffic that keeps transfer / encode at a GPU deployment's on this bed (applied
    where asked: `Cluster(store_link=...)`, in a network namespace of its own).
    """

    name: str
    architecture: str
    dtype: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vit_depth: int
    vit_width: int
    vit_heads: int
    vit_mlp_ratio: int
    vit_full_blocks: tuple[int, ...]
    min_pixels: int
    max_pixels: int
    max_model_len: int
    kv_cache_gib: int
    bind_cores: bool
    store_link: StoreLink | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"name must be a non-empty string, got {self.name!r}")
        if self.architecture not in ARCHITECTURES:
            raise InvalidArgument(
                f"architecture must be one of {sorted(ARCHITECTURES)}, got {self.architecture!r}"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        for field in ("hidden", "layers", "heads", "kv_heads", "intermediate"):
            check_int(field, getattr(self, field), 1)
        for field in ("vit_depth", "vit_width", "vit_heads", "vit_mlp_ratio"):
            check_int(field, getattr(self, field), 1)
        check_int("min_pixels", self.min_pixels, TOKEN_PIXELS)
        check_int("max_pixels", self.max_pixels, self.min_pixels)
        check_int("max_model_len", self.max_model_len, 1)
        check_int("kv_cache_gib", self.kv_cache_gib, 1)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise InvalidArgument(
                f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}), and heads "
                f"of kv_heads ({self.kv_heads})"
            )
        if self.head_dim % 32:  # the CPU attention backend's head sizes, and M-RoPE's split
            raise InvalidArgument(
                f"hidden / heads must be a multiple of 32, got {self.hidden}/{self.heads}"
            )
        if self.vit_width % self.vit_heads:
            raise InvalidArgument(
                f"vit_width ({self.vit_width}) must be a multiple of vit_heads ({self.vit_heads})"
            )
        blocks = self.vit_full_blocks
        if (
            not isinstance(blocks, tuple)
            or any(type(b) is not int or not 0 <= b < self.vit_depth for b in blocks)
            or list(blocks) != sorted(set(blocks))
        ):
            raise InvalidArgument(
                "vit_full_blocks must be a sorted tuple of distinct block indexes in "
                f"[0, {self.vit_depth}), got {blocks!r}"
            )
        if blocks and self.architecture != "qwen2_5_vl":
            raise InvalidArgument(
                f"vit_full_blocks is Qwen2.5-VL's (Qwen2-VL attends in full in every block), "
                f"got {blocks!r} for {self.architecture!r}"
            )
        if not isinstance(self.bind_cores, bool):
            raise InvalidArgument(f"bind_cores must be a bool, got {self.bind_cores!r}")
        if self.store_link is not None and not isinstance(self.store_link, StoreLink):
            raise InvalidArgument(
                f"store_link must be a StoreLink or None, got {self.store_link!r}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def mrope_section(self) -> tuple[int, int, int]:
        """Qwen2-VL-7B's M-RoPE split, scaled to this head (sums to head_dim / 2)."""
        t, h, w = (x * self.head_dim // 128 for x in _MROPE_7B)
        return t, h, w

    @property
    def min_image_tokens(self) -> int:
        return self.min_pixels // TOKEN_PIXELS

    @property
    def max_image_tokens(self) -> int:
        return self.max_pixels // TOKEN_PIXELS

    def embedding_bytes(self, tokens: int) -> int:
        """The bytes of an item's embedding of `tokens` tokens (`dtype`'s values)."""
        return (2 if self.dtype == "bfloat16" else 4) * self.hidden * tokens


TINY = ModelProfile(
    name="tiny",
    architecture="qwen2_vl",
    dtype="bfloat16",
    hidden=128,
    layers=2,
    heads=2,  # head_dim 64: a size the CPU attention backend supports
    kv_heads=1,
    intermediate=256,
    vit_depth=1,
    vit_width=64,
    vit_heads=2,
    vit_mlp_ratio=2,
    vit_full_blocks=(),  # Qwen2-VL: every block attends over the whole image
    min_pixels=56 * 56,  # 4 tokens
    max_pixels=112 * 112,  # 16 tokens
    max_model_len=4096,
    kv_cache_gib=1,
    bind_cores=False,
)

SERVING = ModelProfile(
    name="serving",
    architecture="qwen2_5_vl",
    dtype="float32",
    hidden=512,
    layers=4,
    heads=8,
    kv_heads=2,
    intermediate=1536,
    vit_depth=2,
    vit_width=256,
    vit_heads=4,
    vit_mlp_ratio=4,
    # No full-attention block: Qwen2.5-VL-7B attends in full in 4 of 32 blocks (~15 % of its
    # encode at 1080p); one full block of 2 at this width is over half of this ViT's at 1,280
    # tokens (encode / render 2.3x a GPU's there), none keeps the cost linear in tokens.
    vit_full_blocks=(),
    min_pixels=256 * TOKEN_PIXELS,
    max_pixels=1280 * TOKEN_PIXELS,
    max_model_len=16384,
    kv_cache_gib=1,
    bind_cores=True,
    # A GPU deployment moves 7,168 bytes an image token (Qwen2.5-VL-7B, bf16) at 694 MiB/s
    # into the store and 912 MiB/s out of it (vLLM #47302): 0.16 and 0.13 of its encode (62 us a
    # token, #41267). This profile's 2,048 bytes a token, at ~0.85 ms a token of encode here,
    # keep those proportions at these rates.
    store_link=StoreLink(put_mibps=14.5, get_mibps=18.2),
)

PROFILES: dict[str, ModelProfile] = {p.name: p for p in (TINY, SERVING)}


def get_profile(name: str) -> ModelProfile:
    """The profile called `name`; InvalidArgument naming the choices otherwise."""
    profile = PROFILES.get(name) if isinstance(name, str) else None
    if profile is None:
        raise InvalidArgument(f"profile must be one of {sorted(PROFILES)}, got {name!r}")
    return profile

"""Typed wrappers over the residency torch ops (`torch.ops.mmreuse.*`), with fake kernels.

The ops live in the `mmreuse._C` extension, imported exactly once here (loading the same
TORCH_LIBRARY namespace twice aborts the process). Bitmap: int32 words, bit (id % 32) of
word id // 32 per block; generations: int64 per block; block ids: int64.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import _C  # noqa: F401  (registers torch.ops.mmreuse)

_ops = torch.ops.mmreuse


def residency_mark(bitmap: Tensor, block_ids: Tensor, num_blocks: int) -> None:
    """Set the residency bits of `block_ids` (in place, on bitmap's stream/device)."""
    _ops.residency_mark.default(bitmap, block_ids, num_blocks)


def residency_evict(bitmap: Tensor, generations: Tensor, block_ids: Tensor) -> None:
    """Clear the bits of `block_ids` and bump their generations (once per occurrence)."""
    _ops.residency_evict.default(bitmap, generations, block_ids)


def residency_test(bitmap: Tensor, block_ids: Tensor, num_blocks: int) -> Tensor:
    """Bool tensor: is each of `block_ids` resident?"""
    return _ops.residency_test.default(bitmap, block_ids, num_blocks)


def residency_count(bitmap: Tensor) -> Tensor:
    """int64 scalar tensor: the number of resident blocks."""
    return _ops.residency_count.default(bitmap)


def residency_prefix(bitmap: Tensor, block_ids: Tensor, num_blocks: int) -> Tensor:
    """int64 scalar tensor: length of the leading resident run of the chain `block_ids`."""
    return _ops.residency_prefix.default(bitmap, block_ids, num_blocks)


def residency_validate(
    bitmap: Tensor, generations: Tensor, block_ids: Tensor, expected: Tensor
) -> Tensor:
    """Bool tensor: is each of `block_ids` resident with its generation equal to `expected`?"""
    return _ops.residency_validate.default(bitmap, generations, block_ids, expected)


def _same_device(op: str, bitmap: Tensor, **others: Tensor) -> None:
    """Mixed devices must raise: dispatch would otherwise pick one device's kernel (a `meta`
    tensor picks these fakes) and silently skip the real work, bounds checks included."""
    for name, t in others.items():
        torch._check(
            t.device == bitmap.device,
            lambda name=name, t=t: f"{op}: bitmap on {bitmap.device} but {name} on {t.device}",
        )


@torch.library.register_fake("mmreuse::residency_mark")
def _(bitmap, block_ids, num_blocks):
    _same_device("residency_mark", bitmap, block_ids=block_ids)
    torch._check(bitmap.dtype == torch.int32 and block_ids.dtype == torch.int64)
    return None


@torch.library.register_fake("mmreuse::residency_evict")
def _(bitmap, generations, block_ids):
    _same_device("residency_evict", bitmap, generations=generations, block_ids=block_ids)
    torch._check(generations.dtype == torch.int64 and block_ids.dtype == torch.int64)
    return None


@torch.library.register_fake("mmreuse::residency_test")
def _(bitmap, block_ids, num_blocks):
    _same_device("residency_test", bitmap, block_ids=block_ids)
    torch._check(block_ids.dim() == 1)
    return block_ids.new_empty(block_ids.shape, dtype=torch.bool)


@torch.library.register_fake("mmreuse::residency_count")
def _(bitmap):
    return bitmap.new_empty((), dtype=torch.int64)


@torch.library.register_fake("mmreuse::residency_prefix")
def _(bitmap, block_ids, num_blocks):
    _same_device("residency_prefix", bitmap, block_ids=block_ids)
    return block_ids.new_empty((), dtype=torch.int64)


@torch.library.register_fake("mmreuse::residency_validate")
def _(bitmap, generations, block_ids, expected):
    _same_device(
        "residency_validate",
        bitmap,
        generations=generations,
        block_ids=block_ids,
        expected=expected,
    )
    torch._check(expected.shape == block_ids.shape)
    return block_ids.new_empty(block_ids.shape, dtype=torch.bool)

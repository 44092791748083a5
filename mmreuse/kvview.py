"""The KV view: what any source of "which prefix blocks does P hold" answers.

`BlockIndex` (P's own residency, with ABA-safe proofs) and `RemoteKVIndex` (P followed through
its KV events) both implement `KVView`, so `mmreuse.plan` composes either the same way. Modelled
on SGLang's `BasePrefixCache.match_prefix`: one call, the leading run of blocks held, and what
backs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from .blockhash import ExternalBlockHash

__all__ = ["KVView", "PrefixMatch"]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The leading blocks of a request a view holds.

    Attributes:
        num_blocks: how many leading block hashes are held.
        proof: a `mmreuse.residency.CoverageProof` for those blocks when the view can give one
            (`BlockIndex`), else None (an event-fed view knows hashes, not block generations).
    """

    num_blocks: int
    proof: Any = None


@runtime_checkable
class KVView(Protocol):
    """A Prefill instance's prefix cache, as some observer sees it."""

    def match_prefix(self, block_hashes: Sequence[ExternalBlockHash]) -> PrefixMatch:
        """The leading run of `block_hashes` held, in the order given."""
        ...

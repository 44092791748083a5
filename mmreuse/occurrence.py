"""Multimodal occurrences: one item placed at one position of a prompt.

`MMOccurrence` is the library's single occurrence type: the hasher keys KV blocks
with it, and `compute_demand` decides per occurrence whether the encoder must run.
It mirrors vLLM's `MultiModalFeatureSpec` (`identifier`, `mm_position.offset`,
`.length`, `.is_embed`, `modality`) without importing vLLM.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidArgument, InvalidArgumentType
from .validate import check_int, check_str, fail_type


def _normalize_mask(mask: Any, length: int) -> tuple[bool, ...] | None:
    if mask is None:
        return None
    if hasattr(mask, "tolist"):  # torch / numpy bool tensors, as vLLM stores them
        mask = mask.tolist()
    if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence):
        fail_type("is_embed", "a sequence of bools or None", mask)
    out = []
    for i, flag in enumerate(mask):
        if not isinstance(flag, bool):
            fail_type(f"is_embed[{i}]", "a bool", flag)
        out.append(flag)
    if len(out) != length:
        raise InvalidArgument(f"is_embed has {len(out)} entries but length is {length}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class MMOccurrence:
    """One multimodal item at one place in a prompt.

    Attributes:
        identifier: what vLLM hashes for the item (`MultiModalFeatureSpec.identifier`:
            the processor's mm_hash, or "<lora_name>:<mm_hash>" with tower-connector LoRA).
        offset: index of the first placeholder token in the prompt.
        length: number of placeholder tokens (>= 1).
        is_embed: per placeholder position, whether it receives an encoder embedding;
            None means every position does.
        modality: "image", "audio", "video", ... (not hashed by vLLM).
    """

    identifier: str
    offset: int
    length: int
    is_embed: tuple[bool, ...] | None = None
    modality: str = "image"
    # Derived once, read on hot paths (compute_demand, the simulator):
    # offsets (relative to `offset`) of the embed positions, ascending, None when all are;
    _embed_offsets: tuple[int, ...] | None = field(init=False, repr=False, compare=False)
    # offset + length; the embed count; the absolute position of the last embed (None: none).
    _end: int = field(init=False, repr=False, compare=False)
    _num_embeds: int = field(init=False, repr=False, compare=False)
    _last_embed: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_str("identifier", self.identifier)
        object.__setattr__(self, "offset", check_int("offset", self.offset, 0))
        object.__setattr__(self, "length", check_int("length", self.length, 1))
        mask = _normalize_mask(self.is_embed, self.length)
        object.__setattr__(self, "is_embed", mask)
        offs = None if mask is None else tuple(j for j, e in enumerate(mask) if e)
        object.__setattr__(self, "_embed_offsets", offs)
        object.__setattr__(self, "_end", self.offset + self.length)
        object.__setattr__(self, "_num_embeds", self.length if offs is None else len(offs))
        last = self._end - 1 if offs is None else (self.offset + offs[-1] if offs else None)
        object.__setattr__(self, "_last_embed", last)
        check_str("modality", self.modality, nonempty=True)

    @property
    def end(self) -> int:
        """One past the last placeholder position."""
        return self._end

    @property
    def num_embeds(self) -> int:
        """How many encoder embeddings the item feeds into the prompt (vLLM's get_num_embeds)."""
        return self._num_embeds

    @property
    def last_embed_pos(self) -> int | None:
        """Absolute position of the last embed, None when the item has none."""
        return self._last_embed

    def embeds_from(self, pos: int) -> tuple[int, int | None]:
        """(number of embed positions >= pos, the first of them or None)."""
        rel = pos - self.offset
        offs = self._embed_offsets
        if offs is None:
            k = min(max(rel, 0), self.length)
            return self.length - k, (self.offset + k if k < self.length else None)
        k = bisect.bisect_left(offs, rel)
        return len(offs) - k, (self.offset + offs[k] if k < len(offs) else None)

    @classmethod
    def from_vllm(cls, feature: Any) -> MMOccurrence:
        """Build from a vLLM `MultiModalFeatureSpec` (duck-typed: no vLLM import)."""
        try:
            pos = feature.mm_position
            return cls(
                identifier=feature.identifier,
                offset=pos.offset,
                length=pos.length,
                is_embed=getattr(pos, "is_embed", None),
                modality=getattr(feature, "modality", None) or "image",
            )
        except AttributeError as exc:
            raise InvalidArgumentType(
                f"feature must look like vLLM's MultiModalFeatureSpec "
                f"(identifier, mm_position.offset/length): {exc}"
            ) from exc

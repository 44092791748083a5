"""Multimodal occurrences: one item placed at one position of a prompt.

`MMOccurrence` is the library's single occurrence type: the hasher keys KV blocks
with it, and `compute_demand` decides per occurrence whether the encoder must run.
It mirrors vLLM's `MultiModalFeatureSpec` (`identifier`, `mm_position.offset`,
`.length`, `.is_embed`, `modality`) without importing vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def _check_int(field: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{field} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{field} must be >= {minimum}, got {value}")
    return value


def _normalize_mask(mask: Any, length: int) -> tuple[bool, ...] | None:
    if mask is None:
        return None
    if hasattr(mask, "tolist"):  # torch / numpy bool tensors, as vLLM stores them
        mask = mask.tolist()
    if isinstance(mask, (str, bytes)) or not isinstance(mask, Sequence):
        raise ValueError(f"is_embed must be a sequence of bools or None, got {type(mask).__name__}")
    out = []
    for i, flag in enumerate(mask):
        if not isinstance(flag, bool):
            raise ValueError(f"is_embed[{i}] must be a bool, got {flag!r}")
        out.append(flag)
    if len(out) != length:
        raise ValueError(f"is_embed has {len(out)} entries but length is {length}")
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

    def __post_init__(self) -> None:
        if not isinstance(self.identifier, str):
            raise ValueError(f"identifier must be a str, got {self.identifier!r}")
        _check_int("offset", self.offset, 0)
        _check_int("length", self.length, 1)
        object.__setattr__(self, "is_embed", _normalize_mask(self.is_embed, self.length))
        if not isinstance(self.modality, str) or not self.modality:
            raise ValueError(f"modality must be a non-empty str, got {self.modality!r}")

    @property
    def end(self) -> int:
        """One past the last placeholder position."""
        return self.offset + self.length

    @property
    def num_embeds(self) -> int:
        """How many encoder embeddings the item feeds into the prompt."""
        return self.length if self.is_embed is None else sum(self.is_embed)

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
            raise ValueError(
                f"feature must look like vLLM's MultiModalFeatureSpec "
                f"(identifier, mm_position.offset/length): {exc}"
            ) from exc

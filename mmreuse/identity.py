"""What keys a request's blocks besides its tokens and media: its cache salt and LoRA adapter.

vLLM puts both into the block-hash extra keys (`("lora", name, path)`, `("cache_salt", salt)` on
block 0), so two requests with the same prompt share KV only if they share an identity. One
`RequestIdentity` travels from render to hashing to the plan and into the demand query, so no
path can hash a request as another tenant's, or an adapter's request as the base model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import InvalidArgument
from .validate import check_int, check_str, show

__all__ = ["BASE", "RequestIdentity"]


@dataclass(frozen=True, slots=True)
class RequestIdentity:
    """A request's cache salt and LoRA adapter (None: none).

    Attributes:
        cache_salt: the request's `cache_salt` (vLLM keys block 0 with it).
        lora_name: the adapter's name (`LoRARequest.lora_name`; the request's `model` when it
            names an adapter).
        lora_path: the adapter's path (`LoRARequest.lora_path`; vLLM >= 0.31 hashes it).
        lora_int_id: the adapter's int id (vLLM 0.10 hashes it instead of the name).
    """

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    lora_int_id: int | None = None

    def __post_init__(self) -> None:
        if self.cache_salt is not None:
            check_str("cache_salt", self.cache_salt)
        if self.lora_name is None:
            extra = [
                f"{k}={show(v)}"
                for k, v in (("lora_path", self.lora_path), ("lora_int_id", self.lora_int_id))
                if v is not None
            ]
            if extra:
                raise InvalidArgument(f"{', '.join(extra)} given without lora_name")
            return
        check_str("lora_name", self.lora_name, nonempty=True)
        if self.lora_path is not None:
            check_str("lora_path", self.lora_path)
        if self.lora_int_id is not None:
            check_int("lora_int_id", self.lora_int_id, 1)

    @property
    def has_lora(self) -> bool:
        return self.lora_name is not None

    def hash_kwargs(self) -> dict[str, Any]:
        """The keywords `BlockHasher.hash_prompt` / `.request` take for this identity."""
        return {
            "cache_salt": self.cache_salt,
            "lora_name": self.lora_name,
            "lora_path": self.lora_path,
            "lora_int_id": self.lora_int_id,
        }


BASE = RequestIdentity()  # no salt, the base model

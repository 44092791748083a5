"""`HeldReferences`: E's metadata for the items the proxy had encoded, so that a later request
whose chosen P holds an item (`--held-items reference`) sends it as E's reference, as the
reference proxy sends every item, rather than raw: P then neither fetches nor decodes its media.

A reference carries only the placeholder metadata E reported (Qwen2-VL: `image_grid_thw`) and
the item's uuid. P serves it from its prefix KV, its encoder cache or its EC connector; where
none holds it any more, the connector must fail the request (mmreuse's MooncakeStoreConnector
does: `ensure_cache_available`) and the proxy retries it with the media (`Forwarder._after_loss`).
The metadata is a function of the item's content, the model and the request's
`mm_processor_kwargs`: the key holds all three (the uuid names the content, per tenant).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..validate import check_int

__all__ = ["REFERENCE_ITEMS", "HeldReferences", "reference_key"]

# How many items' metadata a proxy keeps (least recently used first out): a few hundred bytes
# each. An item past it goes raw, as under `--held-items raw`.
REFERENCE_ITEMS = 65_536

Features = tuple[Mapping[str, Any], ...]


def reference_key(request: Mapping[str, Any], uuid: str) -> tuple[str, str, str] | None:
    """The key an item's metadata is kept under: (model, uuid, mm_processor_kwargs as
    canonical JSON); None where the request cannot be keyed (a model or kwargs of another
    type than vLLM's API takes)."""
    model = request.get("model", "")
    kwargs = request.get("mm_processor_kwargs")
    if not isinstance(model, str) or not isinstance(uuid, str) or not uuid:
        return None
    if kwargs is None or kwargs == {}:
        return model, uuid, ""
    if not isinstance(kwargs, dict):
        return None
    try:
        return model, uuid, json.dumps(kwargs, sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError):
        return None


class HeldReferences:
    """A bounded LRU of E's metadata per item (`reference_key`), learned from E's answers
    (`record`) and read for the items a request sends P raw because P holds them (`lookup`)."""

    def __init__(self, capacity: int = REFERENCE_ITEMS) -> None:
        self.capacity = check_int("capacity", capacity, 1)
        self._entries: OrderedDict[tuple[str, str, str], Features] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def record(
        self,
        request: Mapping[str, Any],
        uuids: Sequence[str],
        item_meta: Mapping[int, Sequence[Mapping[str, Any]]],
    ) -> None:
        """Keep what E reported for each item of `request` it encoded (`item_meta`: per item
        index, its features). An item with a feature without metadata is not kept: it could
        not be sent as a reference (`media.rewrite_for_decode` sends it raw)."""
        for idx, features in item_meta.items():
            if not features or any(not f.get("metadata") for f in features):
                continue
            if not 0 <= idx < len(uuids):
                continue
            key = reference_key(request, uuids[idx])
            if key is None:
                continue
            self._entries[key] = tuple({**f, "transfer_id": None} for f in features)
            self._entries.move_to_end(key)
            if len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def keeps_all(self, request: Mapping[str, Any], uuids: Sequence[str]) -> bool:
        """Whether every item of `request` (its `uuids`) has E's metadata kept here: a check,
        nothing copied or touched."""
        for uuid in uuids:
            key = reference_key(request, uuid)
            if key is None or key not in self._entries:
                return False
        return True

    def lookup(
        self, request: Mapping[str, Any], uuids: Sequence[str], items: Iterable[int]
    ) -> dict[int, list[dict[str, Any]]]:
        """The features to send for each of `items` (indices into `uuids`) kept here; an item
        not kept is absent (it goes raw). No transfer: P finds each by its uuid."""
        out: dict[int, list[dict[str, Any]]] = {}
        for idx in items:
            key = reference_key(request, uuids[idx])
            features = self._entries.get(key) if key is not None else None
            if features is not None:
                self._entries.move_to_end(key)  # type: ignore[arg-type]
                out[idx] = [dict(f) for f in features]
        return out

"""The proxy classifies content parts as vLLM's own parser does (vLLM 0.33.0 and 0.34.0 through the
oracle venvs; 0.32.0, the live cluster's, in tests/live/test_parts_live.py): whatever vLLM takes for
media is named by the proxy or refused, never passed on unseen."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from mmreuse.proxy.media import (
    EMBEDS_PARTS,
    MEDIA_KINDS,
    MM_TYPES,
    PartRefused,
    scan_parts,
    vllm_part_kind,
)
from tests.support.oracle import oracle_run
from tests.support.parts_corpus import parts
from tests.support.paths import REPO

SCRIPT = REPO / "tools/oracle/parts_oracle.py"


def vllm_kinds(python: Path) -> list[dict[str, Any]]:
    """vLLM's verdict on every part of the corpus, from `python`'s vLLM."""
    out = oracle_run(python, str(SCRIPT), input=json.dumps(parts()), timeout=300)
    return json.loads(out.stdout)


def check_against(rows: list[dict[str, Any]]) -> int:
    """Every part vLLM accepts is refused as media or classified as vLLM classifies it, and
    every part vLLM takes for media reaches P only in the form whose type says so (or is
    refused). Returns how many
    parts vLLM parsed as media (the corpus must hold some)."""
    media = 0
    for part, row in zip(parts(), rows, strict=True):
        if not row["valid"] or row["kind"] is None:
            continue  # vLLM answers 400 itself
        req = {"messages": [{"role": "user", "content": [copy.deepcopy(part)]}]}
        try:
            items = scan_parts(req)
        except PartRefused:
            assert vllm_part_kind(part) in MEDIA_KINDS, (part, row)  # refused as media only
            media += row["kind"] in MEDIA_KINDS
            continue
        assert vllm_part_kind(part) == row["kind"], (part, row)
        if row["kind"] not in MEDIA_KINDS:
            continue
        media += 1
        [sent] = req["messages"][0]["content"]
        kind = sent["type"]
        assert kind in MM_TYPES | EMBEDS_PARTS | {"prompt_embeds"}, (part, sent)
        assert vllm_part_kind(sent) in (kind, "input_image"), (part, sent)
        assert (sent in items) == (kind in MM_TYPES), (part, sent)
    return media


def test_parts_are_classified_as_each_vllm_classifies_them(oracle_python):
    assert check_against(vllm_kinds(oracle_python)) > 100

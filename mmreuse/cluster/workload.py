"""Multi-turn multimodal chat for a real cluster: the history resent each turn, a new image per
turn and, from the third turn on, the session's first image shown again (a recurring image).
Assistant turns are fixed text, so every policy sees the same prompts; images are generated
(solid colours, distinct per index) with uuids that carry the run's name, so each run starts
with an empty EC store, and a per-run cache_salt gives it a cold prefix cache."""

from __future__ import annotations

from typing import Any

from ..validate import check_int, check_str
from .client import image_part, png_data_url


def image(run: str, k: int) -> dict[str, Any]:
    """Image k of a run: 112 or 84 pixels square (16 or 9 tokens on the tiny model)."""
    side = 112 - 28 * (k % 2)
    rgb = ((37 * k) % 256, (91 * k) % 256, 120)
    return image_part(png_data_url(side, side, rgb), f"{run}-img{k}")


def conversations(
    run: str, sessions: int, turns: int, *, max_tokens: int = 3
) -> list[tuple[int, int, dict[str, Any]]]:
    """(session, turn, chat request body) in arrival order, sessions interleaved per turn."""
    check_str("run", run, nonempty=True)
    check_int("sessions", sessions, 1)
    check_int("turns", turns, 1)
    check_int("max_tokens", max_tokens, 1)
    history: dict[int, list[dict[str, Any]]] = {
        s: [{"role": "system", "content": f"Session {s} of {run}: " + "be brief. " * 6}]
        for s in range(sessions)
    }
    out = []
    for t in range(turns):
        for s in range(sessions):
            content = [image(run, s * 100 + t)]
            if t >= 2:
                content.append(image(run, s * 100))
            content.append({"type": "text", "text": f"Turn {t}: what changed?"})
            history[s].append({"role": "user", "content": content})
            body = {
                "model": "tiny",
                "messages": [dict(m) for m in history[s]],
                "max_tokens": max_tokens,
                "temperature": 0,
                "return_token_ids": True,
                "cache_salt": run,
            }
            out.append((s, t, body))
            history[s].append({"role": "assistant", "content": f"Answer {t}."})
    return out

"""The one error a proxy stage raises: an HTTP status and a detail for the client."""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    """A stage failed; the client gets `status` and `{"detail": detail}` (FastAPI's shape, as
    the reference proxy answers), and `stage` labels the error metric."""

    def __init__(self, status: int, detail: Any, *, stage: str = "proxy") -> None:
        super().__init__(f"{stage}: HTTP {status}: {detail}")
        self.status = status
        self.detail = detail
        self.stage = stage

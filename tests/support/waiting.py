"""Waiting on another thread (a subscriber, a fake server) in the tests: a hang guard, never a
timing check."""

from __future__ import annotations

import time
from collections.abc import Callable

WAIT_S = 15.0  # the longest a test waits for something that must happen


def wait_for(pred: Callable[[], object], timeout: float = WAIT_S) -> bool:
    """Whether `pred()` became true within `timeout` seconds (polled every 10 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())

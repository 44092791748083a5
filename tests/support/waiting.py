"""Waiting on another thread (a subscriber, a fake server) in the tests: a hang guard, never a
timing check."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

WAIT_S = 15.0  # the longest a test waits for something that must happen


def wait_for(pred: Callable[[], object], timeout: float = WAIT_S) -> bool:
    """Whether `pred()` became true within `timeout` seconds (polled every 10 ms)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return bool(pred())


async def async_wait_for(pred: Callable[[], object], timeout: float = WAIT_S) -> bool:
    """As `wait_for`, yielding to the event loop between polls (for tests on the loop's thread)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        await asyncio.sleep(0.01)
    return bool(pred())


async def async_wait_until(pred: Callable[[], Awaitable[object]], timeout: float = WAIT_S) -> Any:
    """As `async_wait_for` for a predicate that is awaited (an HTTP probe of a server): its
    first truthy result, or its last (falsy) one once `timeout` seconds have passed."""
    end = time.monotonic() + timeout
    while True:
        got = await pred()
        if got or time.monotonic() >= end:
            return got
        await asyncio.sleep(0.05)

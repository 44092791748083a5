"""The errors mmreuse raises for bad input, and the one policy behind them.

- A wrong *value* (out of range, wrong length, unknown name, NaN, ...) raises
  `InvalidArgument`, a `ValueError`.
- A wrong *type* (a str where an int belongs, a bool where a count belongs, ...) raises
  `InvalidArgumentType`, which is both a `TypeError` and an `InvalidArgument`: `except
  TypeError` catches it, and so does `except ValueError`, the one clause a caller needs.
- Every message starts with the offending field (``tokens[4]``, ``block_hashes[2]``,
  ``cluster.kv_blocks``) and shows the value it got.
- The native extensions raise these same classes (they import this module), so an error from
  the C++ fast path reads and catches exactly like the Python one.

Malformed *peer* data (a KV-event payload) raises `mmreuse.events.MalformedBatch`, also a
`ValueError`.
"""

from __future__ import annotations

__all__ = ["InvalidArgument", "InvalidArgumentType"]


class InvalidArgument(ValueError):
    """An argument has the right type but a value mmreuse refuses."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument has the wrong type (also a ValueError, for one `except ValueError`)."""

"""The library's argument checks: one home for "is this an int in range", "a real bool", ...

Each check returns the value it accepted, and raises `InvalidArgumentType` for a wrong type or
`InvalidArgument` for a wrong value, naming the field and showing the value (`mmreuse.errors`).
Nothing is coerced: 3.9 is not an int, "False" is not a bool, NaN is not a duration.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, NoReturn

from .errors import InvalidArgument, InvalidArgumentType

__all__ = [
    "check_bool",
    "check_callable",
    "check_float",
    "check_int",
    "check_str",
    "fail_type",
    "fail_value",
    "show",
]

_MAX_REPR = 80


def show(value: Any) -> str:
    """`repr(value)`, cut to a readable length (a hostile peer's value can be megabytes)."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_REPR else text[: _MAX_REPR - 3] + "..."


def fail_type(field: str, expected: str, value: Any) -> NoReturn:
    raise InvalidArgumentType(
        f"{field} must be {expected}, got {type(value).__name__} {show(value)}"
    )


def fail_value(field: str, what: str, value: Any) -> NoReturn:
    raise InvalidArgument(f"{field} must be {what}, got {show(value)}")


def _bounds(lo: float | None, hi: float | None) -> str:
    if lo is not None and hi is not None:
        return f"in [{lo}, {hi}]"
    return f">= {lo}" if lo is not None else f"<= {hi}"


def check_int(field: str, value: Any, lo: int | None = None, hi: int | None = None) -> int:
    """An exact integer (int or a numpy/torch integer scalar; never a bool or a float), in
    [lo, hi] where given. Returns it as a plain int."""
    if type(value) is not int:
        if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
            fail_type(field, "an int", value)
        try:
            value = operator.index(value)
        except TypeError:
            fail_type(field, "an int", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise InvalidArgument(f"{field} must be {_bounds(lo, hi)}, got {value}")
    return value


def check_float(
    field: str,
    value: Any,
    lo: float | None = None,
    hi: float | None = None,
    *,
    finite: bool = True,
    lo_open: bool = False,
) -> float:
    """A real number (int or float, never a bool), not NaN, finite unless `finite=False`, in
    [lo, hi] (or (lo, hi] with `lo_open`). Returns it as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        fail_type(field, "a number", value)
    x = float(value)
    if math.isnan(x) or (finite and math.isinf(x)):
        fail_value(field, "a finite number" if finite else "a number (not NaN)", value)
    if (lo is not None and (x < lo or (lo_open and x == lo))) or (hi is not None and x > hi):
        bound = f"> {lo}" if lo_open and hi is None else _bounds(lo, hi)
        if lo_open and hi is not None:
            bound = f"in ({lo}, {hi}]"
        raise InvalidArgument(f"{field} must be {bound}, got {value}")
    return x


def check_bool(field: str, value: Any) -> bool:
    """A real bool: "False", 0 and None are not accepted as False."""
    if not isinstance(value, bool):
        fail_type(field, "a bool", value)
    return value


def check_str(field: str, value: Any, *, nonempty: bool = False) -> str:
    if not isinstance(value, str):
        fail_type(field, "a str", value)
    if nonempty and not value:
        fail_value(field, "a non-empty str", value)
    return value


def check_callable(field: str, value: Any) -> Callable[..., Any]:
    if not callable(value):
        fail_type(field, "callable", value)
    return value

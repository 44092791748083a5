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

- A broken *configuration* rule (the simulator's JSON, the proxy's records and flags) raises
  `ConfigError`, an `InvalidArgument` that names each field it is about, so that a front end
  (a file, the CLI's flags) can name them its own way (`ConfigTypeError` for a wrong type).

Malformed *peer* data (a KV-event payload) raises `mmreuse.events.MalformedBatch`, also a
`ValueError`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["ConfigError", "ConfigTypeError", "InvalidArgument", "InvalidArgumentType"]


class InvalidArgument(ValueError):
    """An argument has the right type but a value mmreuse refuses."""


class InvalidArgumentType(InvalidArgument, TypeError):
    """An argument has the wrong type (also a ValueError, for one `except ValueError`)."""


class ConfigError(InvalidArgument):
    """A configuration rule broken. `template` names each field as `{path}` (`/`-separated:
    `{instances/1/demand}` reads `instances[1].demand`, `{instances/*/demand}`
    `instances[].demand`) and each value as a key of `values`; `named()` reads it with
    another name for each field (the CLI's flags). `source`, once known, is where the
    configuration was read (a file): the message is then `<source>: <message>`."""

    def __init__(self, template: str, /, *, source: str = "", **values: object) -> None:
        self.template, self.values, self.source = template, values, source
        message = self.named(field_name)
        super().__init__(f"{source}: {message}" if source else message)

    @classmethod
    def on(cls, field: str, problem: str, *, source: str = "") -> ConfigError:
        """`<field>: <problem>`, `field` already named as its reader knows it
        (`cluster.num_prefills`, `policies[0]`, `config file`)."""
        return cls("{field}: {problem}", source=source, field=field, problem=problem)

    @property
    def field(self) -> str:
        """The field at fault: the one named first."""
        given = self.values.get("field")
        if isinstance(given, str):
            return given
        paths = (m[1] for m in _FIELD.finditer(self.template) if m[1] not in self.values)
        return field_name(next(paths, ""))

    @property
    def problem(self) -> str:
        """What is wrong with `field`."""
        given = self.values.get("problem")
        return given if isinstance(given, str) else self.named(field_name)

    def named(self, name: Callable[[str], str]) -> str:
        """The message with each field path read by `name`."""
        return self.template.format_map(_Names(name, self.values))

    def located(self, source: str) -> ConfigError:
        """The same error, read from `source`."""
        return type(self)(self.template, source=source, **self.values)

    def __reduce__(self) -> tuple[Any, ...]:  # pickles (pytest-xdist, multiprocessing) whole
        return (_rebuild, (type(self), self.template, self.source, self.values))


class ConfigTypeError(ConfigError, InvalidArgumentType):
    """A configuration value of the wrong type (also a TypeError)."""


def _rebuild(
    cls: type[ConfigError], template: str, source: str, values: dict[str, object]
) -> ConfigError:
    return cls(template, source=source, **values)


_FIELD = re.compile(r"(?<!\{)\{([^{}:!]+)\}")


def field_name(path: str) -> str:
    """A field path as the records read it: `instances/1/demand` -> `instances[1].demand`,
    `instances/*/demand` -> `instances[].demand`, `PrefillInstance/demand` ->
    `PrefillInstance.demand`."""
    out = ""
    for part in path.split("/"):
        out += "[]" if part == "*" else f"[{part}]" if part.isdigit() else f".{part}"
    return out.lstrip(".")


class _Names(dict[str, object]):
    """`str.format_map`'s mapping: the values given, and a name for every field path."""

    def __init__(self, name: Callable[[str], str], values: Mapping[str, object]) -> None:
        super().__init__(values)
        self.name = name

    def __missing__(self, key: str) -> str:
        return self.name(key)

"""Count the encoder forwards each vLLM instance really ran (vLLM has no metric for them).

Witnesses: the scheduler's iteration-details log lines (`--enable-logging-iteration-details`),
which say `encoder inputs: N` for every iteration that ran the encoder on N items, on E and on P;
the MooncakeStoreConnector's "store miss at load" lines (an item the scheduler planned to load
that the worker encoded instead, which the scheduler's line does not count); and, for E under
ECExampleConnector, the `*.safetensors` files it wrote (one per encoded item). Files, not
folders: a consumer's cache miss creates an empty `<id>/` folder.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..embedding_store import LOAD_MISS_LOG

__all__ = [
    "EncoderCount",
    "EncoderProbe",
    "connector_files",
    "count_encoder_inputs",
]

# "... Iteration(7): 1 context requests, ..., encoder inputs: 1, encoder output embeddings: 16, ..."
_ITERATION_RE = re.compile(r"Iteration\(\d+\):.*?\bencoder inputs: (\d+)\b")


def count_encoder_inputs(text: str) -> int:
    """The sum of `encoder inputs: N` over the iteration-details lines in `text`."""
    return sum(int(m.group(1)) for m in _ITERATION_RE.finditer(text))


def connector_files(ec_dir: Path) -> frozenset[str]:
    """The encoder-cache files under ECExampleConnector's storage folder (relative paths)."""
    root = Path(ec_dir)
    if not root.is_dir():
        return frozenset()
    return frozenset(str(p.relative_to(root)) for p in root.rglob("*.safetensors") if p.is_file())


@dataclass(frozen=True, slots=True)
class EncoderCount:
    """Encoder forwards seen in one instance's log, and (for the producer) connector files."""

    name: str
    log_inputs: int
    files: int | None = None
    load_misses: int = 0  # loads the worker encoded instead (MooncakeStoreConnector)

    @property
    def forwards(self) -> int:
        """Every item this instance's encoder ran on."""
        return self.log_inputs + self.load_misses


class EncoderProbe:
    """Reads instances' logs (and the shared connector folder) and reports what was encoded
    since the probe was made or last `reset`."""

    def __init__(self, logs: dict[str, Path], ec_dir: Path | None = None) -> None:
        self._logs = {name: Path(p) for name, p in logs.items()}
        self._ec_dir = None if ec_dir is None else Path(ec_dir)
        self._base: dict[str, tuple[int, int]] = {}
        self._base_files: frozenset[str] = frozenset()
        self.reset()

    def _total(self, name: str) -> tuple[int, int]:
        try:
            text = self._logs[name].read_text(errors="replace")
        except OSError:
            return 0, 0
        return count_encoder_inputs(text), text.count(LOAD_MISS_LOG)

    def reset(self) -> None:
        """Count from now on."""
        self._base = {name: self._total(name) for name in self._logs}
        self._base_files = connector_files(self._ec_dir) if self._ec_dir else frozenset()

    def new_files(self) -> frozenset[str]:
        """Connector files written since the last reset."""
        if self._ec_dir is None:
            return frozenset()
        return connector_files(self._ec_dir) - self._base_files

    def count(self, name: str) -> EncoderCount:
        """The encoder inputs `name` logged since the last reset (and new connector files when
        the probe has the folder and `name` is a producer, i.e. starts with "E")."""
        if name not in self._logs:
            raise KeyError(f"name must be one of {sorted(self._logs)}, got {name!r}")
        files = len(self.new_files()) if self._ec_dir and name.startswith("E") else None
        (inputs, misses), (inputs0, misses0) = self._total(name), self._base[name]
        return EncoderCount(name, inputs - inputs0, files, misses - misses0)

    def counts(self) -> dict[str, EncoderCount]:
        return {name: self.count(name) for name in self._logs}

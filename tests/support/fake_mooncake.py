"""An in-memory stand-in for Mooncake's `MooncakeDistributedStore`: the calls mmreuse makes
(`setup`, `is_exist`, `batch_is_exist`, `get`, `put`, `remove`), with Mooncake's answers (a put
never replaces: -705; a remove of nothing: -704). It can fail every call (`fail`: a master
gone) or stall them (`stall`: a call waits until the event is set), and records each call's
name in `calls`. Pure Python, so the oracle venvs' scripts import it too (PYTHONPATH = the
checkout): `install(store)` makes `mooncake.store.MooncakeDistributedStore()` return `store`,
the one vLLM's connector then reaches from every client it makes."""

from __future__ import annotations

import sys
import threading
import types

OK = 0
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705


class FakeMooncakeStore:
    """One store: `objects` by key; every client made after `install` shares it."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.calls: list[str] = []
        self.fail = False  # every call raises ConnectionError
        self.stall: threading.Event | None = None  # every call waits until it is set

    def setup(self, *args: object) -> int:
        return OK

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if self.stall is not None:
            self.stall.wait()
        if self.fail:
            raise ConnectionError("master down")

    def is_exist(self, key: str) -> int:
        self._call("is_exist")
        return int(key in self.objects)

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._call("batch_is_exist")
        return [int(k in self.objects) for k in keys]

    def get(self, key: str) -> bytes:
        self._call("get")
        return self.objects.get(key, b"")

    def put(self, key: str, data: bytes) -> int:
        self._call("put")
        if key in self.objects:
            return OBJECT_ALREADY_EXISTS
        self.objects[key] = bytes(data)
        return OK

    def remove(self, key: str) -> int:
        self._call("remove")
        return OK if self.objects.pop(key, None) is not None else OBJECT_NOT_FOUND


def install(store: FakeMooncakeStore) -> None:
    """Stand `store` in for Mooncake's client module (`mooncake.store` is not installed in the
    oracle venvs): every `MooncakeDistributedStore()` is `store`."""
    module = types.ModuleType("mooncake.store")
    module.MooncakeDistributedStore = lambda: store  # type: ignore[attr-defined]
    sys.modules["mooncake"], sys.modules["mooncake.store"] = types.ModuleType("mooncake"), module

"""A plug-in's control endpoint: a ZMQ ROUTER on its own thread, one answer frame per query
frame (`DemandScheduler`'s demand endpoint; `EventfulEncoderCacheManager`'s encoder-cache
snapshot endpoint), and `id_of`, the id an error answer names. Imports no vLLM."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgspec

from ..demand_query import MAX_ID_CHARS

# under vLLM's "vllm" logger: its handler and format, so these lines appear in vLLM's log
logger = logging.getLogger(f"vllm.{__name__}")

__all__ = ["ControlServer", "id_of"]


class _Named(msgspec.Struct):
    """Any frame's `id`, to name it in a DemandError when the frame is not a query."""

    id: str = ""


# only the id: the other fields are skipped, not built (a generic decode of a hostile frame
# builds every object in it: seconds for a few MB of small maps)
_named = msgspec.msgpack.Decoder(_Named)


def id_of(payload: bytes) -> str:
    """The query's id, if a malformed frame still names one (else "")."""
    try:
        ident = _named.decode(payload).id
    except Exception:
        return ""
    return ident if len(ident) <= MAX_ID_CHARS else ""


class ControlServer:
    """The answer thread: a ZMQ ROUTER bound to `endpoint`, `handler` turning each query frame
    into its answer frame. `max_bytes`: libzmq drops a peer sending a larger frame, unread."""

    def __init__(
        self,
        endpoint: str,
        handler: Callable[[bytes], bytes],
        max_bytes: int | None = None,
        name: str = "mmreuse-demand",
    ) -> None:
        import zmq

        self._zmq = zmq
        self._ctx: Any = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if max_bytes is not None:
            self._sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        self._sock.bind(endpoint)  # a taken port fails the server's start, loudly
        self._handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> ControlServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                frames = self._sock.recv_multipart()
                if len(frames) != 2:  # a DEALER sends [payload]; anything else is not ours
                    continue
                try:
                    answer = self._handler(frames[1])
                except Exception:  # a frame the handler fails on costs that frame only
                    logger.exception("mmreuse: control frame not answered")
                    continue
                self._sock.send_multipart([frames[0], answer])
        except Exception:  # the socket itself failed
            logger.exception("mmreuse: control answer thread stopped")
        finally:
            self._sock.close(0)

"""A child process's lifetime tied to its parent's: the one home of PR_SET_PDEATHSIG."""

from __future__ import annotations

import contextlib
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """SIGTERM this process when its parent dies (Linux `prctl(PR_SET_PDEATHSIG)`; elsewhere
    nothing), so that a supervisor or a test process killed outright leaves no child behind.
    Safe in a `preexec_fn`: it only makes the system call."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

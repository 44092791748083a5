"""The proxy's own ids: child request ids, transfer ids, request ids. They only need to be
unique: one per-process generator seeded from the OS, as the reference's uuid4() values are,
without a getrandom() call for each."""

from __future__ import annotations

import os
import random

_ids = random.Random(int.from_bytes(os.urandom(32), "big"))


def new_hex(bits: int) -> str:
    """`bits` random bits as lower-case hex (uuid4().hex's form for 128)."""
    return f"{_ids.getrandbits(bits):0{bits // 4}x}"


_V4 = ~(0xF000 << 64) & ~(0xC000 << 48)  # the version and variant bits cleared ...
_V4_SET = (0x4000 << 64) | (0x8000 << 48)  # ... and set: version 4, RFC 4122's variant


def new_uuid4() -> str:
    """A random version-4 UUID in its string form (str(uuid4())'s), without uuid.UUID's
    parsing and checks: a request id per request."""
    h = f"{_ids.getrandbits(128) & _V4 | _V4_SET:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

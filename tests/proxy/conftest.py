"""Fixtures of the proxy's tests: recording fake backends, started and closed for each test."""

import pytest

from tests.support.proxy_fakes import Fake
from tests.support.proxy_fakes import refused_url as _refused_url


@pytest.fixture
async def fakes():
    """`await fakes("e")` (a role, with Fake's fields as keywords) or `await fakes(Fake(...))`:
    a started fake backend on loopback; every one is closed after the test."""
    made: list[Fake] = []

    async def start(fake: str | Fake, **kw) -> Fake:
        backend = Fake(fake, **kw) if isinstance(fake, str) else fake
        made.append(backend)
        return await backend.start()

    yield start
    for backend in made:
        await backend.close()


@pytest.fixture
def refused_url() -> str:
    """An http URL on loopback where nothing listens."""
    return _refused_url()

"""The trainer API's mistakes raise the documented exceptions at once: a malformed address is a
ConfigError before any socket or thread exists, and every call after ``close()`` is ``Closed``."""

from __future__ import annotations

import gc
import time
import warnings

import pytest

from common.errors import Closed, ConfigError
from coordinator.client import AsyncRolloutClient, RolloutClient
from harness.cluster import client_threads


@pytest.mark.parametrize("address", ["127.0.0.1:15570", "tcp://127.0.0.1", "http://127.0.0.1:5555", "tcp://:5555"])
def test_an_address_without_tcp_host_and_port_is_refused_at_once(address):
    before = client_threads()
    started = time.monotonic()
    with pytest.raises(ConfigError, match="expected tcp://HOST:PORT"):
        RolloutClient(address, timeout=5)
    with pytest.raises(ConfigError, match="expected tcp://HOST:PORT"):
        AsyncRolloutClient(address)
    assert time.monotonic() - started < 1
    assert client_threads() == before, "a refused client left its loop thread running"


def test_every_call_after_close_raises_closed_without_warnings():
    client = RolloutClient("tcp://127.0.0.1:9", attach=False)  # nothing answers there; nothing is sent
    client.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in (lambda: client.generate(0), client.stats, client.state_dict, client.resume,
                     lambda: client.generate(1, prefetch=8), lambda: client.load_state_dict({})):  # fmt: skip
            with pytest.raises(Closed, match="closed"):
                call()
        client.close()  # a second close is a no-op
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]


async def test_async_client_calls_after_close_raise_closed():
    client = AsyncRolloutClient("tcp://127.0.0.1:9", attach=False)
    await client.connect()
    await client.close()
    with pytest.raises(Closed):
        await client.generate(0)
    with pytest.raises(Closed):
        await client.stats()

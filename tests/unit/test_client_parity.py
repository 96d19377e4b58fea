"""The blocking ``RolloutClient`` cannot drift from ``AsyncRolloutClient``: the same public methods (a method added
to one only fails here), the same parameters, kinds, defaults and annotations, the same return annotation (the
records of coordinator/client_results.py and coordinator/client_stats.py), and every argument handed through to
the async twin as given."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from coordinator.client import AsyncRolloutClient, RolloutClient

ONLY_ASYNC = {"connect": "RolloutClient connects in its constructor"}


def public_methods(cls) -> dict:
    return {
        name: fn
        for name, fn in vars(cls).items()
        if not name.startswith("_") and inspect.isfunction(fn) and name not in ONLY_ASYNC
    }


def public_properties(cls) -> set[str]:
    return {name for name, value in vars(cls).items() if not name.startswith("_") and isinstance(value, property)}


def test_both_clients_have_the_same_public_methods():
    assert sorted(public_methods(AsyncRolloutClient)) == sorted(public_methods(RolloutClient))
    assert set(ONLY_ASYNC) <= set(vars(AsyncRolloutClient)), "an exemption names a method that is gone"


@pytest.mark.parametrize("name", sorted(public_methods(AsyncRolloutClient)))
def test_a_method_has_the_same_signature_on_both_clients(name):
    async_fn, sync_fn = getattr(AsyncRolloutClient, name), getattr(RolloutClient, name)
    assert inspect.iscoroutinefunction(async_fn) and not inspect.iscoroutinefunction(sync_fn)
    a, s = inspect.signature(async_fn), inspect.signature(sync_fn)
    assert list(a.parameters.values()) == list(s.parameters.values()), f"{name}: {a} != {s}"
    assert a.return_annotation == s.return_annotation, f"{name}: returns {a.return_annotation} != {s.return_annotation}"
    assert "dict" not in str(a.return_annotation), f"{name} returns a bare dict: return a record"


def test_every_public_property_of_the_blocking_client_is_the_async_clients():
    client = AsyncRolloutClient("tcp://127.0.0.1:9", attach=False)
    try:
        for name in public_properties(RolloutClient) | public_properties(AsyncRolloutClient):
            assert hasattr(client, name), name
            assert name in public_properties(RolloutClient), f"RolloutClient lacks the property {name!r}"
    finally:
        asyncio.run(client.close())


class Recorder:
    """Stands in for the async client: records each call."""

    def __init__(self):
        self.calls: list = []

    def __getattr__(self, name):
        async def call(*args, **kwargs):
            self.calls.append((name, args, kwargs))

        return call


@pytest.mark.parametrize("name", sorted(set(public_methods(AsyncRolloutClient)) - {"close"}))
def test_the_blocking_client_hands_every_argument_through(name):
    """(``close`` also stops the loop thread: every test that makes a client runs it.)"""
    client = RolloutClient.__new__(RolloutClient)
    client._async = Recorder()
    client._run = asyncio.run
    sig = inspect.signature(getattr(AsyncRolloutClient, name))
    given = {p: object() for p in list(sig.parameters)[1:]}  # a distinct value for every parameter, defaults too
    getattr(client, name)(**given)
    [(called, args, kwargs)] = client._async.calls
    assert called == name
    bound = sig.bind(None, *args, **kwargs)
    assert {k: v for k, v in bound.arguments.items() if k != "self"} == given

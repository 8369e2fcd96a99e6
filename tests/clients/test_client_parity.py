"""Client and AsyncClient offer the same public methods with the same parameters.

The asyncio client is the sync one with `await` (or `async for`): a method added to one and
not the other, or a parameter named differently, fails here.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
from kerneleval.client import AsyncClient, Client

# Context-manager protocols differ by design: `with Client()`, `async with AsyncClient()`.
SYNC_ONLY = {"__enter__", "__exit__"}
ASYNC_ONLY = {"__aenter__", "__aexit__"}


def public_methods(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        name: member
        for name, member in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_")
    }


def parameters(fn: Callable[..., Any]) -> list[tuple[str, Any, Any]]:
    """(name, kind, default) of every parameter; annotations differ (Iterator/AsyncIterator)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_the_same_public_methods():
    sync, aio = public_methods(Client), public_methods(AsyncClient)
    assert sorted(set(sync) - set(aio)) == [], "in Client only"
    assert sorted(set(aio) - set(sync)) == [], "in AsyncClient only"
    assert len(sync) >= 18  # the inspection found them


@pytest.mark.parametrize("name", sorted(public_methods(Client)))
def test_the_same_parameters(name: str):
    assert parameters(getattr(Client, name)) == parameters(getattr(AsyncClient, name))


def test_the_same_constructor_parameters():
    assert parameters(Client.__init__) == parameters(AsyncClient.__init__)


@pytest.mark.parametrize("name", sorted(public_methods(Client)))
def test_async_methods_are_awaited_or_async_iterated(name: str):
    sync, aio = getattr(Client, name), getattr(AsyncClient, name)
    assert not inspect.iscoroutinefunction(sync) and not inspect.isasyncgenfunction(sync)
    returns = str(inspect.signature(aio).return_annotation)
    assert (
        inspect.iscoroutinefunction(aio)
        or inspect.isasyncgenfunction(aio)
        or returns.startswith("AsyncIterator")
    ), f"AsyncClient.{name} is neither awaited nor async-iterated"
    if str(inspect.signature(sync).return_annotation).startswith("Iterator"):
        assert inspect.isasyncgenfunction(aio) or returns.startswith("AsyncIterator")


def test_the_protocols():
    assert SYNC_ONLY <= set(vars(Client)) and not SYNC_ONLY & set(vars(AsyncClient))
    assert ASYNC_ONLY <= set(vars(AsyncClient)) and not ASYNC_ONLY & set(vars(Client))

"""``@multirank``: turn a per-rank function into parametrized pytest tests."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from zero_core.testing.multirank import run_multirank


def multirank(
    world_sizes: Iterable[int] = (2,),
    *,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: Mapping[str, str] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., None]]:
    """Decorate a per-rank test body; pytest runs it once per world size in ``world_sizes``.

    The body runs on every rank through :func:`run_multirank`. Its parameters are pytest
    fixtures, resolved once in the parent process and handed to every rank (``tmp_path``
    works; the ranks share it). A parameter named ``world_size`` receives the world size.
    The body's return value is ignored; an assertion failing on any rank fails the test with
    that rank's traceback.
    """
    sizes = tuple(world_sizes)
    if not sizes or not all(isinstance(w, int) and not isinstance(w, bool) and w >= 1 for w in sizes):
        raise ValueError(f"multirank: world_sizes must be a non-empty sequence of ints >= 1, got {sizes!r}")
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"multirank: world_sizes has duplicates: {sizes!r}")

    def decorate(body: Callable[..., Any]) -> Callable[..., None]:
        import pytest

        if not callable(body):
            raise TypeError(f"multirank must decorate a function, got {type(body).__name__}")
        sig = inspect.signature(body)
        body_takes_ws = "world_size" in sig.parameters
        params = [p for name, p in sig.parameters.items() if name != "world_size"]
        params.append(inspect.Parameter("world_size", inspect.Parameter.KEYWORD_ONLY))

        @functools.wraps(body)
        def test(*fixtures: object, world_size: int, **kw_fixtures: object) -> None:
            bound = sig.bind_partial(*fixtures, **kw_fixtures)
            call_kwargs = dict(bound.arguments)
            if body_takes_ws:
                call_kwargs["world_size"] = world_size
            run_multirank(body, world_size, kwargs=call_kwargs, timeout=timeout, backend=backend, env=env)

        # pytest reads the signature to decide which fixtures to pass.
        test.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        del test.__wrapped__  # otherwise inspect follows it back to the body's signature
        return pytest.mark.parametrize("world_size", sizes, ids=[f"ws{w}" for w in sizes])(test)

    return decorate

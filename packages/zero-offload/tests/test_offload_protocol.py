"""zero-offload's OptimizerOffload is the typed seam the stage strategies code against
(zero_core.protocols.OptimizerOffload, See [Note: optimizer offload seam])."""

from __future__ import annotations

import inspect

from zero_core.protocols import OptimizerOffload as OptimizerOffloadProtocol
from zero_offload import OptimizerOffload


def test_optimizer_offload_implements_the_protocol() -> None:
    offload = OptimizerOffload("cpu")
    try:
        assert isinstance(offload, OptimizerOffloadProtocol)
    finally:
        offload.close()


def test_protocol_methods_have_the_implementations_parameters() -> None:
    # isinstance only checks that the names exist: compare the parameter names too
    for name, member in inspect.getmembers(OptimizerOffloadProtocol, inspect.isfunction):
        if name.startswith("_"):
            continue
        want = list(inspect.signature(member).parameters)
        got = list(inspect.signature(getattr(OptimizerOffload, name)).parameters)
        assert got == want, (name, got, want)

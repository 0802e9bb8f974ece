"""Loading the compiled extension ``zero_ops._C``, or explaining why the fallback is used.

[Note: native or fallback]
Every op has two implementations with the same results: the compiled one (``_C``, built when the
package is installed) and a pure-torch one. The compiled one is used whenever it imports. If it
does not (the build was skipped, the library is missing, or ZERO_OPS_FORCE_FALLBACK=1), the first
op used warns once per process with the reason and then runs the torch path; nothing else changes.
``zero_ops.op_report()`` says which path each op takes and why.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from types import ModuleType

_C: ModuleType | None
_reason: str

if os.environ.get("ZERO_OPS_FORCE_FALLBACK", "") not in ("", "0"):
    _C = None
    _reason = "ZERO_OPS_FORCE_FALLBACK is set"
else:
    try:
        from zero_ops import _C as _loaded  # type: ignore[attr-defined]

        _C = _loaded
        _reason = ""
    except ImportError as exc:  # the build was skipped or the library does not load here
        _C = None
        _reason = f"the compiled extension zero_ops._C did not import: {exc}"

_warned = False


def native() -> ModuleType | None:
    """The compiled module, or None when the fallback is in use (see [Note: native or fallback])."""
    return _C


def fallback_reason() -> str:
    """Why the compiled extension is not used ('' when it is)."""
    return _reason


def run(op: str, native_call: Callable[[ModuleType], None], fallback: Callable[[], None]) -> None:
    """Runs ``native_call`` on the compiled module, or warns (once, see ``warn_fallback``) and runs
    ``fallback`` when it is unavailable. ``op`` names the public function calling this one, and
    the warning points at that function's caller."""
    C = native()
    if C is None:
        warn_fallback(op, stacklevel=4)
        fallback()
        return
    native_call(C)


def warn_fallback(op: str, *, stacklevel: int = 3) -> None:
    """Warns, once per process, that the native ops (here first ``op``) run on the torch fallback.

    ``stacklevel`` as for ``warnings.warn`` counted from this function: the default 3 names the
    caller of the op that called this function directly.
    """
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        f"zero_ops: native ops unavailable, {op} and the other ops use the pure-torch fallback "
        f"({_reason}); results are the same, speed is lower. "
        "Reinstall zero-ops with a C++17 compiler available to get the native kernels.",
        RuntimeWarning,
        stacklevel=stacklevel,
    )

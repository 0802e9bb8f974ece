"""Cleaning up on SIGTERM: swap files and checkpoint staging directories do not outlive a killed job.

[Note: cleanup on SIGTERM]
Normal exit and exceptions remove NVMe swap files (``close()``, then ``atexit``) and a failed
save leaves its staging directory to be cleared by the next save. SIGTERM (a scheduler's
preemption, ``kill``, a launcher stopping the job) runs neither: Python's default action is
to die at once. Things that must not outlive the process register a callback with
:func:`on_termination`; the first registration installs a SIGTERM handler (main thread
only, and not when SIGTERM is ignored) that runs the callbacks, then hands the signal on: to
the handler that was installed before (so a user's or a launcher's handler still runs), or,
when that was the default action, by restoring it and re-sending SIGTERM to this process, so
the process still ends with the conventional status (killed by signal 15, ``128 + 15`` in a
shell). Callbacks are held weakly where they are bound methods, and ``forget`` drops one.
Observers (:func:`observe`: the record of a failed rank, see [Note: failed ranks]) run first,
with the signal and frame, but never install the handler themselves: a Python handler runs only
between bytecodes, so a process blocked in C++ would otherwise outlive its launcher's SIGTERM.
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

_callbacks: dict[int, Callable[[], Any]] = {}
_ids = itertools.count()
_lock = threading.Lock()
_installed: list[Any] = []  # [previous handler] once installed
_observers: list[Callable[[int, Any], Any]] = []


def on_termination(callback: Callable[[], Any]) -> int:
    """Run ``callback`` if the process receives SIGTERM; returns a key for :func:`forget`.

    A bound method is held through a weak reference (its object may go away first).
    """
    if not callable(callback):
        raise TypeError(f"on_termination: callback must be callable, got {type(callback).__name__}")
    if hasattr(callback, "__self__") and hasattr(callback, "__func__"):
        ref = weakref.WeakMethod(callback)

        def call() -> object:
            method = ref()
            return method() if method is not None else None

    else:
        call = callback
    with _lock:
        key = next(_ids)
        _callbacks[key] = call
    _install()
    return key


def forget(key: int) -> None:
    """Stop running the callback registered under ``key`` (idempotent)."""
    with _lock:
        _callbacks.pop(key, None)


def observe(observer: Callable[[int, Any], Any]) -> None:
    """Call ``observer(signum, frame)`` first when zero's SIGTERM handler runs (installs nothing)."""
    if not callable(observer):
        raise TypeError(f"observe: observer must be callable, got {type(observer).__name__}")
    with _lock:
        if observer not in _observers:
            _observers.append(observer)


def run_callbacks() -> None:
    """Run every registered callback once (newest first); one failing does not stop the others."""
    with _lock:
        pending = list(_callbacks.items())[::-1]
        _callbacks.clear()
    for _, call in pending:
        try:
            call()
        except Exception:
            pass


def _handler(signum: int, frame: FrameType | None) -> None:
    for observer in list(_observers):
        try:
            observer(signum, frame)
        except Exception:
            pass
    run_callbacks()
    previous = _installed[0] if _installed else signal.SIG_DFL
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install() -> None:
    if _installed or threading.current_thread() is not threading.main_thread():
        return
    previous = signal.getsignal(signal.SIGTERM)
    if previous is signal.SIG_IGN:
        return  # the process is meant to survive SIGTERM: nothing to clean up then
    signal.signal(signal.SIGTERM, _handler)
    _installed.append(previous)

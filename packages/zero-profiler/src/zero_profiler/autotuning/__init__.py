"""The autotuner: ``zero run --autotuning tune|run`` finds the fastest configuration that fits.

See [Note: autotuning search] (``autotuner.py``) for the search and [Note: autotuning
experiments] (``engine_hook.py``) for what the engine measures in each experiment, and
[Note: autotuning confirm phase] (``confirm.py``) for how the best candidates are re-measured.
"""

from __future__ import annotations

__all__ = ["autotune"]


def autotune(args):  # type: ignore[no-untyped-def]
    """Run the search for the parsed ``zero run`` arguments ``args``; returns the exit code."""
    from zero_core.autotuning.autotuner import autotune as _autotune

    return _autotune(args)

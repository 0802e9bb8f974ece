"""The autotuner: ``zero run --autotuning tune|run`` finds the fastest configuration that fits.

See [Note: autotuning search] (``autotuner.py``) for the search and [Note: autotuning
experiments] (``engine_hook.py``) for what the engine measures in each experiment, and
[Note: autotuning confirm phase] (``confirm.py``) for how the best candidates are re-measured.

It launches training jobs through zero-core's launcher and reads zero-core's config, so it is
zero-profiler's ``autotuning`` extra (zero-core, and matplotlib for the plot); the rest of
zero-profiler depends on torch alone. zero-core's ``zero run --autotuning`` finds it through
``zero_core.plugins.require``; without zero-core, importing it says what to install.
"""

from __future__ import annotations

import importlib.util

if importlib.util.find_spec("zero_core") is None:
    raise ModuleNotFoundError(
        "zero_profiler.autotuning (zero run --autotuning) launches its experiments through zero-core, "
        "which is not installed: pip install packages/zero-core 'packages/zero-profiler[autotuning]' "
        "(from a clone of the zero repository)",
        name="zero_core",
    )

__all__ = ["autotune"]


def autotune(args):  # type: ignore[no-untyped-def]
    """Run the search for the parsed ``zero run`` arguments ``args``; returns the exit code."""
    from zero_profiler.autotuning.autotuner import autotune as _autotune

    return _autotune(args)

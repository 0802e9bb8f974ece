"""Data helpers for pipeline training.

``RepeatingLoader`` lives in zero-core (``zero.utils.RepeatingLoader``); it is re-exported
here because pipeline users reach for it next to ``train_batch``.
"""

from __future__ import annotations

from zero_core.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader"]

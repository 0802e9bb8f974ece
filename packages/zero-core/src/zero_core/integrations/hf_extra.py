"""The Hugging Face integrations are zero-core's ``hf`` extra: transformers and accelerate.

They stay in zero-core because ``from_pretrained`` writes straight into stage-3 partitions and
``ZeroTrainer`` wraps the engine (see "What belongs in zero-core" in docs/architecture.md), but
their libraries are optional: a zero-core install without the extra still imports
``zero_core.integrations``, and using one of them says what to install.
"""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType

from zero_core.plugins import MissingPackageError, install_hint


def require_hf(feature: str, modules: tuple[str, ...] = ("transformers",)) -> ModuleType:
    """The first of ``modules`` (Hugging Face libraries ``feature`` needs), imported; a
    :class:`MissingPackageError` naming zero-core's ``hf`` extra when one is not installed."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingPackageError(
            f"{feature} needs {' and '.join(missing)} (zero-core's 'hf' extra), which is not installed: "
            f"{install_hint('zero-core', 'hf')}"
        )
    return importlib.import_module(modules[0])

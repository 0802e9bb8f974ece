"""Integrations with other libraries (``zero.integrations``): Hugging Face ``transformers``.

``from_pretrained`` builds a ``transformers`` model from a pretrained directory straight into
ZeRO-3 partitions, each rank reading only its own part of every weight; see
``hf_pretrained.py``; ``ZeroTrainer`` is ``transformers.Trainer`` training with a zero engine,
see ``hf_trainer.py``. transformers is imported only when these are used: it and accelerate are
zero-core's ``hf`` extra (``pip install 'packages/zero-core[hf]'``), and without them using these
names is an error saying so (``hf_extra.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from zero_core.integrations.hf_pretrained import from_pretrained, load_pretrained_into_partitions

if TYPE_CHECKING:
    from zero_core.integrations.hf_trainer import ZeroTrainer

__all__ = ["ZeroTrainer", "from_pretrained", "load_pretrained_into_partitions"]


def __getattr__(name: str) -> type[ZeroTrainer]:
    if name == "ZeroTrainer":  # imports transformers (and accelerate): only when asked for
        from zero_core.integrations.hf_extra import require_hf

        require_hf("zero_core.integrations.ZeroTrainer", ("transformers", "accelerate"))
        from zero_core.integrations.hf_trainer import ZeroTrainer

        return ZeroTrainer
    raise AttributeError(f"module 'zero_core.integrations' has no attribute {name!r}")

"""Integrations with other libraries (``zero.integrations``): Hugging Face ``transformers``.

``from_pretrained`` builds a ``transformers`` model from a pretrained directory straight into
ZeRO-3 partitions, each rank reading only its own part of every weight; see
``hf_pretrained.py``. transformers is imported only when these functions are called.
"""

from zero_core.integrations.hf_pretrained import from_pretrained, load_pretrained_into_partitions

__all__ = ["from_pretrained", "load_pretrained_into_partitions"]

"""Integrations with other libraries (Hugging Face transformers), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.integrations", "zero_core.integrations")

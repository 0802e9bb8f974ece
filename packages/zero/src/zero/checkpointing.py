"""Activation checkpointing (deepspeed.checkpointing), from zero-core."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.checkpointing", "zero_core.activation_checkpointing")

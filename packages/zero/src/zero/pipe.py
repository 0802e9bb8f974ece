"""Pipeline parallelism (deepspeed.pipe), from zero-pipe."""

from zero._lazy import lazy_module

__getattr__, __dir__ = lazy_module("zero.pipe", "zero_pipe")

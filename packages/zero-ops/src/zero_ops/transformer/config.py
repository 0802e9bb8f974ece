"""TransformerConfig: the parameters of the fused BERT layer (DeepSpeedTransformerConfig).

Every parameter of DeepSpeed's transformer kernel API docs, with its default. As there, ``-1``
means "not set": the config accepts it, and :class:`~zero_ops.transformer.TransformerLayer`
raises naming the field when a layer needs a value that was left unset. Every value that is set
is checked here, so a bad one fails where it is written.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

_WHERE = "TransformerConfig"

# name -> default, in DeepSpeed's order; ``bf16`` is ours (DeepSpeed's layer has fp16 only)
DEFAULTS: dict[str, Any] = {
    "batch_size": -1,
    "hidden_size": -1,
    "intermediate_size": -1,
    "heads": -1,
    "attn_dropout_ratio": -1,
    "hidden_dropout_ratio": -1,
    "num_hidden_layers": -1,
    "initializer_range": -1,
    "layer_norm_eps": 1e-12,
    "local_rank": -1,
    "seed": -1,
    "fp16": False,
    "pre_layer_norm": True,
    "normalize_invertible": False,
    "gelu_checkpoint": False,
    "adjust_init_range": True,
    "attn_dropout_checkpoint": False,
    "stochastic_mode": False,
    "return_tuple": False,
    "training": True,
    "bf16": False,
}
_BOOLS = (
    "fp16",
    "bf16",
    "pre_layer_norm",
    "normalize_invertible",
    "gelu_checkpoint",
    "adjust_init_range",
    "attn_dropout_checkpoint",
    "stochastic_mode",
    "return_tuple",
    "training",
)
_SIZES = ("batch_size", "hidden_size", "intermediate_size", "heads", "num_hidden_layers")


def _check_int(name: str, value: object, *, unset_ok: bool = True, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_WHERE}: {name} must be an int, got {value!r}")
    if unset_ok and value == -1:
        return
    if value < low:
        allowed = f">= {low}" + (" (or -1: not set)" if unset_ok else "")
        raise ValueError(f"{_WHERE}: {name} must be {allowed}, got {value}")


def _check_ratio(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_WHERE}: {name} must be a number, got {value!r}")
    if value == -1:
        return
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{_WHERE}: {name} must be in [0, 1) (or -1: not set), got {value}")


class TransformerConfig:
    """Configuration of :class:`~zero_ops.transformer.TransformerLayer` (DeepSpeed's
    ``DeepSpeedTransformerConfig``, same parameters and defaults).

    ``intermediate_size=-1`` means ``4 * hidden_size``. ``bf16=True`` (our addition) builds the
    layer in bfloat16 as ``fp16=True`` builds it in float16. ``batch_size`` is the largest batch
    the layer accepts (DeepSpeed sizes its kernel buffers with it); a larger input is an error.
    """

    def __init__(
        self,
        batch_size: int = -1,
        hidden_size: int = -1,
        intermediate_size: int = -1,
        heads: int = -1,
        attn_dropout_ratio: float = -1,
        hidden_dropout_ratio: float = -1,
        num_hidden_layers: int = -1,
        initializer_range: float = -1,
        layer_norm_eps: float = 1e-12,
        local_rank: int = -1,
        seed: int = -1,
        fp16: bool = False,
        pre_layer_norm: bool = True,
        normalize_invertible: bool = False,
        gelu_checkpoint: bool = False,
        adjust_init_range: bool = True,
        attn_dropout_checkpoint: bool = False,
        stochastic_mode: bool = False,
        return_tuple: bool = False,
        training: bool = True,
        bf16: bool = False,
    ) -> None:
        values = dict(locals())
        values.pop("self")
        for name in _SIZES:
            _check_int(name, values[name])
        for name in ("attn_dropout_ratio", "hidden_dropout_ratio"):
            _check_ratio(name, values[name])
        for name in _BOOLS:
            if not isinstance(values[name], bool):
                raise TypeError(f"{_WHERE}: {name} must be a bool, got {values[name]!r}")
        _check_int("local_rank", local_rank, low=0)
        _check_int("seed", seed, low=0)
        self._check_floats(initializer_range, layer_norm_eps)
        if fp16 and bf16:
            raise ValueError(f"{_WHERE}: fp16 and bf16 are both True; choose one")
        if hidden_size > 0 and heads > 0 and hidden_size % heads:
            raise ValueError(
                f"{_WHERE}: heads ({heads}) must divide hidden_size ({hidden_size}); "
                f"hidden_size / heads is the size of each attention head"
            )
        if intermediate_size == -1 and hidden_size > 0:
            values["intermediate_size"] = 4 * hidden_size
        self.__dict__.update(values)

    @staticmethod
    def _check_floats(initializer_range: object, layer_norm_eps: object) -> None:
        for name, value in (("initializer_range", initializer_range), ("layer_norm_eps", layer_norm_eps)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{_WHERE}: {name} must be a number, got {value!r}")
        if initializer_range != -1 and not (initializer_range > 0 and math.isfinite(initializer_range)):
            raise ValueError(
                f"{_WHERE}: initializer_range must be a finite number > 0 (or -1: not set), "
                f"got {initializer_range}"
            )
        if not (layer_norm_eps > 0 and math.isfinite(layer_norm_eps)):
            raise ValueError(f"{_WHERE}: layer_norm_eps must be a finite number > 0, got {layer_norm_eps}")

    @property
    def dtype(self) -> torch.dtype:
        """The parameter and compute dtype the flags select (float32 unless fp16/bf16)."""
        if self.fp16:
            return torch.float16
        return torch.bfloat16 if self.bf16 else torch.float32

    @classmethod
    def from_dict(cls, json_object: dict[str, Any]) -> TransformerConfig:
        """Build from a dict of parameters; an unknown key is an error naming the allowed ones."""
        if not isinstance(json_object, dict):
            raise TypeError(f"{_WHERE}.from_dict: expected a dict, got {type(json_object).__name__}")
        unknown = sorted(set(json_object) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"{_WHERE}.from_dict: unknown keys {unknown}; allowed: {sorted(DEFAULTS)}")
        return cls(**json_object)

    @classmethod
    def from_json_file(cls, json_file: str) -> TransformerConfig:
        """Build from a JSON file holding a dict of parameters."""
        with open(json_file, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in DEFAULTS}

    def require(self, *names: str, why: str) -> None:
        """Raise naming every field of ``names`` still at -1 (not set), saying ``why`` it is needed."""
        unset = [n for n in names if getattr(self, n) == -1]
        if unset:
            raise ValueError(f"{_WHERE}: {', '.join(unset)} must be set (it is -1: not set) {why}")

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"{type(self).__name__}({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TransformerConfig) and self.to_dict() == other.to_dict()

    __hash__ = None  # mutable, like DeepSpeed's config: fields may be assigned after construction


DeepSpeedTransformerConfig = TransformerConfig

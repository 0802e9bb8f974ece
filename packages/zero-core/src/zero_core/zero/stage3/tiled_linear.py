"""``zero.TiledLinear``: a linear layer split into a grid of smaller linear submodules.

Memory-centric tiling: with stage 3 each tile is its own module, so only one tile's
parameters need to be gathered at a time and a layer larger than a rank's memory can run.
Input features are split into ``in_splits`` and output features into ``out_splits`` nearly
equal parts (sizes differ by at most one, the first parts the larger); tile ``(o, i)`` maps
input part ``i`` to output part ``o`` and output part ``o`` is the sum over ``i``. Only the tiles
of the last input part have a bias, so the result equals one ``nn.Linear`` with the concatenated
weights. The layout is DeepSpeed's, so state dicts are interchangeable: ``in_parts`` /
``out_parts`` hold the part *boundaries* (``splits + 1`` offsets from 0 to the feature count)
and the keys are ``linears.{o}.{i}.weight`` with ``linears.{o}.{in_splits - 1}.bias``.
"""

from __future__ import annotations

from typing import Any

import torch

from zero_core.zero.stage3.gathered_parameters import GatheredParameters
from zero_core.zero.stage3.param_records import full_shape


def _boundaries(total: int, parts: int) -> list[int]:
    """``parts + 1`` offsets splitting ``total`` into nearly equal parts, the first ones larger
    (DeepSpeed's uniform partitioning)."""
    base, extra = divmod(total, parts)
    out = [0]
    for i in range(parts):
        out.append(out[-1] + base + (1 if i < extra else 0))
    return out


def _sizes(bounds: list[int]) -> list[int]:
    return [b - a for a, b in zip(bounds, bounds[1:])]


class TiledLinear(torch.nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type = torch.nn.Linear,
        init_linear: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        for name, v in (
            ("in_features", in_features),
            ("out_features", out_features),
            ("in_splits", in_splits),
            ("out_splits", out_splits),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"TiledLinear: {name} must be a positive int, got {v!r}")
        if in_splits > in_features:
            raise ValueError(
                f"TiledLinear: in_splits ({in_splits}) cannot exceed in_features ({in_features})"
            )
        if out_splits > out_features:
            raise ValueError(
                f"TiledLinear: out_splits ({out_splits}) cannot exceed out_features ({out_features})"
            )
        if not (isinstance(linear_cls, type) and issubclass(linear_cls, torch.nn.Module)):
            raise TypeError(f"TiledLinear: linear_cls must be an nn.Module class, got {linear_cls!r}")
        self.in_features, self.out_features = in_features, out_features
        self.use_bias = bool(bias)
        self.in_splits, self.out_splits = in_splits, out_splits
        self.input_is_already_split = bool(input_is_already_split)
        self.combine_out_splits = bool(combine_out_splits)
        #: part boundaries, as DeepSpeed's: ``in_parts[i]:in_parts[i + 1]`` is input part ``i``
        self.in_parts = _boundaries(in_features, in_splits)
        self.out_parts = _boundaries(out_features, out_splits)
        self.linears = torch.nn.ModuleList()
        for o in _sizes(self.out_parts):
            row = torch.nn.ModuleList()
            for i, n_in in enumerate(_sizes(self.in_parts)):
                # one bias per output part, on the last input tile (where DeepSpeed puts it)
                row.append(linear_cls(n_in, o, bias=self.use_bias and i == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.input_is_already_split:
            if not isinstance(input_, (list, tuple)) or len(input_) != self.in_splits:
                raise ValueError(
                    f"TiledLinear: input_is_already_split expects a list of {self.in_splits} tensors, "
                    f"got {type(input_).__name__}"
                )
            parts = list(input_)
        else:
            if input_.shape[-1] != self.in_features:
                raise ValueError(
                    f"TiledLinear: input has {input_.shape[-1]} features, expected {self.in_features}"
                )
            parts = list(torch.split(input_, _sizes(self.in_parts), dim=-1))
        outs = []
        for row in self.linears:
            acc = None
            for tile, x in zip(row, parts):
                y = tile(x)
                acc = y if acc is None else acc + y
            outs.append(acc)
        if self.combine_out_splits:
            return torch.cat(outs, dim=-1) if len(outs) > 1 else outs[0]
        return outs

    @torch.no_grad()
    def copy_params_from(self, other: torch.nn.Module) -> None:
        """Copy the weight (and bias) of a full linear layer ``other`` into the tiles."""
        weight = getattr(other, "weight", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"TiledLinear.copy_params_from: {type(other).__name__} has no weight tensor")
        bias = getattr(other, "bias", None)
        shape = full_shape(weight)
        if shape != (self.out_features, self.in_features):
            raise ValueError(
                f"TiledLinear.copy_params_from: weight shape {shape} != ({self.out_features}, {self.in_features})"
            )
        if self.use_bias and bias is None:
            raise ValueError("TiledLinear.copy_params_from: this layer has a bias but the source has none")
        src = [weight] + ([bias] if bias is not None else [])
        with GatheredParameters(src):
            out_sizes, in_sizes = _sizes(self.out_parts), _sizes(self.in_parts)
            w_rows = torch.split(weight, out_sizes, dim=0)
            b_rows = torch.split(bias, out_sizes) if bias is not None else [None] * self.out_splits
            for row, w_row, b_row in zip(self.linears, w_rows, b_rows):
                for tile, w_tile in zip(row, torch.split(w_row, in_sizes, dim=1)):
                    dst = [tile.weight] + ([tile.bias] if tile.bias is not None else [])
                    with GatheredParameters(dst, modifier_rank=0):
                        tile.weight.copy_(w_tile)
                        if tile.bias is not None and b_row is not None:
                            tile.bias.copy_(b_row)

"""Weight-only int8 quantization with per-group symmetric scales and on-the-fly dequantization.

[Note: int8 weight groups]
A weight ``[out, in]`` is stored as int8 with one fp scale per (output row, input group):
each row is cut into ``q_groups`` contiguous groups of ``in / q_groups`` columns and every
group gets ``scale = max|w| / 127`` (symmetric, zero point 0). ``q_groups=1`` is per-channel
scaling. More groups track outliers better (smaller error) at the cost of more scales.
Activations stay in the compute dtype (weight-only): the matmul dequantizes the weight on the
fly. With one group on CPU it uses torch's fused int8-weight kernel (``_weight_int8pack_mm``),
which never materialises the dequantized weight; otherwise the weight is dequantized into a
temporary of the activation dtype just before ``F.linear``.

Accuracy (tests/test_inference_int8.py): logits of tiny random GPT-2 / Llama models change by
less than 2% of their max magnitude; q_groups > 1 is never worse than 1 on those models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_weight(weight: torch.Tensor, q_groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` -> (int8 ``[out, in]``, fp32 scales ``[out, q_groups]``)."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_weight: expected a 2-D weight [out, in], got shape {tuple(weight.shape)}")
    if isinstance(q_groups, bool) or not isinstance(q_groups, int) or q_groups < 1:
        raise ValueError(f"quantize_weight: q_groups must be an int >= 1, got {q_groups!r}")
    out_f, in_f = weight.shape
    if in_f % q_groups:
        raise ValueError(
            f"quantize_weight: q_groups={q_groups} does not divide the input size {in_f} of a "
            f"[{out_f}, {in_f}] weight; pick a divisor of {in_f}"
        )
    w = weight.detach().float().reshape(out_f, q_groups, in_f // q_groups)
    scales = w.abs().amax(dim=-1).clamp_min(1e-12) / 127.0
    q = torch.round(w / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.reshape(out_f, in_f), scales


def dequantize_weight(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_weight` (up to rounding)."""
    out_f, in_f = q.shape
    groups = scales.shape[1]
    w = q.reshape(out_f, groups, in_f // groups).to(dtype) * scales.to(dtype).unsqueeze(-1)
    return w.reshape(out_f, in_f)


class Int8Weight(nn.Module):
    """An int8 weight with its scales; ``linear(x, bias)`` is ``F.linear`` with the dequantized weight."""

    def __init__(self, weight: torch.Tensor, q_groups: int = 1) -> None:
        super().__init__()
        q, scales = quantize_weight(weight, q_groups)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales)
        self.q_groups = q_groups

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.q_groups == 1 and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            # Fused int8-weight matmul: reads the int8 weight once, no dequantized temporary.
            flat = x.reshape(-1, x.shape[-1])
            if not flat.is_contiguous():
                flat = flat.contiguous()
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scales[:, 0].to(x.dtype))
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out + bias if bias is not None else out
        return F.linear(x, dequantize_weight(self.qweight, self.scales, x.dtype), bias)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.qweight.shape)}, q_groups={self.q_groups}"


class QuantizedLinear(nn.Module):
    """Drop-in for ``nn.Linear`` with an int8 weight (see [Note: int8 weight groups])."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, q_groups: int = 1) -> None:
        super().__init__()
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.weight = Int8Weight(weight, q_groups)
        self.bias = nn.Parameter(bias.detach(), requires_grad=False) if bias is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight.linear(x, self.bias)


def apply_linear(
    weight: torch.Tensor | Int8Weight, x: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear`` for a plain or an int8 weight."""
    if isinstance(weight, Int8Weight):
        return weight.linear(x, bias)
    return F.linear(x, weight, bias)


def quantize_model_(model: nn.Module, q_groups: int = 1, *, skip: tuple[str, ...] = ()) -> int:
    """Quantize every linear of ``model`` in place (``nn.Linear`` and our TP linears); returns the count.

    Embeddings, norms and the modules whose qualified names are in ``skip`` stay unquantized.
    """
    from zero_inference.tp_layers import ShardedLinear

    count = 0
    for name, module in list(model.named_modules()):
        if name in skip:
            continue
        if isinstance(module, ShardedLinear):
            if isinstance(module.weight, nn.Parameter):
                module.quantize_(q_groups)
                count += 1
        elif isinstance(module, nn.Linear):
            _set_submodule(model, name, QuantizedLinear(module.weight, module.bias, q_groups))
            count += 1
    return count


def _set_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)

"""Weight-only int8 quantization with per-group symmetric scales and on-the-fly dequantization.

[Note: int8 weight groups]
A weight ``[out, in]`` is stored as int8 with one fp scale per (output row, input group):
each row is cut into ``q_groups`` contiguous groups of ``in / q_groups`` columns and every
group gets ``scale = max|w| / 127`` (symmetric, zero point 0). ``q_groups=1`` is per-channel
scaling. More groups track outliers better (smaller error) at the cost of more scales.
Activations stay in the compute dtype (weight-only) outside the matmul. On CPU the matmul is
torch's fused int8-weight kernel (``torch._weight_int8pack_mm``), which reads the int8 weight
directly and never materialises a dequantized copy. Its vectorised (AVX-512/AMX) path is the
bf16 one (the fp32 path is a slow reference loop, 4-8x slower than an fp32 matmul measured on
this machine), so activations enter the kernel in bf16 and the result is cast back to the
compute dtype. Groups are stored group-major (``qweight [q_groups, out, group size]``) so each
group is a contiguous matrix for the kernel; the kernel needs a reduction size that is a
multiple of 16, so each group is zero-padded to one (the activation gets matching zero
columns). For a few tokens (decode) all groups run as one kernel call whose diagonal blocks
are the per-group products; for many tokens (prefill) one call per group, accumulated in fp32.
On CUDA the weight is dequantized into a temporary of the activation dtype just before
``F.linear``. Benchmark: tools/bench/results/bench_inference.md.

Accuracy (tests/test_inference_int8.py): logits of tiny random GPT-2 / Llama models change by
less than 2% of their max magnitude (bf16 activations in the kernel included).
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


# torch._weight_int8pack_mm's bf16 CPU kernel reads the reduction dimension in blocks of 16:
# other sizes give wrong results or crash (measured on torch 2.13), so every group is stored
# zero-padded to a multiple of 16 columns (and the activation padded to match).
_KERNEL_K_MULTIPLE = 16
# Up to this many (token, group) rows, grouped weights run as one batched kernel call (decode).
_BATCHED_GROUP_ROWS = 32


def _cpu_kernel_ok(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16)


class Int8Weight(nn.Module):
    """An int8 weight with its scales; ``linear(x, bias)`` is ``F.linear`` with the dequantized weight.

    ``qweight`` is stored group-major, ``[q_groups, out, padded group size]`` (each group's
    ``in / q_groups`` columns, zero-padded to a multiple of 16), so every group is one contiguous
    matrix the CPU int8 kernel takes as is. See [Note: int8 weight groups].
    """

    def __init__(self, weight: torch.Tensor, q_groups: int = 1) -> None:
        super().__init__()
        q, scales = quantize_weight(weight, q_groups)
        out_f, in_f = q.shape
        k = in_f // q_groups
        self.group_size, self.padded_group_size = k, -(-k // _KERNEL_K_MULTIPLE) * _KERNEL_K_MULTIPLE
        grouped = q.reshape(out_f, q_groups, k).permute(1, 0, 2)
        grouped = F.pad(grouped, (0, self.padded_group_size - k)).contiguous()
        self.register_buffer("qweight", grouped)
        self.register_buffer("scales", scales)
        # The CPU kernel multiplies by a per-output-row scale in the activation dtype (bf16).
        self.register_buffer("kernel_scales", scales.t().contiguous().to(torch.bfloat16), persistent=False)
        self.q_groups = q_groups
        self.out_features, self.in_features = out_f, in_f

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.out_features, self.in_features))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out, in]`` weight in ``dtype`` (a temporary; used off the CPU kernel path)."""
        q = self.qweight[..., : self.group_size]
        w = q.to(dtype) * self.scales.t().to(dtype).unsqueeze(-1)
        return w.permute(1, 0, 2).reshape(self.out_features, self.in_features)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if not _cpu_kernel_ok(x):
            return F.linear(x, self.dequantize(x.dtype), bias)
        # torch's fused int8-weight kernel reads the int8 weight directly (never a dequantized
        # copy); its vectorised (AMX/AVX-512) CPU path is the bf16 one, so activations enter in bf16.
        g, k, kp = self.q_groups, self.group_size, self.padded_group_size
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        m = flat.shape[0]
        if kp != k:  # zero columns to match the padded weight groups: they add nothing
            flat = F.pad(flat.view(m, g, k), (0, kp - k)).view(m, g * kp)
        if g == 1:
            out = torch._weight_int8pack_mm(flat.contiguous(), self.qweight[0], self.kernel_scales[0])
            out = out.to(x.dtype)
        elif m * g <= _BATCHED_GROUP_ROWS:
            out = self._grouped_one_call(flat).to(x.dtype)
        else:
            out = None
            for i in range(g):  # one kernel call per group, accumulated in fp32
                part = torch._weight_int8pack_mm(
                    flat[:, i * kp : (i + 1) * kp].contiguous(), self.qweight[i], self.kernel_scales[i]
                )
                out = part.float() if out is None else out.add_(part)
            out = out.to(x.dtype)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + bias if bias is not None else out

    def _grouped_one_call(self, flat: torch.Tensor) -> torch.Tensor:
        # Rows (m, g) of the activation times rows (g', n) of the weight in one kernel call; the
        # blocks g == g' are the per-group products (already scaled), summed in fp32. It computes
        # q_groups times the needed products but reads the weight once: faster for few tokens.
        m, g, kp = flat.shape[0], self.q_groups, self.padded_group_size
        y = torch._weight_int8pack_mm(
            flat.reshape(m * g, kp).contiguous(),
            self.qweight.reshape(g * self.out_features, kp),
            self.kernel_scales.reshape(-1),
        )
        return torch.diagonal(y.view(m, g, g, self.out_features), dim1=1, dim2=2).float().sum(-1)

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, q_groups={self.q_groups}"


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

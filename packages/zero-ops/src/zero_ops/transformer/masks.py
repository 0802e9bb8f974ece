"""Attention masks as BERT passes them, turned into one additive bias for the fused layer."""

from __future__ import annotations

import torch


def attention_bias(
    mask: torch.Tensor | None, batch: int, seq: int, dtype: torch.dtype, where: str
) -> torch.Tensor | None:
    """An additive bias broadcastable to (batch, heads, seq, seq), or None for no mask.

    Accepted: Hugging Face's extended mask (additive, 0 to attend and a large negative value
    not to, shape (batch or 1, 1, 1 or seq, seq)); a bool mask of those shapes (True = attend,
    as ``scaled_dot_product_attention`` takes it); a (batch, seq) padding mask of 0/1 (1 =
    attend, the ``attention_mask`` a user passes to ``BertModel``).
    """
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"{where}.forward: attention_mask must be a tensor or None, got {type(mask).__name__}"
        )
    if mask.dim() == 2:
        if tuple(mask.shape) != (batch, seq):
            raise ValueError(
                f"{where}.forward: a 2-D attention_mask must be (batch, seq) = {(batch, seq)}, got {tuple(mask.shape)}"
            )
        mask = mask.bool()[:, None, None, :]
    elif mask.dim() == 4:
        ok = all(d in (1, want) for d, want in zip(mask.shape, (batch, 1, seq, seq), strict=True))
        if not ok:
            raise ValueError(
                f"{where}.forward: a 4-D attention_mask must broadcast to ({batch}, heads, {seq}, {seq}) "
                f"with one head dimension, got {tuple(mask.shape)}"
            )
    else:
        raise ValueError(
            f"{where}.forward: attention_mask must be 2-D (batch, seq) or 4-D (batch, 1, 1 or seq, seq), "
            f"got {mask.dim()}-D {tuple(mask.shape)}"
        )
    if mask.dtype == torch.bool:
        bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
        return bias.masked_fill_(~mask, torch.finfo(dtype).min)
    if not mask.is_floating_point():
        raise TypeError(
            f"{where}.forward: a 4-D attention_mask must be additive (float) or bool, got {mask.dtype}"
        )
    return mask.to(dtype)

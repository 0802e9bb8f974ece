"""Activation memory of the fused layer: what each switch should save, and how to measure it.

[Note: measuring saved activations]
What autograd keeps for backward is what ``torch.autograd.graph.saved_tensors_hooks`` sees
packed. :func:`saved_bytes` counts each distinct storage once (views of one buffer, and a tensor
saved by two ops, are one allocation) and skips parameters. A layer's own cost is its *marginal*
cost in a stack: a tensor one layer saves may be its neighbour's input or output that the
neighbour saves anyway (``normalize_invertible`` relies on exactly that), so
:func:`layer_saved_bytes` measures a stack of two layers minus a stack of one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from zero_ops.transformer.config import TransformerConfig

SWITCHES = ("normalize_invertible", "gelu_checkpoint", "attn_dropout_checkpoint")


def stated_savings(
    config: TransformerConfig,
    batch: int,
    seq: int,
    *,
    training: bool = True,
    device: torch.device | str = "cpu",
) -> dict[str, int]:
    """Bytes of saved activations per layer each switch removes (at this batch and sequence).

    - ``normalize_invertible``: both LayerNorm inputs and their means (in the statistics dtype
      torch's LayerNorm uses on ``device``);
    - ``gelu_checkpoint``: the GELU output, batch*seq*intermediate_size;
    - ``attn_dropout_checkpoint``: the dropped attention probabilities, batch*heads*seq*seq;
      zero where there is no dropout output to keep (eval, ratio 0, or ``stochastic_mode``,
      whose fused kernel keeps none).
    """
    config.require("hidden_size", "heads", "attn_dropout_ratio", why="to size the activations")
    elem = torch.empty((), dtype=config.dtype).element_size()
    tokens = batch * seq
    # LayerNorm's statistics dtype is the backend's choice (float32 for half inputs on CUDA,
    # the input's dtype on CPU): ask it
    probe = torch.zeros(1, 1, dtype=config.dtype, device=device)
    stat = torch.native_layer_norm(probe, (1,), None, None, 1e-5)[1].element_size()
    dropout_kept = training and config.attn_dropout_ratio > 0 and not config.stochastic_mode
    return {
        "normalize_invertible": 2 * (tokens * config.hidden_size * elem + tokens * stat),
        "gelu_checkpoint": tokens * config.intermediate_size * elem,
        "attn_dropout_checkpoint": batch * config.heads * seq * seq * elem if dropout_kept else 0,
    }


def saved_bytes(fn: Callable[[], object], *, exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves while ``fn()`` runs, not counting the
    storages of ``exclude`` (pass the parameters: ops save them, or views of them, but they are
    not activations). See [Note: measuring saved activations]."""
    seen: dict[int, int] = {}
    skip = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
        total = sum(seen.values())  # while ``out`` keeps the graph (and every saved storage) alive
    del out
    return total


def layer_saved_bytes(
    make_layer: Callable[[], torch.nn.Module], x: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> int:
    """Marginal saved-activation bytes of one layer: a stack of two minus a stack of one, each
    run under the same random state. See [Note: measuring saved activations]."""
    layers = [make_layer(), make_layer()]
    x = x.detach().requires_grad_(True)

    def run(n: int) -> Callable[[], object]:
        def go() -> object:
            h = x
            for layer in layers[:n]:
                h = layer(h, attention_mask)
                h = h[0] if isinstance(h, tuple) else h
            return h

        return go

    exclude = [x, *(p for layer in layers for p in layer.parameters())]
    state = torch.get_rng_state()
    one = saved_bytes(run(1), exclude=exclude)
    torch.set_rng_state(state)
    two = saved_bytes(run(2), exclude=exclude)
    return two - one

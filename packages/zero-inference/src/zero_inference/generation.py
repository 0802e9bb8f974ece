"""Token generation for causal LMs: greedy and sampling decoding over a KV cache.

[Note: generation loop]
One prefill forward over the prompt, then one forward per new token over that token alone,
the keys/values of earlier tokens coming from a cache: the HF model's own cache object
(``past_key_values``) for plain models, or the preallocated cache of the kernel-injected
decoder (kernel_inject.py). Left padding is supported through ``attention_mask`` (positions
are counted from the first real token, as transformers does). Under tensor parallelism every
rank computes the same gathered logits; the chosen token is broadcast from rank 0 anyway so
sampling (which draws random numbers) cannot make ranks diverge.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from zero_core import comm

# step(input_ids, attention_mask, position_ids, state) -> (last-token logits [B, V], state)
StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Any], tuple[torch.Tensor, Any]]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"generate: {name} must be an int >= {minimum}, got {value!r}")
    return value


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass of the tokens strictly before it already reaches top_p.
        drop = (probs.cumsum(dim=-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits


def decode(
    step: StepFn,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    generator: torch.Generator | None = None,
    max_out_tokens: int | None = None,
    min_out_tokens: int = 1,
    group: object = None,
) -> torch.Tensor:
    """Prompt + generated tokens ``[B, T + n]``. See [Note: generation loop]."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            "generate: input_ids must be a 2-D torch.long tensor [batch, prompt_len], got "
            f"{type(input_ids).__name__}{'' if not isinstance(input_ids, torch.Tensor) else tuple(input_ids.shape)}"
        )
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("top_k", top_k, 0)
    if not (isinstance(temperature, (int, float)) and temperature > 0):
        raise ValueError(f"generate: temperature must be a number > 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be in (0, 1], got {top_p!r}")
    batch, prompt_len = input_ids.shape
    if max_out_tokens is not None:
        if prompt_len + max_new_tokens > max_out_tokens:
            raise ValueError(
                f"generate: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"max_out_tokens={max_out_tokens} of the inference config; raise max_out_tokens"
            )
        if max_out_tokens - prompt_len < min_out_tokens:
            raise ValueError(
                f"generate: only {max_out_tokens - prompt_len} tokens fit after a {prompt_len}-token prompt "
                f"but min_out_tokens={min_out_tokens}"
            )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    elif attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"generate: attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id or [])
    eos_t = torch.tensor(eos, dtype=torch.long, device=input_ids.device)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    distributed = comm.is_initialized() and comm.get_world_size(group) > 1

    tokens = input_ids
    mask = attention_mask.to(torch.long)
    position_ids = (mask.cumsum(-1) - 1).clamp_min(0)
    finished = torch.zeros(batch, dtype=torch.bool, device=input_ids.device)
    state: Any = None
    step_ids, step_pos = input_ids, position_ids
    for _ in range(max_new_tokens):
        logits, state = step(step_ids, mask, step_pos, state)
        logits = logits.float()
        if do_sample:
            logits = _filter_logits(logits / temperature, top_k, top_p)
            nxt = torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        if distributed:
            src = comm.get_global_rank(group, 0) if group is not None else 0
            comm.broadcast(nxt, src, group=group)
        nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], dim=-1)
        if eos:
            finished |= torch.isin(nxt, eos_t)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
        step_ids = nxt[:, None]
        step_pos = position_ids[:, -1:] + 1
        position_ids = torch.cat([position_ids, step_pos], dim=-1)
        if eos and bool(finished.all()):
            break
    return tokens


#: decoding settings :func:`decode` implements; unset ones come from the model's generation_config
DECODE_SETTINGS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "eos_token_id": None,
    "pad_token_id": None,
}


def resolve_settings(
    model: torch.nn.Module,
    prompt_len: int,
    given: dict[str, Any],
    max_new_tokens: int | None,
    max_length: int | None,
) -> tuple[dict[str, Any], int]:
    """(decoding settings, max_new_tokens) with the unset ones taken as transformers' generate does.

    [Note: generation defaults]
    DeepSpeed's ``InferenceEngine.generate`` is the model's own ``generate``, so settings the
    caller leaves out come from the model's ``generation_config``: ``eos_token_id`` (generation
    stops there and finished rows are padded with ``pad_token_id``, else the first eos),
    ``do_sample``/``temperature``/``top_k``/``top_p``, and the length (``max_new_tokens``, else
    ``max_length`` counting the prompt, transformers' default 20). A model without a
    generation_config gets greedy decoding of 20 new tokens without eos.
    """
    config = getattr(model, "generation_config", None)
    settings = {}
    for key, fallback in DECODE_SETTINGS.items():
        value = given.get(key)
        if value is None and config is not None:
            value = getattr(config, key, None)
        settings[key] = fallback if value is None else value
    if max_new_tokens is None and max_length is None and config is not None:
        max_new_tokens = getattr(config, "max_new_tokens", None)
        if max_new_tokens is None:
            max_length = getattr(config, "max_length", None)
    if max_new_tokens is None:
        if max_length is None:
            return settings, 20
        _check_int("max_length", max_length, 1)
        if max_length <= prompt_len:
            raise ValueError(
                f"generate: max_length={max_length} leaves no room after a {prompt_len}-token prompt; "
                "pass max_new_tokens"
            )
        return settings, max_length - prompt_len
    return settings, max_new_tokens


def hf_step(model: torch.nn.Module) -> StepFn:
    """Step function running an HF causal LM with its own cache object."""

    def step(
        ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, Any]:
        kwargs: dict[str, Any] = {"attention_mask": mask, "use_cache": True, "position_ids": pos}
        if cache is not None:
            kwargs["past_key_values"] = cache
        out = model(input_ids=ids, **kwargs)
        return out.logits[:, -1, :], out.past_key_values

    return step

"""Shared machinery of the CPU optimizers (CPUAdam, CPUAdagrad, CPULion).

[Note: CPU optimizer state layout]
State is kept exactly as torch.optim keeps it (``step`` as a 0-d fp32 tensor, then the named
moment buffers, e.g. ``exp_avg``/``exp_avg_sq``), so a state_dict moves between these optimizers
and torch's Adam/AdamW/Adagrad in both directions. Parameters may be fp32, bf16 or fp16:
  * fp32 parameters are updated in place;
  * bf16/fp16 parameters with ``fp32_optimizer_states=True`` (the default) get an fp32 master copy
    in ``state["master_param"]``; one fused kernel pass updates master and fp32 moments and
    writes the rounded 16-bit parameter (see cpu_adam_step's ``low_precision_out``);
  * with ``fp32_optimizer_states=False`` the moments have the parameter's dtype and no master is
    kept (DeepSpeed's behaviour); the update still computes in fp32.
torch's ``load_state_dict`` casts loaded state to the parameter's dtype, which would drop fp32
moments of a bf16 parameter to bf16; ``load_state_dict`` below restores them at full precision.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero_ops import _flat

PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class CPUOptimizerBase(torch.optim.Optimizer):
    """Base of the CPU optimizers: validation, state creation, fp32 working copies.

    Subclasses set ``_update_fn``, the optimizer's update on contiguous fp32 buffers, called with
    the param group as hyper-parameters (see [Note: one update function] in zero_ops.flat_kernel),
    define ``_state_names(group)`` and optionally ``_normalize_loaded_group(group)``.
    """

    _update_fn: Callable[..., None]
    threads: int | None = None

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], fp32_optimizer_states: bool) -> None:
        if not isinstance(fp32_optimizer_states, bool):
            raise TypeError(f"{type(self).__name__}: fp32_optimizer_states must be a bool")
        self.fp32_optimizer_states = fp32_optimizer_states
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.device.type != "cpu":
                    raise ValueError(f"{type(self).__name__}: parameters must be on the CPU, got {p.device}")
                if p.dtype not in PARAM_DTYPES:
                    raise TypeError(
                        f"{type(self).__name__}: parameter dtype {p.dtype} is not supported; "
                        "allowed: torch.float32, torch.bfloat16, torch.float16"
                    )

    # -- subclass hooks ------------------------------------------------------------------
    def _state_names(self, group: dict[str, Any]) -> tuple[str, ...]:
        raise NotImplementedError

    def _normalize_loaded_group(self, group: dict[str, Any]) -> None:
        """Fills keys of this optimizer missing from a group saved by another optimizer."""

    # -- torch.optim.Optimizer API -------------------------------------------------------
    def _state_dtype(self, p: torch.Tensor) -> torch.dtype:
        return torch.float32 if self.fp32_optimizer_states else p.dtype

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Performs one optimization step; ``closure`` re-evaluates the model and returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        name = type(self).__name__
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    self._step_sparse(p, grad, group)
                    continue
                if grad.device.type != "cpu" or grad.dtype not in PARAM_DTYPES:
                    raise TypeError(
                        f"{name}: gradient must be a CPU fp32/bf16/fp16 tensor, got "
                        f"{grad.dtype} on {grad.device}"
                    )
                self._step_param(p, grad.contiguous(), group)
        return loss

    def _step_sparse(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        """A sparse gradient (``nn.Embedding(sparse=True)``): only optimizers that define it."""
        raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")

    def _new_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
        for key in self._state_names(group):
            if key not in state:
                state[key] = torch.zeros(p.shape, dtype=self._state_dtype(p))
        return state

    def _step_param(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any]) -> None:
        state = self._new_state(p, group)
        state["step"] += 1
        step = int(state["step"].item())
        low_precision = p.dtype != torch.float32
        if low_precision and self.fp32_optimizer_states:
            master = state.get("master_param")
            if master is None or master.shape != p.shape:
                master = state["master_param"] = p.detach().float().contiguous()
            lp_out = p if p.is_contiguous() else torch.empty(p.shape, dtype=p.dtype)
            states = {k: state[k] for k in self._state_names(group)}
            self._update(master, grad, states, lp_out, group, step)
            if lp_out is not p:
                p.copy_(lp_out)
            return
        # fp32 parameters (in place when contiguous), or 16-bit states: compute on fp32 copies.
        direct = p.dtype == torch.float32 and p.is_contiguous()
        work = p if direct else p.detach().float().contiguous()
        states = {}
        for k in self._state_names(group):
            t = state[k]
            states[k] = t if (t.dtype == torch.float32 and t.is_contiguous()) else t.float().contiguous()
        self._update(work, grad, states, None, group, step)
        for k, t in states.items():
            if t is not state[k]:
                state[k].copy_(t)
        if not direct:
            p.copy_(work)

    def _update(
        self,
        work: torch.Tensor,
        grad: torch.Tensor,
        states: dict[str, torch.Tensor],
        lp_out: torch.Tensor | None,
        group: dict[str, Any],
        step: int,
    ) -> None:
        """Runs ``_update_fn`` on flat views of the contiguous buffers, the group as hyper-parameters."""
        flat_states = {k: v.view(-1) for k, v in states.items()}
        lp_flat = None if lp_out is None else lp_out.view(-1)
        update = _flat.FlatUpdate(
            work.view(-1), grad.view(-1), flat_states, lp_flat, group, step, group["lr"], self.threads
        )
        type(self)._update_fn(update)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state_dict of this optimizer or of torch's matching optimizer.

        See [Note: CPU optimizer state layout]: floating-point state is restored in the dtype
        this optimizer keeps it in (fp32 by default), not cast to the parameter's dtype.
        """
        if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: expected a dict with 'state' and "
                "'param_groups' (an optimizer state_dict)"
            )
        saved_state = state_dict["state"]
        groups = [dict(g) for g in state_dict["param_groups"]]
        for g in groups:
            self._normalize_loaded_group(g)
        super().load_state_dict({"state": saved_state, "param_groups": groups})
        saved_ids = itertools.chain.from_iterable(g["params"] for g in groups)
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for idx, p in zip(saved_ids, params):
            for key, value in saved_state.get(idx, {}).items():
                if key == "step":
                    self.state[p][key] = torch.as_tensor(value, dtype=torch.float32).clone().reshape(())
                elif isinstance(value, torch.Tensor) and value.is_floating_point():
                    dtype = torch.float32 if key == "master_param" else self._state_dtype(p)
                    self.state[p][key] = value.detach().to(device="cpu", dtype=dtype, copy=True).contiguous()

"""0/1 Adam (Lu et al., arXiv 2202.06009), as DeepSpeed's ``ZeroOneAdam`` exposes it.

Two phases, split at ``var_freeze_step``:

1. Adaptive variance freezing. Step ``t`` is a *variance step* when ``t % var_interval == 0``;
   ``var_interval`` starts at 1 and doubles after every ``var_update_scaler`` variance steps
   (the paper's exponential rule, kappa = ``var_update_scaler``). On a variance step the
   gradients are all-reduced at full precision (by the engine) and both moments are updated;
   on the others the variance stays frozen and the momentum is updated with the gradient
   averaged through the 1-bit exchange. Every rank applies the same update.
2. Local steps. After ``var_freeze_step`` the variance is frozen for good and each rank steps
   on its own gradients, remembering the parameters of the last synchronisation (the anchor)
   and accumulating ``u += lr * m_hat``. Every ``local_step_interval`` steps the ranks average
   ``u`` through the 1-bit exchange; every rank sets ``p = anchor - mean(u) / denom`` and the
   momentum to ``mean(u) / sum(lr)`` (see ``_synchronize``). The interval starts at 1 and
   doubles every ``local_step_scaler`` steps, up to ``local_step_clipper`` (the paper's H).
   The anchor is one parameter-sized buffer more than DeepSpeed keeps; with it every rank
   lands on bit-identical parameters at each synchronisation.

The moments are bias-corrected when ``bias_correction`` (DeepSpeed's implementation accepts
and ignores the flag): the momentum by ``1 - beta1**t``, the variance by ``1 - beta2**k`` with
``k`` the number of variance steps so far. The error-feedback buffers start from zero again at
the phase change: phase 1 exchanges gradients, phase 2 accumulated momenta.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from zero_ops.onebit.adam import adam_apply, adam_denominator, adam_moments
from zero_ops.onebit.base import CompressedOptimizer, check_int, init_adam_style

_PHASE = {
    "compression_step": 0,
    "var_interval": 1,
    "var_counter": 0,
    "var_updates": 0,
    "local_step_interval": 1,
    "local_step_counter": 0,
    "steps_since_sync": 0,
    "local_lrs": 0.0,
}


class ZeroOneAdam(CompressedOptimizer):
    """DeepSpeed's ``ZeroOneAdam(params, deepspeed, lr, bias_correction, betas, eps, eps_inside_sqrt,
    weight_decay, max_grad_norm, var_freeze_step, var_update_scaler, local_step_scaler,
    local_step_clipper, amsgrad, cuda_aware, comm_backend_name)``.

    See [Note: communication-compressed optimizers]. ``local_lrs`` (the learning rates summed
    since the last synchronisation) is kept per param group, as groups may differ in lr.
    """

    PHASE = _PHASE

    def __init__(
        self,
        params: Iterable[Any],
        deepspeed: object = None,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        var_freeze_step: int = 100000,
        var_update_scaler: int = 16,
        local_step_scaler: int = 32678,
        local_step_clipper: int = 16,
        amsgrad: bool = False,
        cuda_aware: bool = False,
        comm_backend_name: str = "nccl",
    ) -> None:
        self.var_freeze_step = check_int("var_freeze_step", "ZeroOneAdam", var_freeze_step, 1)
        self.var_update_scaler = check_int("var_update_scaler", "ZeroOneAdam", var_update_scaler, 1)
        self.local_step_scaler = check_int("local_step_scaler", "ZeroOneAdam", local_step_scaler, 1)
        self.local_step_clipper = check_int("local_step_clipper", "ZeroOneAdam", local_step_clipper, 1)
        init_adam_style(self, params, locals())

    # -- policy --------------------------------------------------------------------------
    def local_phase(self) -> bool:
        """Whether the variance is frozen for good (phase 2: local steps)."""
        return self.phase("compression_step") >= self.var_freeze_step

    def _is_variance_step(self, step: int) -> bool:
        return not self.local_phase() and step % self.phase("var_interval") == 0

    def communicates_gradients(self) -> bool:
        return not self._is_variance_step(self.phase("compression_step") + 1)

    def _has_rank_state(self) -> bool:
        return self.phase("compression_step") > 1

    def _advance_policy(self, step: int, variance_step: bool) -> None:
        if self.local_phase():
            counter = self.phase("local_step_counter") + 1
            if counter == self.local_step_scaler:
                counter = 0
                self.set_phase(
                    "local_step_interval", min(self.local_step_clipper, 2 * self.phase("local_step_interval"))
                )
            self.set_phase("local_step_counter", counter)
        elif variance_step:
            counter = self.phase("var_counter") + 1
            if counter == self.var_update_scaler:
                counter = 0
                self.set_phase("var_interval", 2 * self.phase("var_interval"))
            self.set_phase("var_counter", counter)

    # -- the step ------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        step = self.phase("compression_step") + 1
        local = self.local_phase()
        variance_step = self._is_variance_step(step)
        if variance_step:
            self.average_dense_gradients()
            self.set_phase("var_updates", self.phase("var_updates") + 1)
        sync = False
        if local:
            sync = self.phase("steps_since_sync") + 1 >= self.phase("local_step_interval")
        for index, group in enumerate(self.param_groups):
            if local:
                self._local_step(index, group, step, sync)
            else:
                self._synchronous_step(index, group, step, variance_step)
        self._advance_policy(step, variance_step)
        self.set_phase("compression_step", step)
        self.set_phase("steps_since_sync", 0 if sync or not local else self.phase("steps_since_sync") + 1)
        if not local and self.local_phase():  # the variance froze for good with this step
            self._begin_local_phase()
        return loss

    def _synchronous_step(self, index: int, group: dict[str, Any], step: int, variance_step: bool) -> None:
        params = self.trained(group)
        if not params:
            return
        beta1, beta2 = group["betas"]
        moments = [adam_moments(self.state[p], p) for p in params]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        if not variance_step:
            grads = [g.clone() for g in grads]
            self.exchange(index, grads)
        for p, g, (m, v) in zip(params, grads, moments):
            m.lerp_(g, 1 - beta1)
            if variance_step:
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            adam_apply(p, m, adam_denominator(v, group, self.phase("var_updates")), group, step)

    def _begin_local_phase(self) -> None:
        self.reset_errors()
        for group in self.param_groups:
            for p in self.trained(group):
                self.state[p]["anchor"] = p.detach().clone()
                self.state[p]["momentum_accumulator"] = torch.zeros_like(p)

    def _local_step(self, index: int, group: dict[str, Any], step: int, sync: bool) -> None:
        params = self.trained(group)
        if not params:
            return
        beta1 = group["betas"][0]
        var_updates = self.phase("var_updates")
        bc1 = 1 - beta1**step if group["bias_correction"] else 1.0
        for p in params:
            state = self.state[p]
            m, v = adam_moments(state, p)
            if p.grad is not None:
                m.lerp_(p.grad, 1 - beta1)
            else:
                m.mul_(beta1)
            state["momentum_accumulator"].add_(m, alpha=group["lr"] / bc1)
            adam_apply(p, m, adam_denominator(v, group, var_updates), group, step)
        group["local_lrs"] = group["local_lrs"] + group["lr"]
        if sync:
            self._synchronize(index, group, params, step)

    def _synchronize(self, index: int, group: dict[str, Any], params: list[torch.Tensor], step: int) -> None:
        """Average the momentum accumulated since the last synchronisation; rebuild p and the momentum.

        As the paper's Algorithm 1: ``u`` sums ``lr * m_hat`` over the interval; every rank takes
        ``p = anchor - mean(u) / denom`` (less the decoupled weight decay of the interval) and the
        momentum ``m_hat = mean(u) / sum(lr)``. Compressing momentum rather than parameter updates
        keeps the 1-bit noise out of the elements with a large variance.
        """
        accumulators = [self.state[p]["momentum_accumulator"] for p in params]
        self.exchange(index, accumulators)
        lrs, wd = group["local_lrs"], group["weight_decay"]
        bc1 = 1 - group["betas"][0] ** step if group["bias_correction"] else 1.0
        for p, u in zip(params, accumulators):
            state = self.state[p]
            anchor = state["anchor"]
            denom = adam_denominator(state["exp_avg_sq"], group, self.phase("var_updates"))
            p.copy_(anchor)
            if wd != 0:
                p.mul_(1 - wd * lrs)
            p.addcdiv_(u, denom, value=-1.0)
            if lrs > 0:
                state["exp_avg"].copy_(u).mul_(bc1 / lrs)
            anchor.copy_(p)
            u.zero_()
        group["local_lrs"] = 0.0

    # -- per-rank state: between synchronisations the parameters and momentum are local --
    def rank_local_state(self) -> dict[str, torch.Tensor]:
        out = super().rank_local_state()
        if self.local_phase() and self.phase("steps_since_sync") > 0:
            for index, group in enumerate(self.param_groups):
                params = self.trained(group)
                if params:
                    out[f"local_params.{index}"] = torch.cat([p.detach().reshape(-1) for p in params])
                    out[f"local_exp_avg.{index}"] = torch.cat(
                        [self.state[p]["exp_avg"].reshape(-1) for p in params]
                    )
        return out

    @torch.no_grad()
    def load_rank_local_state(self, state: dict[str, torch.Tensor] | None, reason: str = "") -> None:
        super().load_rank_local_state(state, reason)
        if self.local_phase() and self.phase("steps_since_sync") > 0 and state is None:
            # another world size: restart the interval from the last synchronised parameters
            for group in self.param_groups:
                for p in self.trained(group):
                    p.copy_(self.state[p]["anchor"])
                    self.state[p]["momentum_accumulator"].zero_()
                group["local_lrs"] = 0.0
            self.set_phase("steps_since_sync", 0)
            return
        for index, group in enumerate(self.param_groups):
            params = self.trained(group)
            if state is None or f"local_params.{index}" not in state:
                continue
            sizes = [p.numel() for p in params]
            for p, piece in zip(params, state[f"local_params.{index}"].split(sizes)):
                p.copy_(piece.view_as(p))
            for key in ("exp_avg", "momentum_accumulator"):
                for p, piece in zip(params, state[f"local_{key}.{index}"].split(sizes)):
                    self.state[p][key].copy_(piece.view_as(p))

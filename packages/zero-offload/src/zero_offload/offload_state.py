"""State access of ``OptimizerOffload`` (a mixin): per-master states, masters, checkpoints.

The optimizer states and (ZeRO-Infinity) the fp32 masters live in host buffers or swap files
rather than in the client optimizer's ``state``; these methods read and write them in torch's
format for checkpoints, ``safe_get``-style accessors and ``load_state_dict`` (see
[Note: masters on NVMe] below and [Note: optimizer offload hook] in optimizer_offload.py).
"""

from __future__ import annotations

from typing import Any

import torch
from zero_core.checkpoint.fragments import DeferredTensor
from zero_core.protocols.optimizer_offload import NoOptimizerOffload

from zero_offload.offload_groups import _MASTER, _NOT_STATES, _Group
from zero_offload.transfers import CopyFence

# answers the calls about masters this offload does not own (See [Note: optimizer offload seam])
_NOT_OWNED = NoOptimizerOffload()


class OffloadStateMixin:
    """Checkpoint and state access of :class:`~zero_offload.optimizer_offload.OptimizerOffload`."""

    masters_on_nvme: bool
    copied_back: CopyFence
    nvme_tile: int
    groups: list[_Group]
    _where: dict[int, tuple[int, int]]

    # -- state access (checkpoints, safe_get) --------------------------------------------------
    def state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """``master``'s optimizer state in torch's format (NVMe: read from the swap files)."""
        if id(master) not in self._where:  # not offloaded (ratio < 1): See [Note: optimizer offload seam]
            return _NOT_OWNED.state_of(optimizer, master)
        g, i = self._where[id(master)]
        grp = self.groups[g]
        state = dict(optimizer.state.get(master, {}))
        if grp.swapper is not None:
            lo, hi = grp.offsets[i], grp.offsets[i + 1]
            for k in grp.swapper.state_names:
                if k not in _NOT_STATES:
                    state[k] = grp.swapper.read_range(k, lo, hi).view(master.shape)
        return state

    def deferred_state_of(self, optimizer: torch.optim.Optimizer, master: torch.Tensor) -> dict[str, Any]:
        """:meth:`state_of` for writing checkpoints: states in swap files are ``DeferredTensor``
        values read only when written (See [Note: deferred fragments] in zero-core)."""
        if id(master) not in self._where:  # not offloaded: See [Note: optimizer offload seam]
            return _NOT_OWNED.deferred_state_of(optimizer, master)
        g, i = self._where[id(master)]
        grp = self.groups[g]
        if grp.swapper is None:
            return self.state_of(optimizer, master)  # host views: nothing is copied
        state = dict(optimizer.state.get(master, {}))
        lo, hi = grp.offsets[i], grp.offsets[i + 1]
        for k in grp.swapper.state_names:
            if k not in _NOT_STATES:
                state[k] = DeferredTensor(hi - lo, torch.float32, _range_reader(grp, k, lo, hi))
        return state

    # [Note: masters on NVMe]
    # ZeRO-Infinity (stage 3 with offload_optimizer nvme): the fp32 masters are one more swapped
    # array of the tile pipeline ([Note: tile pipeline]), read and written with the Adam states
    # of the same tile, so resident CPU memory for masters + states is buffer_count x tile x
    # (states + 2) x 4 bytes (the gradients are the other swapped array). The master
    # Parameters the client optimizer holds keep their shapes but own no memory (their storage
    # is empty); code that needs master values reads or writes them here (``master_value`` /
    # ``set_master``), straight from and to the swap file. The updated weights (in the training
    # dtype, fp32 included) go to the module through the step's ``publish`` callback, master by
    # master (See [Note: ZeRO-Infinity streaming] in offload_stream.py).
    @torch.no_grad()
    def master_value(self, master: torch.Tensor) -> torch.Tensor:
        """A new fp32 tensor with ``master``'s values (shape of ``master``), wherever they live."""
        if id(master) not in self._where:  # not offloaded: See [Note: optimizer offload seam]
            return _NOT_OWNED.master_value(master)
        g, i = self._where[id(master)]
        grp = self.groups[g]
        lo, hi = grp.offsets[i], grp.offsets[i + 1]
        if not self.masters_on_nvme:
            return grp.master[lo:hi].clone().view(master.shape)
        return self._read_array(grp, _MASTER, lo, hi).view(master.shape)

    @torch.no_grad()
    def set_master(self, master: torch.Tensor, values: torch.Tensor) -> None:
        """Set ``master``'s fp32 values (and its updated low-precision copy), wherever they live."""
        if id(master) not in self._where:  # not offloaded: See [Note: optimizer offload seam]
            _NOT_OWNED.set_master(master, values)
            return
        g, i = self._where[id(master)]
        grp = self.groups[g]
        lo, hi = grp.offsets[i], grp.offsets[i + 1]
        v = values.detach().reshape(-1).to(torch.float32)
        if v.numel() != hi - lo:
            raise ValueError(
                f"OptimizerOffload.set_master: {v.numel()} values for a master of {hi - lo} elements"
            )
        self.copied_back.wait()  # a copy to the device may still read them: See [Note: offload copies]
        if self.masters_on_nvme:
            self._write_array(grp, _MASTER, lo, v)
        else:
            grp.master[lo:hi].copy_(v)
        if grp.low is not None:
            grp.low[lo:hi].copy_(v)
        if grp.device_low is not None:
            grp.device_low[lo:hi].copy_(grp.low[lo:hi] if grp.low is not None else v)

    @torch.no_grad()
    def sync_from_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: move the loaded states into their offloaded homes.

        torch's ``load_state_dict`` replaces each ``optimizer.state[p]`` with new tensors; this
        copies them to the host buffers / swap files and restores the views (cpu) or the
        step-only entries (nvme).
        """
        for grp in self.groups:
            for i, p in enumerate(grp.params):
                state = dict(optimizer.state.get(p, {}))
                lo, hi = grp.offsets[i], grp.offsets[i + 1]
                if grp.swapper is None:
                    mine = {"step": torch.tensor(float(state.get("step", 0.0)))}
                    mine.update({k: v[lo:hi].view(p.shape) for k, v in grp.states.items()})
                    optimizer.state[p] = mine
                else:
                    optimizer.state[p] = {"step": torch.tensor(float(state.get("step", 0.0)))}
                tensors = {k: v for k, v in state.items() if k != "step" and torch.is_tensor(v)}
                if tensors:
                    self.load_state(optimizer, p, tensors)

    def state_dict_with_states(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """``optimizer.state_dict()`` with the NVMe-resident states read in (a snapshot)."""
        sd = optimizer.state_dict()
        # a snapshot: torch's state_dict shares the live tensors (``step`` is updated in place)
        sd["state"] = {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in st.items()}
            for k, st in sd["state"].items()
        }
        index = {}
        k = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                index[id(p)] = k
                k += 1
        for grp in self.groups:
            if grp.swapper is None:
                continue
            for p in grp.params:
                if id(p) in index:
                    entry = dict(sd["state"].get(index[id(p)], {}))
                    entry.update({k: v for k, v in self.state_of(optimizer, p).items() if k != "step"})
                    sd["state"][index[id(p)]] = entry
        return sd

    @torch.no_grad()
    def load_state(
        self, optimizer: torch.optim.Optimizer, master: torch.Tensor, state: dict[str, Any]
    ) -> None:
        """Replace ``master``'s optimizer state with ``state`` (torch's format), wherever it lives."""
        if id(master) not in self._where:  # not offloaded: See [Note: optimizer offload seam]
            _NOT_OWNED.load_state(optimizer, master, state)
            return
        g, i = self._where[id(master)]
        grp = self.groups[g]
        lo, hi = grp.offsets[i], grp.offsets[i + 1]
        names = (
            tuple(k for k in grp.swapper.state_names if k not in _NOT_STATES)
            if grp.swapper is not None
            else tuple(grp.states)
        )
        mine = optimizer.state.setdefault(master, {"step": torch.tensor(0.0)})
        for k, v in state.items():
            if k not in names:
                if k == "step":
                    mine["step"] = torch.tensor(float(v))
                else:
                    mine[k] = v
                continue
            if torch.is_tensor(v) and v.numel() != hi - lo:
                raise ValueError(
                    f"OptimizerOffload.load_state: state {k!r} has {v.numel()} elements, the master has {hi - lo}"
                )
            if grp.swapper is not None:
                grp.swapper.write_range(k, lo, v)
            else:
                grp.states[k][lo:hi].copy_(torch.as_tensor(v).reshape(-1))

    @torch.no_grad()
    def refresh_low_precision(self) -> None:
        """Re-derive the low-precision copies from the masters (after masters were loaded or set)."""
        self.copied_back.wait()  # a copy to the device may still read them: See [Note: offload copies]
        for grp in self.groups:
            if self.masters_on_nvme:
                continue  # no host copy: the strategy writes loaded weights to the parameters itself
            if grp.low is not None:
                grp.low.copy_(grp.master)
            if grp.device_low is not None:
                grp.device_low.copy_(grp.low if grp.low is not None else grp.master)


def _range_reader(grp: _Group, key: str, lo: int, hi: int) -> Any:
    return lambda: grp.swapper.read_range(key, lo, hi)

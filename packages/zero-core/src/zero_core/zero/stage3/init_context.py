"""``zero.Init``: build a model already partitioned, one submodule at a time.

[Note: stage 3 construction]
Inside the context every ``nn.Module`` subclass's ``__init__`` is wrapped: when the outermost
``__init__`` of an object returns, its direct parameters are broadcast from rank 0 (so ranks
agree whatever their RNG), cast to the target dtype and cut to the local 1/N shard. A
parent's ``__init__`` thus never sees its children's full parameters and the largest full
tensor ever allocated is one submodule's. Code that reads a released parameter during
construction (``self.child.weight.data.normal_()``, ``named_parameters()`` inside an init
function) gets it gathered on access; it is re-partitioned, with rank 0's value, when the
``__init__`` (or ``apply`` function) that touched it returns. With ``override_module_apply``
``Module.apply`` gathers each module's parameters around the function the same way.
``Init(module=m)`` partitions an already-built model. The context owns the records of the
parameters it partitioned (``init.records``) until the engine built over them takes them at
``initialize`` (See [Note: stage 3 parameter records]).

Parameters gathered on access stay gathered until the ``__init__`` that touched them returns,
which for code running at the end of the root's ``__init__`` (transformers' ``post_init`` walks
every module with its own ``smart_apply`` and initialises each weight) would be the whole model.
So at most ``zero_optimization.stage3_max_live_parameters`` elements (the config's, default
1e9) stay gathered: past that, the earliest-touched ones of *other* modules are re-partitioned
at once, with rank 0's value (all ranks touch the same parameters in the same order, so they
agree); one touched again is simply gathered again. A module's own parameters are never cut
while it is being read (``named_parameters()`` gathers all of a module's parameters before
yielding the first), so code that initialises a module's weights through its attributes, one
module after another, always writes into gathered parameters. Building a 2B-parameter GPT-2 under ``from_pretrained`` thus
holds one submodule's worth of gathered weights, not the model.

[Note: classes made inside zero.Init]
A class created while the context is open (its module imported lazily inside it, as
transformers' models are) gets its ``__init__`` wrapped by ``__init_subclass__``; a class
decorator may then replace that ``__init__`` with its own wrapper around ours (transformers'
``use_experts_implementation`` does, for the MoE experts of Mixtral and Qwen2-MoE). On exit the
original is put back only where our wrapper is still the class's ``__init__``; elsewhere our
wrapper stays, inert (it calls the original once its context is closed), since putting the
original back would drop the decorator's part (models built later would miss ``config``).

Modules made without running their ``__init__`` (deep copies: an MoE layer's experts are
copies of the expert module) and parameters a parent assigns to a child are caught by the
enclosing ``__init__``: when it returns, every not-yet-partitioned parameter of its subtree is
partitioned, except that a container's (``ModuleList``, ``Sequential``, ...) ``__init__``
handles its own parameters only, because its parent may still change what it holds. That
matters for expert parameters, which are partitioned over their expert-data-parallel group
(see [Note: stage 3 expert parameters]): zero-moe's ``Experts`` puts its copies in a
``ModuleList`` and tags them as experts afterwards, and an expert parameter whose expert groups
do not exist yet (an MoE layer creates them after its experts) is left to an enclosing
``__init__`` (the layer's) or to the strategy. Peak growth during construction is thus
about model/N + the largest submodule's parameters (measured in fresh processes by
``tests/test_stage3_init_memory.py``: 322 MiB for a 512 MiB model of 64 MiB layers at N = 2).

``remote_device``: None keeps each shard where the parameter was created; ``"cpu"`` moves
the parameter to CPU memory before it is cut, so shards live in CPU memory (on a CPU-only
machine both are the same device; streaming CPU shards to an accelerator for compute is
``zero_optimization.offload_param``, provided by the zero-offload package). With a config whose
``offload_param.device`` equals ``remote_device`` ("cpu" or "nvme"; "nvme" requires it), each
shard is handed to zero-offload's ``ParamOffload`` as soon as it is cut, so the full model never
sits in memory; the engine's stage 3 keeps using those homes.
"""

from __future__ import annotations

import functools
import json
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from zero_core import comm
from zero_core.config import ZeroConfig
from zero_core.protocols.shard_store import PLAIN_SHARDS, ShardStore
from zero_core.zero.stage3.expert_partition import expert_group_exists, partition_group
from zero_core.zero.stage3.hooks import install_param_dict
from zero_core.zero.stage3.param_records import partition_state
from zero_core.zero.stage3.partitioned_param import (
    ParamStatus,
    PartitionState,
    broadcast_full,
    gather_params,
    is_partitioned,
    partition_param,
    release_param,
    shard_from_full,
)
from zero_core.zero.stage3.runtime_context import stage3_context

# Containers hold modules their parent is still building (and may still tag): their
# ``__init__`` leaves deep-copied children to the parent's. See [Note: stage 3 construction].
_CONTAINERS = (
    torch.nn.ModuleList,
    torch.nn.ModuleDict,
    torch.nn.Sequential,
    torch.nn.ParameterList,
    torch.nn.ParameterDict,
)


def _load_cfg(config_dict_or_path: Any, config: Any) -> ZeroConfig | None:
    """The typed config ``zero.Init`` reads (None: no config given)."""
    src = config if config is not None else config_dict_or_path
    if src is None:
        return None
    if isinstance(src, (str, os.PathLike)):
        with open(src) as fh:
            src = json.load(fh)
    if isinstance(src, dict):
        from zero_core.config import load_config

        return load_config(src, world_size=comm.get_world_size() if comm.is_initialized() else 1)
    if not isinstance(src, ZeroConfig):
        raise TypeError(
            "zero.Init: config_dict_or_path / config must be a dict, a path to a JSON file or a "
            f"ZeroConfig (zero_core.config.load_config's), got {type(src).__name__}"
        )
    return src


def _all_subclasses(cls: type) -> list[type]:
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        for s in c.__subclasses__():
            out.append(s)
            todo.append(s)
    return out


class Init:
    """Context in which modules are partitioned as they are constructed (ZeRO stage 3)."""

    def __init__(
        self,
        module: torch.nn.Module | None = None,
        data_parallel_group: Any = None,
        mem_efficient_linear: bool = True,
        remote_device: str | None = None,
        pin_memory: bool = False,
        config_dict_or_path: Any = None,
        config: Any = None,
        enabled: bool = True,
        dtype: torch.dtype | None = None,
        mpu: Any = None,
    ) -> None:
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"zero.Init: module must be a torch.nn.Module, got {type(module).__name__}")
        if remote_device not in (None, "cpu", "none", "nvme") and not str(remote_device).startswith("cuda"):
            raise ValueError(
                f"zero.Init: remote_device must be None, 'cpu', 'cuda' or 'nvme', got {remote_device!r}"
            )
        if dtype is not None and dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"zero.Init: dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        if mpu is not None and data_parallel_group is not None:
            raise ValueError("zero.Init: give data_parallel_group or mpu, not both")
        self.enabled = bool(enabled)
        self.pin_memory = bool(pin_memory)
        self.remote_device = remote_device
        self.mem_efficient_linear = bool(mem_efficient_linear)
        if self.enabled and not comm.is_initialized():
            from zero_core.distributed import init_distributed

            init_distributed()
        self.group = mpu.get_data_parallel_group() if mpu is not None else data_parallel_group
        cfg = _load_cfg(config_dict_or_path, config)
        self._cfg = cfg
        if dtype is None and cfg is not None:
            if cfg.fp16.enabled:
                dtype = torch.float16
            elif cfg.bf16.enabled:
                dtype = torch.bfloat16
        self.dtype = dtype
        self.param_offload = self._param_offload(cfg, remote_device)
        self.override_module_apply = cfg is None or cfg.zero_optimization.override_module_apply
        self._patched: list[tuple[type, str, Any]] = []
        self._installed: dict[type, Any] = {}  # class -> the __init__ wrapper set on it
        self._active = False
        self._dirty: dict[int, torch.nn.Parameter] = {}  # gathered on access, in touch order
        self._dirty_owner: dict[int, int] = {}  # id of the parameter dict each was read from
        self._dirty_numel = 0
        live = cfg.zero_optimization.max_live_parameters if cfg is not None else None  # "auto": the default
        self.max_live = live if isinstance(live, int) and not isinstance(live, bool) else 1_000_000_000
        # the records it partitioned that no engine took yet, by record id: See [Note: stage 3
        # parameter records]; records point back to their owner weakly
        self.records: dict[int, PartitionState] = {}
        self._ref = weakref.ref(self)
        if self.enabled and module is not None:
            self._convert(module)

    def _param_offload(self, cfg: ZeroConfig | None, remote_device: str | None) -> ShardStore:
        """zero-offload's ParamOffload for ``remote_device`` "cpu"/"nvme" when offload_param asks
        for it, else the plain store (See [Note: shard store seam])."""
        device = "none" if cfg is None else cfg.zero_optimization.offload_param_device
        if remote_device == "nvme" and device != "nvme":
            raise ValueError(
                "zero.Init: remote_device='nvme' needs a config (config_dict_or_path= or config=) whose "
                "zero_optimization.offload_param has device 'nvme' and an nvme_path; "
                f"got offload_param.device {device!r}"
            )
        if cfg is None or not self.enabled or remote_device not in ("cpu", "nvme") or device != remote_device:
            return PLAIN_SHARDS
        from zero_core.plugins import require

        mod = require("zero_offload", f"zero.Init(remote_device={remote_device!r})")
        rank = comm.get_rank(self.group)
        return mod.build_param_offload(cfg.zero_optimization, cfg.aio, rank=rank)

    # -- partitioning --------------------------------------------------------------------
    @torch.no_grad()
    def _convert(self, module: torch.nn.Module) -> None:
        # See [Note: stage 3 construction]: a container converts its own parameters only, any
        # other module its whole subtree (deep copies, parameters assigned to a child).
        if isinstance(module, _CONTAINERS):
            self._convert_own(module)
            return
        for m in module.modules():
            self._convert_own(m)

    @torch.no_grad()
    def _convert_own(self, module: torch.nn.Module) -> None:
        for p in list(module._parameters.values()):
            if p is None or is_partitioned(p) or not expert_group_exists(p):
                continue
            if self.dtype is not None and p.dtype.is_floating_point and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
            if self.remote_device == "cpu" and p.device.type != "cpu":
                p.data = p.data.to("cpu")
            if self.pin_memory and torch.cuda.is_available():
                p.data = p.data.pin_memory()
            self._partition(p)
            self._own(partition_state(p))
            self.param_offload.adopt([p])  # the plain store takes nothing: See [Note: shard store seam]
        install_param_dict(module)

    def _partition(self, p: torch.nn.Parameter) -> None:
        """Cut ``p`` to its shard (``zero.MiCS_Init`` cuts over its shard group instead)."""
        # experts over their expert-data-parallel group: See [Note: stage 3 expert parameters]
        group, grad_divisor = partition_group(p, self.group)
        partition_param(p, group, broadcast_from=0, grad_divisor=grad_divisor)

    # -- the records it owns: See [Note: stage 3 parameter records] -------------------------
    fetch_by_all_reduce = False  # the engine's choice (See [Note: all-reduce fetch]); none yet

    def _own(self, st: PartitionState) -> None:
        st.owner = self._ref
        self.records[st.id] = st

    def hand_over(self, records: Iterable[PartitionState]) -> None:
        """The engine built over these parameters took ``records``: forget them."""
        for st in records:
            self.records.pop(st.id, None)

    def on_shard_changed(self, param: torch.nn.Parameter) -> None:
        """A ``GatheredParameters`` modifier rewrote ``param``'s shard: nothing derived to refresh
        (no master exists before an engine)."""

    def _touch(self, p: torch.nn.Parameter, owner: Any = None) -> None:
        """Gather a parameter read during construction (from ``owner``, a module's parameter
        dict); re-partitioned by :meth:`_flush`, or earlier past ``max_live``."""
        st = partition_state(p)
        if st.status is ParamStatus.AVAILABLE or st.id in self._dirty:
            return
        handle = gather_params([p], what="access during zero.Init construction")
        if handle is not None:
            handle.wait()
        st.holds += 1
        self._dirty[st.id] = p
        self._dirty_owner[st.id] = id(owner)
        self._dirty_numel += st.numel
        if self._dirty_numel > self.max_live:  # See [Note: stage 3 construction]
            others = [q for i, q in self._dirty.items() if self._dirty_owner[i] != id(owner)]
            for q in others:
                if self._dirty_numel <= self.max_live:
                    break
                self._repartition(q)

    @torch.no_grad()
    def _flush(self, scope: torch.nn.Module | None) -> None:
        if not self._dirty:
            return
        if scope is None:
            params = list(self._dirty.values())
        else:
            # Not ``scope.parameters()``: listing parameters through ``_parameters.items()`` gathers
            # each one during construction (ZeroParamDict), i.e. the whole subtree at once.
            ids = {id(p) for m in scope.modules() for p in dict.values(m._parameters) if p is not None}
            params = [p for p in self._dirty.values() if id(p) in ids]
        for p in params:
            self._repartition(p)

    def _repartition(self, p: torch.nn.Parameter) -> None:
        """Cut a parameter gathered during construction back to its shard, with rank 0's value."""
        st = partition_state(p)
        del self._dirty[st.id], self._dirty_owner[st.id]
        self._dirty_numel -= st.numel
        st.holds -= 1
        broadcast_full(p, 0)
        shard_from_full(p)
        release_param(p)

    # -- patches --------------------------------------------------------------------------
    def _wrap_init(self, cls: type) -> None:
        orig = cls.__dict__["__init__"]
        ctx = self

        @functools.wraps(orig)
        def __init__(module: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            if not ctx._active:  # left in place by __exit__: See [Note: classes made inside zero.Init]
                orig(module, *args, **kwargs)
                return
            depth = module.__dict__.get("_zero_init_depth", 0)
            module.__dict__["_zero_init_depth"] = depth + 1
            try:
                orig(module, *args, **kwargs)
            finally:
                module.__dict__["_zero_init_depth"] = depth
            if depth == 0:
                del module.__dict__["_zero_init_depth"]
                ctx._convert(module)
                ctx._flush(module)

        self._patched.append((cls, "__init__", orig))
        self._installed[cls] = __init__
        cls.__init__ = __init__

    def _patch_apply(self) -> None:
        orig = torch.nn.Module.apply
        ctx = self

        def apply(module: torch.nn.Module, fn: Any) -> torch.nn.Module:
            for child in module.children():
                child.apply(fn)
            own = [p for p in module._parameters.values() if p is not None and is_partitioned(p)]
            for p in own:
                ctx._touch(p, module._parameters)
            fn(module)
            ctx._flush(module)
            return module

        self._patched.append((torch.nn.Module, "apply", orig))
        torch.nn.Module.apply = apply

    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._active = True
        for cls in [torch.nn.Module, *_all_subclasses(torch.nn.Module)]:
            if "__init__" in cls.__dict__ and cls is not torch.nn.Module:
                self._wrap_init(cls)
        ctx = self
        orig_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            if "__init__" in cls.__dict__:
                ctx._wrap_init(cls)

        self._patched.append((torch.nn.Module, "__init_subclass__", orig_init_subclass))
        torch.nn.Module.__init_subclass__ = classmethod(__init_subclass__)
        if self.override_module_apply:
            self._patch_apply()
        stage3_context().on_access_outside_forward.append(self._touch)
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.enabled:
            return
        stage3_context().on_access_outside_forward.remove(self._touch)
        self._active = False
        for cls, name, orig in reversed(self._patched):
            if name == "__init__" and cls.__dict__.get("__init__") is not self._installed.get(cls):
                # replaced after we wrapped it: See [Note: classes made inside zero.Init]
                continue
            if orig is None:
                delattr(cls, name)
            else:
                setattr(cls, name, orig)
        self._patched.clear()
        self._installed.clear()
        if exc[0] is None:
            self._flush(None)

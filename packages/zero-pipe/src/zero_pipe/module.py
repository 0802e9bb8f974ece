"""``PipelineModule``: a sequence of layers, of which each stage builds only its own slice.

The forward pass is ``x = layer(x)`` for each layer in order. Layers are given as modules,
callables, or (preferably) :class:`LayerSpec` recipes, so that a stage never materialises
another stage's layers: partitioning by parameter count builds specs on the meta device.
:class:`TiedLayerSpec` shares one module between several positions (e.g. input embedding and
output projection); its gradients are all-reduced among the stages that hold a copy.

[Note: model chunks]
With ``num_chunks=c`` (zero-specific, for the interleaved schedule) the layers are split into
``p * c`` contiguous *virtual stages*; stage ``s`` holds virtual stages ``s, s + p, ...``, one
model chunk each, and ``forward(x, chunk_id)`` runs one chunk. ``parts`` then holds the
``p * c + 1`` virtual-stage boundaries. Layers keep their global index everywhere (module names,
checkpoint files), so a checkpoint does not depend on ``num_stages`` or ``num_chunks``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from zero_core.activation_checkpointing import checkpoint as _zero_checkpoint

from zero_pipe import _dist
from zero_pipe.layer_spec import LayerSpec, TiedLayerSpec
from zero_pipe.partition import partition_balanced, partition_uniform, type_weights
from zero_pipe.topology import PipeDataParallelTopology, PipelineParallelGrid, ProcessTopology


def _layer_type_name(layer: object) -> str:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    return (
        type(layer).__name__
        if isinstance(layer, nn.Module)
        else getattr(layer, "__name__", type(layer).__name__)
    )


def _param_count(layer: object) -> int:
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):  # count without allocating: no stage materialises others' layers
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters())
    return 0


def _checked_layers(layers: object) -> list[Any]:
    """``layers`` as a list, each a LayerSpec, module or callable (an ``nn.Sequential``: its children)."""
    if isinstance(layers, nn.Sequential):
        layers = list(layers.children())
    elif not isinstance(layers, Iterable):
        raise TypeError(
            f"PipelineModule: layers must be a list (or nn.Sequential) of LayerSpecs, modules or "
            f"callables, got {type(layers).__name__}"
        )
    layers = list(layers)
    if not layers:
        raise ValueError("PipelineModule: layers must contain at least one layer")
    for i, layer in enumerate(layers):
        if not (isinstance(layer, (LayerSpec, nn.Module)) or callable(layer)):
            raise TypeError(
                f"PipelineModule: layer {i} ({layer!r}) is not a LayerSpec, nn.Module or callable"
            )
    return layers


def _check_arguments(
    num_stages: object,
    topology: object,
    loss_fn: object,
    activation_checkpoint_interval: object,
    activation_checkpoint_func: object,
    dynamic_shape: object,
    num_chunks: object,
) -> None:
    """The constructor's other arguments, each named in its error."""
    if num_stages is None and topology is None:
        raise ValueError("PipelineModule: give num_stages or topology")
    if num_stages is not None and (
        not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1
    ):
        raise ValueError(f"PipelineModule: num_stages must be an int >= 1, got {num_stages!r}")
    if topology is not None and not isinstance(topology, ProcessTopology):
        raise TypeError(f"PipelineModule: topology must be a ProcessTopology, got {type(topology)}")
    if topology is not None and "pipe" not in topology.get_axis_names():
        raise ValueError(
            f"PipelineModule: the topology needs a 'pipe' axis, it has {topology.get_axis_names()}"
        )
    if topology is not None and num_stages is not None and topology.get_dim("pipe") != num_stages:
        raise ValueError(
            f"PipelineModule: num_stages={num_stages} disagrees with the topology's pipe dim {topology.get_dim('pipe')}"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(f"PipelineModule: loss_fn must be callable, got {loss_fn!r}")
    if not isinstance(activation_checkpoint_interval, int) or activation_checkpoint_interval < 0:
        raise ValueError(
            f"PipelineModule: activation_checkpoint_interval must be an int >= 0, got {activation_checkpoint_interval!r}"
        )
    if not isinstance(num_chunks, int) or isinstance(num_chunks, bool) or num_chunks < 1:
        raise ValueError(f"PipelineModule: num_chunks must be an int >= 1, got {num_chunks!r}")
    if activation_checkpoint_func is not None and not callable(activation_checkpoint_func):
        raise TypeError(
            f"PipelineModule: activation_checkpoint_func must be callable, got {activation_checkpoint_func!r}"
        )
    if not isinstance(dynamic_shape, bool):
        raise TypeError(f"PipelineModule: dynamic_shape must be a bool, got {dynamic_shape!r}")


class PipelineModule(nn.Module):
    """Layers to be run as a pipeline of ``num_stages`` stages (see the module docstring).

    ``stage_id`` (keyword, zero-specific) builds a given stage without a process group, for
    tools and tests; in a distributed job the stage comes from the topology and this rank.
    ``dynamic_shape=True`` (DeepSpeed's argument) lets activation shapes change from one
    micro-batch to the next: see [Note: dynamic activation shapes] in ``p2p.py``.
    """

    def __init__(
        self,
        layers: Iterable[Any],
        num_stages: int | None = None,
        topology: ProcessTopology | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        seed_layers: bool = False,
        seed_fn: Callable[[int], None] | None = None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func: Callable[..., Any] | None = None,
        checkpointable_layers: list[str] | None = None,
        dynamic_shape: bool = False,
        *,
        stage_id: int | None = None,
        num_chunks: int = 1,
    ) -> None:
        super().__init__()
        layers = _checked_layers(layers)
        _check_arguments(
            num_stages,
            topology,
            loss_fn,
            activation_checkpoint_interval,
            activation_checkpoint_func,
            dynamic_shape,
            num_chunks,
        )
        self.dynamic_shape = dynamic_shape
        self.num_chunks = num_chunks
        self.layer_specs = layers
        self.loss_fn = loss_fn
        self.seed_layers, self.seed_fn, self.base_seed = seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func or _zero_checkpoint
        self.checkpointable_layers = checkpointable_layers

        distributed = _dist.is_initialized() and stage_id is None
        self._place(topology, num_stages, stage_id, distributed)
        self.parts = self._partition(partition_method)  # virtual-stage boundaries: [Note: model chunks]
        self._chunk_ranges = [
            range(self.parts[v], self.parts[v + 1])
            for v in range(self.stage_id, self.num_stages * num_chunks, self.num_stages)
        ]
        self._local_indices = [idx for r in self._chunk_ranges for idx in r]
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self._build()
        self._tie_groups = self._build_tie_groups() if distributed else {}
        self._synchronize_tied_weights()

    def _place(
        self,
        topology: ProcessTopology | None,
        num_stages: int | None,
        stage_id: int | None,
        distributed: bool,
    ) -> None:
        """The topology (a pipe x data one of the world when not given), and this rank's stage."""
        if topology is None:
            world = _dist.get_world_size() if distributed else num_stages
            if world % num_stages:
                raise ValueError(
                    f"PipelineModule: world size {world} is not divisible by num_stages={num_stages}"
                )
            topology = PipeDataParallelTopology(num_pp=num_stages, num_dp=world // num_stages)
        self._topo = topology
        self.num_stages = topology.get_dim("pipe")
        if self.num_chunks > 1 and self.num_stages < 2:
            raise ValueError("PipelineModule: num_chunks > 1 (interleaving) needs num_stages >= 2")
        self._grid = PipelineParallelGrid(topology) if distributed else None
        if self._grid is not None:
            self.stage_id = self._grid.stage_id
        else:
            self.stage_id = 0 if stage_id is None else stage_id
            if not 0 <= self.stage_id < self.num_stages:
                raise ValueError(
                    f"PipelineModule: stage_id must be in [0, {self.num_stages}), got {stage_id}"
                )

    # -- partitioning and building -------------------------------------------------------
    def _partition(self, method: str) -> list[int]:
        if not isinstance(method, str):
            raise TypeError(f"PipelineModule: partition_method must be a string, got {method!r}")
        n, p = len(self.layer_specs), self.num_stages * self.num_chunks
        if n < p:
            raise ValueError(f"PipelineModule: {n} layers cannot fill {p} stages (every stage needs a layer)")
        lowered = method.lower()
        if lowered == "uniform":
            return partition_uniform(n, p)
        if lowered == "parameters":
            return partition_balanced([float(_param_count(layer)) for layer in self.layer_specs], p)
        if lowered.startswith("type:"):
            names = [_layer_type_name(layer) for layer in self.layer_specs]
            return partition_balanced(type_weights(names, method[len("type:") :]), p)
        raise ValueError(
            f"PipelineModule: partition_method {method!r} is not one of 'parameters', 'uniform', 'type:REGEX'"
        )

    def _seed(self, idx: int) -> None:
        if not self.seed_layers:
            return
        if self.seed_fn is not None:
            self.seed_fn(self.base_seed + idx)
        else:
            torch.manual_seed(self.base_seed + idx)

    def _build(self) -> None:
        self.chunk_funcs: list[list[Callable[[Any], Any]]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self.layers = nn.ModuleDict()  # keys are global layer indices, for stage-independent names
        for chunk_range in self._chunk_ranges:
            funcs: list[Callable[[Any], Any]] = []
            for idx in chunk_range:
                self._build_layer(idx, funcs)
            self.chunk_funcs.append(funcs)
        self.forward_funcs = self.chunk_funcs[0]  # DeepSpeed's name: the (first) chunk's functions

    def _build_layer(self, idx: int, funcs: list[Callable[[Any], Any]]) -> None:
        """Build (or reuse, when tied) layer ``idx`` and append its forward function to ``funcs``."""
        spec = self.layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied_modules:
                self._seed(idx)
                self.tied_modules[spec.key] = spec.build()
                self.tied_weight_attrs[spec.key] = spec.tied_weight_attr
                for attr in spec.tied_weight_attr:
                    self.tied_weight(spec.key, attr)  # fail at build time on a wrong attribute path
            module = self.tied_modules[spec.key]
            fwd = spec.forward_fn
            funcs.append((lambda x, m=module, f=fwd: f(m, x)) if fwd else module)
        elif isinstance(spec, LayerSpec):
            self._seed(idx)
            module = spec.build()
            self.layers[str(idx)] = module
            funcs.append(module)
        elif isinstance(spec, nn.Module):
            self.layers[str(idx)] = spec
            funcs.append(spec)
        else:
            funcs.append(spec)

    def tied_weight(self, key: str, attr: str) -> torch.Tensor:
        """The tensor ``attr`` (a dotted path, e.g. ``"wte.weight"``, as DeepSpeed allows) of tied module ``key``."""
        obj: object = self.tied_modules[key]
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise AttributeError(
                    f"TiedLayerSpec {key!r}: tied_weight_attr {attr!r} does not resolve on "
                    f"{type(self.tied_modules[key]).__name__} (no attribute {part!r} on {type(obj).__name__})"
                )
            obj = getattr(obj, part)
        if not isinstance(obj, torch.Tensor):
            raise TypeError(
                f"TiedLayerSpec {key!r}: tied_weight_attr {attr!r} resolves to {type(obj).__name__}, not a tensor"
            )
        return obj

    def _tie_owners(self) -> dict[str, list[int]]:
        """Stages holding each tied key (known on every rank from the specs alone)."""
        owners: dict[str, list[int]] = {}
        for v in range(self.num_stages * self.num_chunks):
            stage = v % self.num_stages
            for spec in self.layer_specs[self.parts[v] : self.parts[v + 1]]:
                if isinstance(spec, TiedLayerSpec) and stage not in owners.setdefault(spec.key, []):
                    owners[spec.key].append(stage)
        return {key: sorted(stages) for key, stages in owners.items()}

    def tied_owner_stages(self) -> dict[str, list[int]]:
        """Tied key -> the stages holding a copy of it, ascending."""
        return self._tie_owners()

    def _build_tie_groups(self) -> dict[str, tuple[Any, list[int]]]:
        """One process group per (tied key, data/model coordinate); new_group is collective,
        so every rank creates every group in the same order."""
        groups = {}
        topo = self._topo
        me = _dist.get_rank()
        for key, stages in sorted(self._tie_owners().items()):
            if len(stages) < 2:
                continue
            for ranks in topo.get_axis_comm_lists("pipe"):
                members = [ranks[s] for s in stages]
                group = _dist.new_group(members)
                if me in members:
                    groups[key] = (group, members)
        return groups

    def _synchronize_tied_weights(self) -> None:
        """Copy tied weights from the first owning stage so all copies start identical."""
        for key, (group, members) in self._tie_groups.items():
            for attr in self.tied_weight_attrs[key]:
                _dist.broadcast(self.tied_weight(key, attr).data, members[0], group=group)

    # -- running ---------------------------------------------------------------------------
    def forward(self, forward_input: Any, chunk_id: int = 0) -> Any:
        """Run this stage's layers (of model chunk ``chunk_id``) on ``forward_input``."""
        if not isinstance(chunk_id, int) or not 0 <= chunk_id < self.num_chunks:
            raise ValueError(
                f"PipelineModule.forward: chunk_id must be in [0, {self.num_chunks}), got {chunk_id!r}"
            )
        x = forward_input
        interval = self.activation_checkpoint_interval
        funcs = self.chunk_funcs[chunk_id]
        if interval == 0 or not torch.is_grad_enabled():
            for fn in funcs:
                x = fn(x)
            return x
        for start in range(0, len(funcs), interval):
            chunk = funcs[start : start + interval]
            if self._is_checkpointable(chunk):
                x = self.activation_checkpoint_func(
                    self._run_chunk(chunk), *(x if isinstance(x, tuple) else (x,))
                )
            else:
                x = self._run_chunk(chunk)(*(x if isinstance(x, tuple) else (x,)))
        return x

    @staticmethod
    def _run_chunk(chunk: list[Callable[[Any], Any]]) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            x = inputs[0] if len(inputs) == 1 else inputs
            for fn in chunk:
                x = fn(x)
            return x

        return run

    def _is_checkpointable(self, chunk: list[Callable[[Any], Any]]) -> bool:
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in chunk)
        params = [p for f in chunk if isinstance(f, nn.Module) for p in f.parameters()]
        return len(params) > 0

    def allreduce_tied_weight_gradients(self) -> None:
        """All-reduce (sum) the gradients of the tied weights among the stages sharing them."""
        for key, (group, _members) in self._tie_groups.items():
            for attr in self.tied_weight_attrs[key]:
                weight = self.tied_weight(key, attr)
                if weight.grad is None:
                    weight.grad = torch.zeros_like(weight)
                _dist.all_reduce(weight.grad, group=group)

    def topology(self) -> ProcessTopology:
        """The ProcessTopology of the job."""
        return self._topo

    def grid(self) -> PipelineParallelGrid | None:
        """The process groups (None when built without a process group)."""
        return self._grid

    def local_layer_range(self) -> range:
        """Global indices of the layers of this stage's first chunk (all of them when ``num_chunks == 1``)."""
        return range(self._local_start, self._local_stop)

    def local_layer_indices(self) -> list[int]:
        """Global indices of every layer this stage holds, over all its chunks, in order."""
        return list(self._local_indices)

    def get_additional_losses(self) -> dict[str, torch.Tensor] | None:
        """Model-specific extra losses for reporting; none by default."""
        return None

    # -- checkpoint naming (files: see zero_pipe.layer_files) -------------------------------
    def ckpt_prefix(self, checkpoints_path: str, tag: str) -> str:
        """Directory prefix of every checkpoint file of this module."""
        import os

        return os.path.join(checkpoints_path, str(tag))

    def _rank_repr(self) -> str:
        rank = (
            _dist.get_rank()
            if self._grid is not None
            else self._topo.get_rank(
                **{a: (self.stage_id if a == "pipe" else 0) for a in self._topo.get_axis_names()}
            )
        )
        return self._topo.get_rank_repr(rank) or "00"

    def ckpt_layer_path(self, ckpt_dir: str, local_layer_idx: int) -> str:
        """File of one local layer: ``layer_<global idx>-model_<rank repr>-model_states.safetensors``."""
        import os

        if not isinstance(local_layer_idx, int) or not 0 <= local_layer_idx < len(self._local_indices):
            raise ValueError(
                f"ckpt_layer_path: local_layer_idx {local_layer_idx!r} outside this stage's "
                f"{len(self._local_indices)} layers"
            )
        idx = self._local_indices[local_layer_idx]
        return os.path.join(ckpt_dir, f"layer_{idx:02d}-model_{self._rank_repr()}-model_states.safetensors")

    def ckpt_layer_path_list(self, ckpt_dir: str, local_layer_idx: int) -> list[str]:
        """Every file of one layer (one per model-parallel rank), sorted."""
        import glob
        import os

        if not isinstance(local_layer_idx, int) or not 0 <= local_layer_idx < len(self._local_indices):
            raise ValueError(
                f"ckpt_layer_path_list: local_layer_idx {local_layer_idx!r} outside this stage's "
                f"{len(self._local_indices)} layers"
            )
        idx = self._local_indices[local_layer_idx]
        return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{idx:02d}-*model_states.safetensors")))

    def save_state_dict(self, save_dir: str) -> None:
        """Write this stage's layers, one safetensors file per layer (collective when distributed).
        See [Note: per-layer pipeline checkpoints] in ``layer_files.py``."""
        from zero_pipe.layer_files import save_module_layers

        save_module_layers(self, save_dir)

    def load_state_dir(self, load_dir: str, strict: bool = True) -> None:
        """Load this stage's layers (saved with any number of stages) from a ``save_state_dict``
        directory or an engine checkpoint's tag directory."""
        from zero_pipe.checkpoint import load_module_state

        load_module_state(self, load_dir, strict=strict)

    def layer_modules(self) -> dict[int, nn.Module]:
        """Global layer index -> the module holding that layer's state (tied: first position)."""
        out: dict[int, nn.Module] = {}
        for idx in self._local_indices:
            spec = self.layer_specs[idx]
            if isinstance(spec, TiedLayerSpec):
                out[idx] = self.tied_modules[spec.key]
            elif str(idx) in self.layers:
                out[idx] = self.layers[str(idx)]
        return out

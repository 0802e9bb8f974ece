"""``InferenceEngine`` and ``init_inference``: compose the inference transformations on a model.

[Note: order of the inference transformations]
1. checkpoint: weights come from ``checkpoint`` (HF safetensors dir/file or our TP-sharded
   format), read slice by slice for this rank (see [Note: reading only the shard]);
2. dtype: floating tensors are cast to the compute dtype (int8 computes in fp16 on CUDA and in
   the model's own float dtype on CPU);
3. tensor parallelism over ``tp_size`` ranks (see [Note: auto TP discovery]);
4. kernel injection: recognized architectures run a fused decoder/encoder path built on the
   (possibly sharded) modules, so TP and int8 compose with it (see [Note: kernel injection]);
5. int8 weight-only quantization of every linear (see [Note: int8 weight groups]);
6. expert parallelism: zero-moe ``MoE`` layers' experts sharded over ``moe.ep_size`` ranks
   (see [Note: expert-parallel inference]);
7. ZeRO-Inference (``zero.stage: 3``): weights partitioned over ranks and gathered per layer.
``save_mp_checkpoint_path`` writes the TP-sharded result (after step 3) for fast reload.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from zero_core import comm
from zero_core.plugins import require

from zero_inference import checkpoint_loading, kernel_inject
from zero_inference.auto_tp import apply_plan, discover_plan
from zero_inference.config import (
    DeepSpeedInferenceConfig,
    DeepSpeedMoEConfig,
    check_machine,
    check_model_settings,
    load_inference_config,
)
from zero_inference.generation import decode, hf_step, resolve_settings
from zero_inference.moe_inference import moe_layers, shard_experts
from zero_inference.quantize_model import quantize_model_

if TYPE_CHECKING:
    from zero_inference.config import InferenceConfigSource


def _model_device(model: nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _model_float_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


class InferenceEngine(nn.Module):
    """A wrapped model for inference. See [Note: order of the inference transformations]."""

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"InferenceEngine: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(config, DeepSpeedInferenceConfig):
            raise TypeError(
                f"InferenceEngine: config must be a DeepSpeedInferenceConfig, got {type(config).__name__}; "
                "use zero_inference.init_inference(model, config_dict)"
            )
        self._config = config
        self.device = _model_device(model)
        check_machine(config, self.device)
        check_model_settings(config, model)
        self._check_moe(model)
        model.eval()
        self.tp_size = config.tp_size
        self.tp_group = config.tensor_parallel.tp_group
        self.tp_rank = 0
        if self.tp_size > 1:
            self._init_tp_world()

        self.int8 = config.dtype == torch.int8
        if self.int8:
            self.dtype = torch.float16 if self.device.type == "cuda" else _model_float_dtype(model)
        else:
            self.dtype = config.dtype

        source = None
        ckpt = config.checkpoint or config.checkpoint_config.checkpoint_dir
        if config.set_empty_params:
            _empty_params_(model, self.dtype, self.device, meta=ckpt is not None)
        if ckpt is not None:
            source = checkpoint_loading.open_checkpoint(
                ckpt, config.base_dir or config.checkpoint_config.base_dir
            )
            source = checkpoint_loading.check_tp(source, self.tp_size, self.tp_rank)
        with torch.no_grad():
            self._transform(model, source)
        self.module = model
        save_path = config.checkpoint_save_path
        if save_path:
            checkpoint_loading.save_mp_checkpoint(
                model, save_path, self.tp_rank, self.tp_size, self._plan, self._unsharded_shapes
            )
        self.injected = kernel_inject.inject(model) if config.replace_with_kernel_inject else None
        if self.int8:
            quantize_model_(model, config.quant.weight.q_groups)
        ep_size, ep_group = self._moe_settings()
        self.moe_layers = shard_experts(model, ep_size, ep_group) if moe_layers(model) or ep_size > 1 else 0
        self.zero_partitioner = None
        if config.zero.stage == 3:
            from zero_inference.zero_inference import ZeroInferencePartitioner

            self.zero_partitioner = ZeroInferencePartitioner(model, config.zero)

    def _moe_settings(self) -> tuple[int, Any]:
        cfg = self._config
        ep, group = cfg.ep_size, cfg.ep_group
        if isinstance(cfg.moe, DeepSpeedMoEConfig):
            if cfg.moe.ep_size != 1 and ep != 1 and cfg.moe.ep_size != ep:
                raise ValueError(
                    f"moe.ep_size ({cfg.moe.ep_size}) and ep_size ({ep}) conflict; set one of them"
                )
            ep = cfg.moe.ep_size if cfg.moe.ep_size != 1 else ep
            group = cfg.moe.ep_group if cfg.moe.ep_group is not None else group
        return ep, group

    def _check_moe(self, model: nn.Module) -> None:
        ep, _ = self._moe_settings()
        has_moe = any(type(m).__name__ in ("MoE", "MOELayer") for m in model.modules())
        if has_moe or ep > 1:
            require("zero_moe", "MoE inference (moe / ep_size)")
        if has_moe and self._config.tp_size > 1:
            raise ValueError(
                f"tensor_parallel.tp_size={self._config.tp_size} with MoE layers is not supported: experts are "
                "sharded by expert parallelism (moe.ep_size), not split by tensor parallelism"
            )

    def _init_tp_world(self) -> None:
        if not comm.is_initialized():
            raise RuntimeError(
                f"tensor_parallel.tp_size={self.tp_size} needs torch.distributed initialised "
                "(zero_core.distributed.init_distributed() or a launcher such as `zero run`)"
            )
        world = comm.get_world_size(self.tp_group)
        if world != self.tp_size:
            raise ValueError(
                f"tensor_parallel.tp_size={self.tp_size} but the tensor-parallel group has {world} ranks; "
                "launch tp_size processes or pass tensor_parallel.tp_group"
            )
        self.tp_rank = comm.get_rank(self.tp_group)

    def _transform(self, model: nn.Module, source: Any) -> None:
        cfg = self._config
        self._plan = None
        # Shapes before sharding: a saved TP checkpoint records them so it can be re-sliced.
        self._unsharded_shapes = {n: tuple(t.shape) for n, t in model.state_dict(keep_vars=True).items()}
        if source is not None and not isinstance(source, checkpoint_loading.TPShardSource):
            # A full checkpoint: replicated tensors are read whole, sharded ones slice by slice.
            if self.tp_size > 1:
                self._plan = discover_plan(model, self.tp_size, cfg.injection_policy)
            checkpoint_loading.load_replicated(model, source, self._plan, self.dtype, self.device)
            if self._plan is not None:
                apply_plan(
                    model,
                    self._plan,
                    self.tp_rank,
                    self.tp_size,
                    group=self.tp_group,
                    source=source,
                    dtype=self.dtype,
                    device=self.device,
                )
            return
        if source is not None:  # our TP-sharded checkpoint: structure first, then this rank's file
            if self.tp_size > 1:
                self._plan = discover_plan(model, self.tp_size, cfg.injection_policy)
                # Meta (or throwaway) tensors give the shapes; the values come from the rank's file.
                apply_plan(model, self._plan, self.tp_rank, self.tp_size, group=self.tp_group)
            checkpoint_loading.load_rank_shard(model, source, self.dtype, self.device)
            return
        if model_has_meta(model):
            raise ValueError(
                "the model has parameters on the meta device; pass checkpoint= to load its weights"
            )
        model.to(dtype=self.dtype)
        if self.tp_size > 1:
            self._plan = discover_plan(model, self.tp_size, cfg.injection_policy)
            apply_plan(model, self._plan, self.tp_rank, self.tp_size, group=self.tp_group)

    def close(self) -> None:
        """Release what the engine holds outside the model: ZeRO-Inference hooks and offload files."""
        if self.zero_partitioner is not None:
            self.zero_partitioner.close()
            self.zero_partitioner = None

    @property
    def config(self) -> DeepSpeedInferenceConfig:
        return self._config

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped model (its fused path when kernels were injected)."""
        with torch.no_grad():
            if self.injected is None:
                return self.module(*inputs, **kwargs)
            out = self.injected(*inputs, **kwargs)
            # See [Note: settings that only some models use]: return_tuple=False gives the tensor.
            return out if self._config.return_tuple else out[0]

    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        eos_token_id: int | list[int] | None = None,
        pad_token_id: int | None = None,
        generator: torch.Generator | None = None,
        **generate_kwargs: Any,
    ) -> torch.Tensor:
        """Generate tokens after ``input_ids`` (greedy, or sampling with ``do_sample``).

        Returns ``[batch, prompt_len + generated]`` like transformers' ``generate``; stops early
        when every sequence produced an eos token (finished rows are filled with ``pad_token_id``).
        Unset settings come from the model's ``generation_config``, as in DeepSpeed, whose
        ``generate`` is the model's own (see [Note: generation defaults]). Other transformers
        arguments (``num_beams``, ``repetition_penalty``, ...) are handed to the sharded model's
        own ``generate``, which needs the same random state on every rank when it samples.
        """
        if generate_kwargs:
            if generator is not None:
                raise TypeError(
                    f"generate: generator= cannot be combined with {sorted(generate_kwargs)}, which "
                    "transformers' generate handles (it draws from the global random state)"
                )
            return self._hf_generate(
                input_ids,
                attention_mask,
                generate_kwargs,
                max_new_tokens=max_new_tokens,
                max_length=max_length,
                do_sample=do_sample,
                temperature=temperature,
                top_k=top_k,
                top_p=top_p,
                eos_token_id=eos_token_id,
                pad_token_id=pad_token_id,
            )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"generate: input_ids must be a 2-D torch.long tensor [batch, prompt_len], got {input_ids!r}"
            )
        given = {
            "do_sample": do_sample,
            "temperature": temperature,
            "top_k": top_k,
            "top_p": top_p,
            "eos_token_id": eos_token_id,
            "pad_token_id": pad_token_id,
        }
        settings, new_tokens = resolve_settings(
            self.module, input_ids.shape[1], given, max_new_tokens, max_length
        )
        if self.injected is not None and hasattr(self.injected, "step"):
            step = self.injected.step_fn(batch=input_ids.shape[0], max_len=input_ids.shape[1] + new_tokens)
        else:
            self._check_lm_head()
            step = hf_step(self.module)
        with torch.no_grad():
            return decode(
                step,
                input_ids,
                attention_mask,
                max_new_tokens=new_tokens,
                generator=generator,
                max_out_tokens=self._config.max_out_tokens,
                min_out_tokens=self._config.min_out_tokens,
                group=self.tp_group if self.tp_size > 1 else None,
                **settings,
            )

    def _check_lm_head(self) -> None:
        if not hasattr(self.module, "get_output_embeddings") or self.module.get_output_embeddings() is None:
            raise TypeError(
                f"generate() needs a causal language model with an LM head; {type(self.module).__name__} has none"
            )

    def _hf_generate(
        self, input_ids: Any, attention_mask: Any, extra: dict[str, Any], **settings: Any
    ) -> torch.Tensor:
        """transformers' ``generate`` of the (sharded) model, for arguments :func:`decode` lacks."""
        if self.injected is not None:
            raise TypeError(
                f"generate: {sorted(extra)} are not supported with replace_with_kernel_inject=True; "
                "the fused decoder does greedy decoding and sampling (temperature, top_k, top_p) only"
            )
        self._check_lm_head()
        kwargs = {k: v for k, v in settings.items() if v is not None}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        with torch.no_grad():
            return self.module.generate(input_ids, **kwargs, **extra)


def _empty_params_(model: nn.Module, dtype: torch.dtype, device: torch.device, *, meta: bool) -> None:
    """``set_empty_params``: drop the parameters' values (buffers are kept).

    With a checkpoint they go to the meta device and the checkpoint fills them (rank slices
    only); without one they become uninitialised tensors for the caller to fill (for example
    ``engine.module.load_state_dict``), so no time is spent copying or initialising values.
    """
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            kind = dtype if p.is_floating_point() else p.dtype
            t = torch.empty(p.shape, dtype=kind, device="meta" if meta else device)
            module._parameters[name] = nn.Parameter(t, requires_grad=False)


def model_has_meta(model: nn.Module) -> bool:
    return any(p.device.type == "meta" for p in model.parameters())


def init_inference(
    model: nn.Module, config: InferenceConfigSource | None = None, **kwargs: object
) -> InferenceEngine:
    """Wrap ``model`` in an :class:`InferenceEngine`.

    ``config`` is a dict, a path to a JSON file or a ``DeepSpeedInferenceConfig``; ``kwargs`` are
    config keys and take precedence over ``config`` (the four cases of DeepSpeed's API).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"init_inference: model must be a torch.nn.Module, got {type(model).__name__}")
    return InferenceEngine(model, load_inference_config(config, **kwargs))

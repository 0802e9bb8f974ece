"""init_inference config: the four call forms, aliases, and the error table."""

from __future__ import annotations

import json

import inference_models as M
import pytest
import torch
import zero_inference as zi
from zero_core.config import ConfigError
from zero_inference.config import load_inference_config


def test_four_cases(tmp_path) -> None:
    assert zi.init_inference(M.gpt2()).config.dtype == torch.float16  # case 1: DeepSpeed's default
    assert zi.init_inference(M.gpt2(), config={"dtype": "fp32"}).config.dtype == torch.float32  # case 2
    assert zi.init_inference(M.gpt2(), dtype=torch.bfloat16).config.dtype == torch.bfloat16  # case 3
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"dtype": "fp16", "max_tokens": 64}))
    engine = zi.init_inference(M.gpt2(), config=str(path), dtype="fp32")  # case 4: kwargs win
    assert engine.config.dtype == torch.float32 and engine.config.max_out_tokens == 64
    assert next(engine.module.parameters()).dtype == torch.float32


def test_aliases() -> None:
    cfg = load_inference_config(
        {"kernel_inject": True, "tp": {"tp_size": 2}, "ckpt_config": {}, "max_tokens": 9}
    )
    assert cfg.replace_with_kernel_inject and cfg.tp_size == 2 and cfg.max_out_tokens == 9
    assert load_inference_config({"mp_size": 4}).tp_size == 4
    assert load_inference_config({"mp_size": 2}, tensor_parallel={"tp_size": 4}).tp_size == 4  # kwargs win
    assert load_inference_config({"quant": {"weight": {"q_groups": 4}}}).quant.weight.q_groups == 4


@pytest.mark.parametrize(
    "config, message",
    [
        ({"dtyp": "fp16"}, "dtyp: unknown key, did you mean dtype?"),
        ({"tensor_parallel": {"tp_sise": 2}}, "tensor_parallel.tp_sise: unknown key, did you mean tp_size?"),
        ({"dtype": "fp8"}, 'dtype: "fp8" is not a supported dtype'),
        (
            {"mp_size": 2, "tensor_parallel": {"tp_size": 4}},
            "mp_size (2) and tensor_parallel.tp_size (4) conflict",
        ),
        ({"kernel_inject": True, "replace_with_kernel_inject": False}, "spellings of the same key"),
        ({"max_out_tokens": 4, "min_out_tokens": 8}, "min_out_tokens (8) is larger than max_out_tokens (4)"),
        ({"tensor_parallel": {"tp_size": 0}}, "tensor_parallel.tp_size: 0 is out of range"),
        ({"zero": {"stage": 2}}, "zero.stage 2 partitions optimizer state"),
        ({"triton_autotune": True}, "triton_autotune: true needs use_triton: true"),
        ({"quant": {"weight": {"num_bits": 4}}}, "quant.weight.num_bits: 4 is not one of 8"),
    ],
)
def test_config_errors(config: dict, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_inference_config(config)
    assert message in str(err.value)


@pytest.mark.parametrize("key", ["enable_cuda_graph", "use_triton"])
def test_cuda_only_fields_are_rejected_on_cpu(key: str) -> None:
    with pytest.raises(ConfigError, match=f"{key}: .*need a CUDA device, but the model runs on cpu"):
        zi.init_inference(M.gpt2(), **{key: True})


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        zi.init_inference("gpt2")
    with pytest.raises(ConfigError, match="expected a dict, a path to a JSON file"):
        zi.init_inference(M.gpt2(), config=3)
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        zi.init_inference(M.gpt2(), tensor_parallel={"tp_size": 2})
    with pytest.raises(ValueError, match="no fused kernels for Sequential"):
        zi.init_inference(torch.nn.Sequential(torch.nn.Linear(4, 4)), replace_with_kernel_inject=True)


def test_return_tuple() -> None:
    x = M.ids()
    as_tuple = zi.init_inference(M.gpt2(), dtype="fp32", kernel_inject=True)(x)
    assert isinstance(as_tuple, tuple) and len(as_tuple) == 1 and as_tuple[0] is as_tuple.logits
    bare = zi.init_inference(M.gpt2(), dtype="fp32", kernel_inject=True, return_tuple=False)(x)
    assert isinstance(bare, torch.Tensor) and torch.equal(bare, as_tuple.logits)
    bert = zi.init_inference(M.bert(), dtype="fp32", kernel_inject=True, return_tuple=False)(x)
    assert isinstance(bert, torch.Tensor) and bert.shape == (2, 7, 96)


def test_set_empty_params(tmp_path) -> None:
    x = M.ids()
    with torch.no_grad():
        want = M.llama()(x).logits
    M.llama().save_pretrained(tmp_path)
    # With a checkpoint: the given values are dropped and the checkpoint fills the parameters.
    filled = zi.init_inference(M.llama(seed=7), dtype="fp32", set_empty_params=True, checkpoint=str(tmp_path))
    assert torch.equal(filled(x).logits, want)
    # Without one: parameters are fresh uninitialised tensors for the caller to fill.
    model = M.llama(seed=7)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    empty = zi.init_inference(model, dtype="fp32", set_empty_params=True)
    assert all(p.data_ptr() != before[n] for n, p in empty.module.named_parameters())
    empty.module.load_state_dict(M.llama().state_dict())
    assert torch.equal(empty(x).logits, want)


@pytest.mark.parametrize(
    "model, kwargs, message",
    [
        (M.gpt2, {"return_tuple": False}, "return_tuple: only the kernel-injected forward"),
        (M.gpt2, {"tm": True}, "triangular_masking: only the kernel-injected attention"),
        (
            M.gpt2,
            {"kernel_inject": True, "triangular_masking": False},
            "false does not apply to the causal gpt2",
        ),
        (M.bert, {"kernel_inject": True, "triangular_masking": True}, "true does not apply to bert encoders"),
        (M.gpt2, {"dtype": "int8", "quant": {"activation": {"num_bits": 8}}}, "quant.activation: activation"),
        (M.gpt2, {"transposed_mode": True}, "transposed_mode: true is not supported"),
    ],
)
def test_settings_that_do_not_apply(model, kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        zi.init_inference(model(), **{"dtype": "fp32", **kwargs})


def test_settings_that_apply_are_accepted() -> None:
    zi.init_inference(M.gpt2(), dtype="fp32", kernel_inject=True, triangular_masking=True)
    zi.init_inference(M.bert(), dtype="fp32", kernel_inject=True, tm=False)
    zi.init_inference(M.gpt2(), dtype="int8", quant={"activation": {"enabled": False}})

"""Memory estimators against the worked examples of DeepSpeed's memory-requirements docs and the ZeRO paper's figure."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn
from zero_profiler import (
    estimate_transformer_activation_mem,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    shape_from_hf_config,
    zero_paper_model_states_bytes,
)
from zero_profiler.estimate_cli import main as cli_main
from zero_profiler.memory_estimators import model_param_counts


def t5_shaped(d_model, d_ff, inner, layers, vocab=32128, heads=32):
    """A model with T5's parameter shapes (T5Model: no LM head), on the meta device."""
    with torch.device("meta"):
        shared = nn.Embedding(vocab, d_model)

        def attn(first):
            m = nn.ModuleDict(
                {
                    n: nn.Linear(d_model if n != "o" else inner, inner if n != "o" else d_model, bias=False)
                    for n in "qkvo"
                }
            )
            if first:
                m["relative_attention_bias"] = nn.Embedding(32, heads)
            return m

        def block(i, decoder):
            parts = {"sa": attn(i == 0), "ln1": nn.LayerNorm(d_model, bias=False)}
            if decoder:
                parts |= {"ca": attn(False), "ln_ca": nn.LayerNorm(d_model, bias=False)}
            parts |= {"wi": nn.Linear(d_model, d_ff, bias=False), "wo": nn.Linear(d_ff, d_model, bias=False)}
            parts["ln2"] = nn.LayerNorm(d_model, bias=False)
            return nn.ModuleDict(parts)

        model = nn.ModuleDict(
            {
                "shared": shared,
                "encoder": nn.ModuleList(
                    [block(i, False) for i in range(layers)] + [nn.LayerNorm(d_model, bias=False)]
                ),
                "decoder": nn.ModuleList(
                    [block(i, True) for i in range(layers)] + [nn.LayerNorm(d_model, bias=False)]
                ),
                # embed_tokens of encoder and decoder are the shared table (tied)
                "enc_embed": shared,
                "dec_embed": shared,
            }
        )
    return model


def table_rows(out: str) -> list[tuple[str, str, str]]:
    rows = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split("|")]
        if len(parts) == 3 and parts[0].endswith("GB"):
            rows.append((parts[0], parts[1], " ".join(parts[2].split())))
    return rows


def test_t5_3b_shapes_have_2851m_params():
    total, largest = model_param_counts(t5_shaped(1024, 16384, 4096, 24))
    assert total == 2_851_598_336
    assert largest == 32_899_072


def test_zero2_seed_examples(capsys):
    model = t5_shaped(1024, 16384, 4096, 24)
    rows = estimate_zero2_model_states_mem_needs_all_live(model, num_gpus_per_node=8, num_nodes=1)
    out = capsys.readouterr().out
    assert "HW: Setup with 1 node, 8 GPUs per node." in out
    assert "SW: Model with 2851M total params." in out
    assert table_rows(out) == [
        ("127.48GB", "5.31GB", "offload_optimizer=cpu"),
        ("127.48GB", "15.93GB", "offload_optimizer=none"),
    ]
    assert rows[1].gpu_bytes == 6 * 2_851_598_336
    estimate_zero2_model_states_mem_needs_all_cold(total_params=2851e6, num_gpus_per_node=8, num_nodes=1)
    assert table_rows(capsys.readouterr().out) == [
        ("127.45GB", "5.31GB", "offload_optimizer=cpu"),
        ("127.45GB", "15.93GB", "offload_optimizer=none"),
    ]


def test_zero3_seed_examples(capsys):
    estimate_zero3_model_states_mem_needs_all_live(
        t5_shaped(1024, 16384, 4096, 24), num_gpus_per_node=8, num_nodes=1
    )
    out = capsys.readouterr().out
    assert "SW: Model with 2851M total params, 32M largest layer params." in out
    assert table_rows(out) == [
        ("71.71GB", "0.12GB", "offload_param=cpu , offload_optimizer=cpu , zero_init=1"),
        ("127.48GB", "0.12GB", "offload_param=cpu , offload_optimizer=cpu , zero_init=0"),
        ("63.74GB", "0.79GB", "offload_param=none, offload_optimizer=cpu , zero_init=1"),
        ("127.48GB", "0.79GB", "offload_param=none, offload_optimizer=cpu , zero_init=0"),
        ("1.47GB", "6.10GB", "offload_param=none, offload_optimizer=none, zero_init=1"),
        ("127.48GB", "6.10GB", "offload_param=none, offload_optimizer=none, zero_init=0"),
    ]
    rows = estimate_zero3_model_states_mem_needs_all_cold(2851e6, 32e6, num_gpus_per_node=8, num_nodes=1)
    got = [(f"{r.cpu_gb:.2f}", f"{r.gpu_gb:.2f}") for r in rows]
    assert got == [
        ("71.69", "0.12"),
        ("127.45", "0.12"),
        ("63.72", "0.78"),
        ("127.45", "0.78"),
        ("1.43", "6.09"),
        ("127.45", "6.09"),
    ]


def test_t5_large_discussion_example():
    total, largest = model_param_counts(t5_shaped(1024, 4096, 1024, 24, heads=16))
    assert f"{total / 1e6:6.2f}M" == "737.67M" and f"{largest / 1e6:6.2f}M" == " 32.90M"
    rows = {
        (r.offload_param, r.offload_optimizer): r.gpu_bytes
        for r in estimate_zero3_model_states_mem_needs_all_cold(total, largest, num_gpus_per_node=4)
    }
    assert int(rows[("cpu", "cpu")]) >> 20 == 125
    assert int(4 * largest + int(18 * total / 4)) >> 20 == int(rows[("none", "none")]) >> 20 == 3291
    assert int(rows[("none", "cpu")]) >> 20 == 477


def test_zero_paper_figure():
    got = [round(zero_paper_model_states_bytes(7.5e9, 64, s) / 1e9, 2) for s in range(4)]
    assert got == [120.0, 31.41, 16.64, 1.88]
    assert f"{zero_paper_model_states_bytes(7.5e9, 64, 1) / 1e9:.1f}" == "31.4"
    assert f"{zero_paper_model_states_bytes(7.5e9, 64, 2) / 1e9:.1f}" == "16.6"


def test_estimators_validate_input():
    with pytest.raises(ValueError, match="num_gpus_per_node"):
        estimate_zero2_model_states_mem_needs_all_cold(1e9, num_gpus_per_node=0)
    with pytest.raises(ValueError, match="largest_layer_params"):
        estimate_zero3_model_states_mem_needs_all_cold(1e6, 2e6)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        estimate_zero3_model_states_mem_needs_all_live("gpt2")
    with pytest.raises(ValueError, match="stage"):
        zero_paper_model_states_bytes(1e9, 8, 4)


GPT2 = {
    "model_type": "gpt2",
    "vocab_size": 50257,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_positions": 1024,
}
LLAMA2_7B = {
    "model_type": "llama", "vocab_size": 32000, "hidden_size": 4096, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008, "tie_word_embeddings": False,
}  # fmt: skip


def test_hf_config_param_counts():
    assert shape_from_hf_config(GPT2).total_params() == 124_439_808
    assert shape_from_hf_config(LLAMA2_7B).total_params() == 6_738_415_616


def test_activation_memory_formula():
    # Korthikanti et al.: sbh(34 + 5as/h) bytes per layer.
    s, b, h, a, L = 2048, 1, 4096, 32, 32
    assert estimate_transformer_activation_mem(h, L, a, s, b) == L * (s * b * h * 34 + 5 * a * s * s * b)
    assert estimate_transformer_activation_mem(h, L, a, s, b, flash_attention=True) == L * 34 * s * b * h
    assert estimate_transformer_activation_mem(h, L, a, s, b, tensor_parallel_size=8) == L * (
        10 * s * b * h + (24 * s * b * h + 5 * a * s * s * b) // 8
    )
    full = s * b * h * 34 + 5 * a * s * s * b
    assert (
        estimate_transformer_activation_mem(h, L, a, s, b, activation_checkpointing=True)
        == L * 2 * s * b * h + full
    )
    with pytest.raises(ValueError, match="seq_length"):
        estimate_transformer_activation_mem(h, L, a, 0, b)


def test_cli_tables_and_json(capsys, tmp_path):
    assert cli_main(["--params", "7e9", "--gpus", "8", "--nodes", "1", "--largest-layer-params", "5e8"]) == 0
    out = capsys.readouterr().out
    assert "SW: Model with 7000M total params." in out
    assert len(table_rows(out)) == 2 + 6
    assert "3 (+ parameters)" in out and "14.00 GB" in out
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA2_7B))
    assert cli_main(["--model-config", str(cfg), "--gpus", "8", "--seq-len", "2048", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["total_params"] == 6_738_415_616
    assert data["activation_bytes_per_gpu"] == estimate_transformer_activation_mem(4096, 32, 32, 2048, 1)
    assert len(data["zero3"]) == 6
    with pytest.raises(SystemExit):
        cli_main(["--params", "-3"])

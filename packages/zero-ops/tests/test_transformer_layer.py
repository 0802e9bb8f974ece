"""The fused BERT layer (zero_ops.transformer): against Hugging Face's BertLayer and a plain-torch
pre-LN block, its memory switches (same gradients, the bytes they state), precision, masks and
the HF replace/revert round trip. transformers comes from zero-ops' test extra."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers
from zero_ops.transformer import (
    SWITCHES,
    DeepSpeedTransformerConfig,
    DeepSpeedTransformerLayer,
    TransformerConfig,
    TransformerLayer,
    layer_saved_bytes,
    replace_bert_layers,
    revert_bert_layers,
    stated_savings,
)

H, HEADS, INTER, B, S = 32, 4, 64, 3, 7


def bert_config(dropout: float = 0.0, **kw) -> transformers.BertConfig:
    values = dict(
        vocab_size=50,
        hidden_size=H,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        num_hidden_layers=2,
        max_position_embeddings=16,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        attn_implementation="eager",
    )
    values.update(kw)
    return transformers.BertConfig(**values)


def config(**kw) -> TransformerConfig:
    values = dict(
        hidden_size=H,
        intermediate_size=INTER,
        heads=HEADS,
        attn_dropout_ratio=0.1,
        hidden_dropout_ratio=0.1,
        num_hidden_layers=2,
        initializer_range=0.02,
    )
    values.update(kw)
    return TransformerConfig(**values)


def hf_pair(dropout: float = 0.0, **overrides) -> tuple[torch.nn.Module, TransformerLayer]:
    """A BertLayer (with non-trivial LayerNorm and bias values) and the fused layer replacing it."""
    model = transformers.BertModel(bert_config(dropout))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf = model.encoder.layer[0]
    fused = copy.deepcopy(model)
    replace_bert_layers(fused, **overrides)
    return hf, fused.encoder.layer[0]


def padding_mask() -> torch.Tensor:
    """BERT's extended mask: additive, (B, 1, 1, S), the last tokens of some rows padded."""
    mask = torch.zeros(B, 1, 1, S)
    mask[1, ..., 5:] = torch.finfo(torch.float32).min
    mask[2, ..., 3:] = torch.finfo(torch.float32).min
    return mask


def run(
    layer: torch.nn.Module, x: torch.Tensor, mask: torch.Tensor | None, seed: int = 3
) -> list[torch.Tensor]:
    """Output and the gradients of (input, every parameter) for a fixed loss."""
    torch.manual_seed(seed)
    x = x.detach().requires_grad_(True)
    out = layer(x, mask)
    out = out[0] if isinstance(out, tuple) else out
    weight = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
    grads = torch.autograd.grad((out * weight).sum(), [x, *layer.parameters()])
    return [out.detach(), *grads]


def hf_order(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The fused layer's outputs/grads in BertLayer.parameters() order (Q, K, V split)."""
    out, dx, qkvw, qkvb, ow, ob, anw, anb, iw, ib, o2w, o2b, nw, nb = grads
    qw, kw, vw = qkvw.chunk(3)
    qb, kb, vb = qkvb.chunk(3)
    return [out, dx, qw, qb, kw, kb, vw, vb, ow, ob, anw, anb, iw, ib, o2w, o2b, nw, nb]


def assert_all_close(got: list[torch.Tensor], want: list[torch.Tensor], rtol: float, atol: float) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m, i=i: f"tensor {i}: {m}")


# --------------------------------------------------------------------------- config
def test_config_has_deepspeeds_parameters_and_defaults():
    cfg = DeepSpeedTransformerConfig()
    assert DeepSpeedTransformerConfig is TransformerConfig and DeepSpeedTransformerLayer is TransformerLayer
    expected = dict(
        batch_size=-1, hidden_size=-1, intermediate_size=-1, heads=-1, attn_dropout_ratio=-1,
        hidden_dropout_ratio=-1, num_hidden_layers=-1, initializer_range=-1, layer_norm_eps=1e-12,
        local_rank=-1, seed=-1, fp16=False, pre_layer_norm=True, normalize_invertible=False,
        gelu_checkpoint=False, adjust_init_range=True, attn_dropout_checkpoint=False,
        stochastic_mode=False, return_tuple=False, training=True,
    )  # fmt: skip
    for name, value in expected.items():
        assert getattr(cfg, name) == value, name
    assert TransformerConfig(hidden_size=64, heads=4).intermediate_size == 256
    assert TransformerConfig.from_dict(config().to_dict()) == config()


@pytest.mark.parametrize(
    "kw,err,match",
    [
        (dict(hidden_size=30, heads=4), ValueError, r"heads \(4\) must divide hidden_size \(30\)"),
        (dict(attn_dropout_ratio=-0.1), ValueError, r"attn_dropout_ratio must be in \[0, 1\)"),
        (dict(hidden_dropout_ratio=1.0), ValueError, r"hidden_dropout_ratio must be in \[0, 1\)"),
        (dict(heads=0), ValueError, r"heads must be >= 1"),
        (dict(hidden_size=2.5), TypeError, r"hidden_size must be an int"),
        (dict(initializer_range=0.0), ValueError, r"initializer_range must be a finite number > 0"),
        (dict(layer_norm_eps=-1.0), ValueError, r"layer_norm_eps must be a finite number > 0"),
        (dict(fp16=1), TypeError, r"fp16 must be a bool"),
        (dict(fp16=True, bf16=True), ValueError, r"fp16 and bf16 are both True"),
        (dict(local_rank=-2), ValueError, r"local_rank must be >= 0 \(or -1"),
    ],
)
def test_config_bad_values_are_clear_errors(kw, err, match):
    with pytest.raises(err, match=match):
        TransformerConfig(**kw)


def test_config_unknown_key_and_unset_fields():
    with pytest.raises(ValueError, match=r"unknown keys \['hiden_size'\]"):
        TransformerConfig.from_dict({"hiden_size": 4})
    with pytest.raises(
        ValueError, match=r"hidden_size, heads, attn_dropout_ratio, hidden_dropout_ratio must be set"
    ):
        TransformerLayer(TransformerConfig())
    with pytest.raises(ValueError, match=r"num_hidden_layers must be set .* adjust_init_range"):
        TransformerLayer(config(num_hidden_layers=-1))
    with pytest.raises(TypeError, match="config must be a TransformerConfig"):
        TransformerLayer({"hidden_size": H})


# --------------------------------------------------------------------------- layer construction
def test_layer_id_counts_every_layer_built():
    start = TransformerLayer.layer_id
    layers = [TransformerLayer(config()) for _ in range(3)]
    assert [layer.layer_id for layer in layers] == [start, start + 1, start + 2]
    assert TransformerLayer.layer_id == start + 3


def test_initialisation_and_adjust_init_range():
    cfg = config(
        hidden_size=256, heads=4, intermediate_size=1024, num_hidden_layers=8, initializer_range=0.05
    )
    for adjust in (True, False):
        cfg.adjust_init_range = adjust
        layer = TransformerLayer(cfg)
        out_std = 0.05 / math.sqrt(2.0 * 8) if adjust else 0.05
        for name, std in (
            ("attn_qkvw", 0.05),
            ("inter_w", 0.05),
            ("attn_ow", out_std),
            ("output_w", out_std),
        ):
            w = getattr(layer, name)
            assert abs(w.std().item() - std) < 0.03 * std, (adjust, name, w.std().item(), std)
            assert abs(w.mean().item()) < 0.03 * std, (adjust, name)
        for name in ("attn_nw", "norm_w"):
            assert torch.equal(getattr(layer, name), torch.ones(256))
        for name in ("attn_qkvb", "attn_ob", "attn_nb", "inter_b", "output_b", "norm_b"):
            assert not getattr(layer, name).any(), name


def test_initial_weights_and_biases():
    hf, _ = hf_pair()
    ws = [hf.attention.self.query, hf.attention.self.key, hf.attention.self.value, hf.attention.output.dense]
    ws += [hf.attention.output.LayerNorm, hf.intermediate.dense, hf.output.dense, hf.output.LayerNorm]
    layer = TransformerLayer(config(), [m.weight for m in ws], [m.bias for m in ws])
    assert torch.equal(layer.attn_qkvw, torch.cat([m.weight for m in ws[:3]]))
    assert torch.equal(layer.output_w, ws[6].weight) and torch.equal(layer.norm_b, ws[7].bias)
    with pytest.raises(ValueError, match="must be 8 tensors"):
        TransformerLayer(config(), [m.weight for m in ws[:7]], [m.bias for m in ws[:7]])
    with pytest.raises(
        ValueError, match=r"initial value for inter_w has shape \(64, 32\), expected \(128, 32\)"
    ):
        TransformerLayer(config(intermediate_size=128), [m.weight for m in ws], [m.bias for m in ws])
    with pytest.raises(ValueError, match="give both initial_weights and initial_biases"):
        TransformerLayer(config(), [m.weight for m in ws])


# --------------------------------------------------------------------------- against Hugging Face
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_dropout0"])
def test_matches_hf_bert_layer_fp32(train):
    hf, fused = hf_pair(dropout=0.0)
    hf.train(train), fused.train(train)
    x = torch.randn(B, S, H)
    want = run(hf, x, padding_mask())
    got = hf_order(run(fused, x, padding_mask()))
    assert_all_close(got, want, rtol=1e-5, atol=1e-6)


def test_training_dropout_draws_bert_layers_masks():
    """Deterministic mode draws its dropout masks as BertLayer (eager) does, in the same order:
    same seed, same outputs and gradients with dropout 0.1."""
    hf, fused = hf_pair(dropout=0.1)
    hf.train(), fused.train()
    x = torch.randn(B, S, H)
    want = run(hf, x, padding_mask())
    assert not torch.equal(want[0], run(hf, x, padding_mask(), seed=4)[0])  # dropout is active
    assert_all_close(hf_order(run(fused, x, padding_mask())), want, rtol=1e-5, atol=1e-6)


class PreLNReference(torch.nn.Module):
    """A pre-LN BERT block in plain torch: x + drop(attn(LN(x))), then + drop(ffn(LN(.)))."""

    def __init__(self, layer: TransformerLayer) -> None:
        super().__init__()
        self.f = layer  # reads the fused layer's parameters

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        f, n, d = self.f, HEADS, H // HEADS
        h = F.layer_norm(x, (H,), f.norm_w, f.norm_b, 1e-12)
        q, k, v = F.linear(h, f.attn_qkvw, f.attn_qkvb).split(H, dim=-1)
        q, k, v = (t.view(B, S, n, d).transpose(1, 2) for t in (q, k, v))
        probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d) + mask, dim=-1)
        ctx = (probs @ v).transpose(1, 2).reshape(B, S, H)
        x = x + F.linear(ctx, f.attn_ow, f.attn_ob)
        h = F.layer_norm(x, (H,), f.attn_nw, f.attn_nb, 1e-12)
        return x + F.linear(F.gelu(F.linear(h, f.inter_w, f.inter_b)), f.output_w, f.output_b)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train_dropout0"])
def test_pre_ln_matches_plain_torch_reference(train):
    layer = TransformerLayer(config(attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, pre_layer_norm=True))
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.05 * torch.randn_like(p))
    layer.train(train)
    x = torch.randn(B, S, H)
    assert_all_close(run(layer, x, padding_mask()), run(PreLNReference(layer), x, padding_mask()), 1e-5, 1e-6)


# --------------------------------------------------------------------------- memory switches
@pytest.mark.parametrize("pre_ln", [False, True], ids=["post_ln", "pre_ln"])
@pytest.mark.parametrize("switch", [*SWITCHES, "all"])
def test_switch_leaves_gradients_unchanged(switch, pre_ln):
    torch.manual_seed(0)
    base = TransformerLayer(config(pre_layer_norm=pre_ln))
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other = copy.deepcopy(base)
    for name in SWITCHES if switch == "all" else (switch,):
        setattr(other.config, name, True)
    x = torch.randn(B, S, H)
    assert_all_close(run(other, x, padding_mask()), run(base, x, padding_mask()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(pre_layer_norm=False), dict(bf16=True), dict(stochastic_mode=True)],
    ids=["pre_ln", "post_ln", "bf16", "stochastic"],
)
def test_switch_saves_its_stated_bytes(kw):
    """Measured with saved_tensors_hooks (marginal layer of a stack) against stated_savings."""
    cfg = config(**kw)
    x = torch.randn(B, S, H, dtype=cfg.dtype)

    def measure(**switches: bool) -> int:
        torch.manual_seed(0)
        c = TransformerConfig.from_dict({**cfg.to_dict(), **switches})
        return layer_saved_bytes(lambda: TransformerLayer(c), x, padding_mask().to(cfg.dtype))

    base, stated = measure(), stated_savings(cfg, B, S)
    assert base > 0
    for switch in SWITCHES:
        assert base - measure(**{switch: True}) == stated[switch], switch
    assert base - measure(**dict.fromkeys(SWITCHES, True)) == sum(stated.values())
    assert (stated["attn_dropout_checkpoint"] == 0) == cfg.stochastic_mode  # nothing kept to drop
    assert stated["gelu_checkpoint"] == B * S * INTER * x.element_size()


# --------------------------------------------------------------------------- precision and modes
@pytest.mark.parametrize("flag,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_precision_layers(flag, dtype):
    torch.manual_seed(0)
    ref = TransformerLayer(config(attn_dropout_ratio=0.0, hidden_dropout_ratio=0.0, pre_layer_norm=False))
    half = TransformerLayer(TransformerConfig.from_dict({**ref.config.to_dict(), flag: True}))
    half.load_state_dict(ref.state_dict())
    assert all(p.dtype == dtype for p in half.parameters())
    x = torch.randn(B, S, H)
    want = run(ref, x, padding_mask())
    got = run(half, x.to(dtype), padding_mask())
    assert all(g.dtype == dtype for g in got)
    tol = 2e-2 if dtype == torch.float16 else 8e-2
    for g, w in zip(got[:2], want[:2], strict=True):  # output and input gradient
        assert (g.float() - w).norm() <= tol * w.norm()
    with pytest.raises(TypeError, match=r"hidden_states are torch.float32 but the layer's parameters are"):
        half(x)


def test_stochastic_mode_and_seed():
    torch.manual_seed(0)
    det = TransformerLayer(config(seed=11))
    sto = TransformerLayer(TransformerConfig.from_dict({**det.config.to_dict(), "stochastic_mode": True}))
    sto.load_state_dict(det.state_dict())
    x = torch.randn(B, S, H)
    det.eval(), sto.eval()
    torch.testing.assert_close(sto(x, padding_mask()), det(x, padding_mask()), rtol=1e-5, atol=1e-6)
    sto.train()
    out = run(sto, x, padding_mask())
    assert all(torch.isfinite(t).all() for t in out)
    # a set seed gives the layer its own dropout stream: two layers with the same seed draw the same
    twin = TransformerLayer(det.config)
    twin.load_state_dict(det.state_dict())
    det.train(), twin.train()
    torch.testing.assert_close(run(det, x, None, seed=1), run(twin, x, None, seed=2), rtol=0, atol=0)


def test_training_flag_return_tuple_and_mask_formats():
    assert not TransformerLayer(config(training=False)).training
    layer = TransformerLayer(config(return_tuple=True))
    layer.eval()
    x = torch.randn(B, S, H)
    keep = padding_mask()[:, 0, 0, :] == 0  # (B, S), True = attend
    out = layer(x, padding_mask())
    assert isinstance(out, tuple) and len(out) == 1
    for other in (keep.long(), keep[:, None, None, :], keep[:, None, None, :].expand(B, 1, S, S)):
        torch.testing.assert_close(layer(x, other)[0], out[0], rtol=0, atol=0)
    assert not torch.allclose(layer(x)[0], out[0])
    with pytest.raises(ValueError, match=r"attention_mask must be 2-D \(batch, seq\) or 4-D"):
        layer(x, keep[:, None, :])
    with pytest.raises(ValueError, match=r"output_attentions is not supported"):
        layer(x, None, output_attentions=True)
    with pytest.raises(ValueError, match=r"hidden_states must be a \(batch, seq, 32\) tensor"):
        layer(x[0])
    with pytest.raises(ValueError, match=r"batch of 3 exceeds the config's batch_size 2"):
        TransformerLayer(config(batch_size=2))(x)


def test_activation_checkpointing_keeps_gradients():
    """torch.utils.checkpoint replays the layer's dropout (global generator) exactly."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    layer = TransformerLayer(
        config(gelu_checkpoint=True, normalize_invertible=True, attn_dropout_checkpoint=True)
    )

    class Checkpointed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = layer

        def forward(self, x, mask):
            return checkpoint(self.inner, x, mask, use_reentrant=False)

    x = torch.randn(B, S, H)
    assert_all_close(
        run(Checkpointed(), x, padding_mask()), run(layer, x, padding_mask()), rtol=1e-6, atol=1e-7
    )


# --------------------------------------------------------------------------- Hugging Face round trip
@pytest.mark.parametrize("attn", ["eager", "sdpa"])  # additive and bool masks reach the layers
def test_replace_and_revert_bert_model(attn):
    torch.manual_seed(0)
    model = transformers.BertForMaskedLM(bert_config(0.0, attn_implementation=attn))
    model.eval()
    ids = torch.randint(0, 50, (B, S))
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, 5:] = 0
    want = model(input_ids=ids, attention_mask=attn).logits
    original = {k: v.clone() for k, v in model.state_dict().items()}
    replace_bert_layers(model, normalize_invertible=True)
    assert all(isinstance(layer, TransformerLayer) for layer in model.bert.encoder.layer)
    assert model.bert.encoder.layer[1].config.normalize_invertible
    torch.testing.assert_close(model(input_ids=ids, attention_mask=attn).logits, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        model.bert.encoder.layer[0].attn_qkvw[H + 1, 2] += 1.0  # "training": lands in key.weight
    revert_bert_layers(model)
    state = model.state_dict()
    assert state.keys() == original.keys()
    key = "bert.encoder.layer.0.attention.self.key.weight"
    assert state[key][1, 2] == original[key][1, 2] + 1.0
    state[key][1, 2] = original[key][1, 2]  # the only change
    for name, value in original.items():
        assert torch.equal(state[name], value), name
    with pytest.raises(ValueError, match="no TransformerLayer found"):
        revert_bert_layers(model)
    with pytest.raises(ValueError, match="exact \\(erf\\) GELU"):
        replace_bert_layers(transformers.BertModel(bert_config(hidden_act="relu")))

"""CPUAdam / cpu_adam_step against torch.optim.Adam(W), the fallback path and the ISA variants."""

from __future__ import annotations

import copy

import pytest
import torch
from zero_ops import _native
from zero_ops.adam import CPUAdam, CPUAdamKernel, DeepSpeedCPUAdam, cpu_adam_step
from zero_ops.adam.functional import adam_scalars, adam_step_torch

ODD_SIZES = [1, 7, 1001, 65537 + 3]


def assert_close_rel(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> None:
    """Elementwise within rtol relative, with an absolute floor of rtol * max|expected|.

    The floor covers elements near zero, where fp32 rounding in any implementation (torch's own
    vectorised loop and its scalar tail differ by an ulp) is large relative to the value.
    """
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * max(scale, 1e-30))


def _params(sizes):
    return [torch.randn(n) for n in sizes]


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_matches_torch_adam_100_steps(amsgrad, adamw_mode):
    init = _params(ODD_SIZES)
    ours = [torch.nn.Parameter(p.clone()) for p in init]
    ref = [torch.nn.Parameter(p.clone()) for p in init]
    kw = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-7, weight_decay=0.05, amsgrad=amsgrad)
    opt = CPUAdam(ours, adamw_mode=adamw_mode, **kw)
    ref_opt = (torch.optim.AdamW if adamw_mode else torch.optim.Adam)(ref, **kw)
    for _ in range(100):
        for a, b in zip(ours, ref):
            g = torch.randn_like(a)
            a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        assert_close_rel(a.detach(), b.detach())
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
            assert_close_rel(opt.state[a][key], ref_opt.state[b][key])
        assert opt.state[a]["step"].item() == 100


def test_without_bias_correction_matches_formula():
    p = torch.randn(333)
    g = torch.randn(333)
    m, v = torch.zeros(333), torch.zeros(333)
    ref = p.clone()
    cpu_adam_step(
        p, g, m, v, step=1, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, bias_correction=False
    )
    m_ref = 0.1 * g
    v_ref = 0.01 * g * g
    assert_close_rel(p, ref - 0.01 * m_ref / (v_ref.sqrt() + 1e-8), rtol=1e-5)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_native_equals_torch_fallback(grad_dtype, amsgrad):
    if _native.native() is None:
        pytest.fail("native extension not built: " + _native.fallback_reason())
    n = 40_009
    base = [
        torch.randn(n),
        torch.randn(n).to(grad_dtype),
        torch.randn(n) * 0.1,
        torch.rand(n) * 0.01,
        torch.rand(n) * 0.02,
    ]
    nat = [t.clone() for t in base]
    fb = [t.clone() for t in base]
    for step in (1, 2, 3):
        cpu_adam_step(
            *nat[:4],
            step=step,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=0.01,
            amsgrad_max=nat[4] if amsgrad else None,
        )
        s = adam_scalars(
            step=step,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.01,
            adamw_mode=True,
            bias_correction=True,
        )
        adam_step_torch(*fb[:4], fb[4] if amsgrad else None, None, beta1=0.9, beta2=0.999, eps=1e-8, **s)
    for a, b in zip(nat, fb):
        assert_close_rel(a.float(), b.float())


def test_isa_variants_agree():
    C = _native.native()
    if C is None:
        pytest.fail("native extension not built: " + _native.fallback_reason())
    usable = [isa for isa in C.compiled_isas() if C.cpu_supports(isa)]
    n = 10_007
    base = [torch.randn(n), torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01]
    results = {}
    original = C.isa()
    try:
        for isa in usable:
            C.select_isa(isa)
            t = [x.clone() for x in base]
            for step in (1, 2):
                cpu_adam_step(*t, step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
            results[isa] = t
    finally:
        C.select_isa(original)
    fma = [isa for isa in usable if isa in ("avx2", "avx512")]
    for isa in fma[1:]:  # FMA variants: bit-identical
        assert all(torch.equal(a, b) for a, b in zip(results[fma[0]], results[isa]))
    for isa in usable:
        for a, b in zip(results[usable[0]], results[isa]):
            assert_close_rel(a, b)
    with pytest.raises(ValueError, match="unknown ISA"):
        C.select_isa("sse9")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_copy_equals_rounded_master(dtype):
    init = torch.randn(1003)
    p = torch.nn.Parameter(init.to(dtype))
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.01)
    ref = torch.nn.Parameter(init.to(dtype).float())
    ref_opt = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.01)
    for _ in range(10):
        g = torch.randn(1003).to(dtype)
        p.grad = g
        ref.grad = g.float()
        opt.step()
        ref_opt.step()
    master = opt.state[p]["master_param"]
    assert master.dtype == torch.float32 and opt.state[p]["exp_avg"].dtype == torch.float32
    assert torch.equal(p.detach(), master.to(dtype))  # bit-exact round-to-nearest-even
    assert_close_rel(master, ref.detach())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_low_precision_out(dtype):
    n = 70_001
    p, g, m, v = torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=dtype)
    cpu_adam_step(
        p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, low_precision_out=out
    )
    assert torch.equal(out, p.to(dtype))


def test_fp32_optimizer_states_false_keeps_param_dtype():
    p = torch.nn.Parameter(torch.randn(101).to(torch.bfloat16))
    opt = CPUAdam([p], lr=1e-2, fp32_optimizer_states=False)
    p.grad = torch.randn(101).to(torch.bfloat16)
    before = p.detach().clone()
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and "master_param" not in opt.state[p]
    assert not torch.equal(before, p.detach())


def test_state_dict_round_trip_with_torch_adamw():
    init = torch.randn(257)
    a = torch.nn.Parameter(init.clone())
    b = torch.nn.Parameter(init.clone())
    ref_opt = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1)
    grads = [torch.randn(257) for _ in range(6)]
    for g in grads[:3]:
        b.grad = g.clone()
        ref_opt.step()
    a.data.copy_(b.data)
    opt = CPUAdam([a], lr=0.5)  # hyper-parameters come from the loaded state_dict
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.param_groups[0]["adamw_mode"] is True and opt.param_groups[0]["lr"] == 1e-2
    for g in grads[3:]:
        a.grad, b.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert_close_rel(a.detach(), b.detach())
    # ... and back into torch
    c = torch.nn.Parameter(a.detach().clone())
    back = torch.optim.AdamW([c], lr=1.0)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))  # torch aliases loaded "step" tensors
    g = torch.randn(257)
    c.grad, a.grad = g.clone(), g.clone()
    back.step()
    opt.step()
    assert_close_rel(c.detach(), a.detach())


def test_load_state_dict_keeps_fp32_moments_for_bf16_params():
    p = torch.nn.Parameter(torch.randn(65).to(torch.bfloat16))
    opt = CPUAdam([p])
    p.grad = torch.randn(65).to(torch.bfloat16)
    opt.step()
    sd = opt.state_dict()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = CPUAdam([q])
    opt2.load_state_dict(sd)
    for key in ("exp_avg", "exp_avg_sq", "master_param"):
        assert opt2.state[q][key].dtype == torch.float32
        assert torch.equal(opt2.state[q][key], opt.state[p][key])


def test_deepspeed_name_and_closure():
    assert DeepSpeedCPUAdam is CPUAdam
    model = torch.nn.Linear(5, 3)
    opt = DeepSpeedCPUAdam(model.parameters())
    x = torch.randn(4, 5)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    l0 = opt.step(closure).item()
    for _ in range(20):
        opt.step(closure)
    assert closure().item() < l0


def test_kernel_protocol_and_tiles():
    kernel = CPUAdamKernel(betas=(0.9, 0.99), weight_decay=0.01, amsgrad=True, tile_numel=1000)
    assert kernel.state_names() == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    n = 4321
    p = torch.randn(n)
    grads = torch.randn(n)
    states = kernel.init_states(p)
    out = torch.empty(n, dtype=torch.bfloat16)
    tiles = []
    ref_p, ref_states = p.clone(), kernel.init_states(p)
    kernel.step(
        p,
        grads,
        states,
        step=1,
        lr=1e-2,
        low_precision_out=out,
        on_tile_done=lambda s, e: tiles.append((s, e)),
    )
    assert tiles == [(0, 1000), (1000, 2000), (2000, 3000), (3000, 4000), (4000, 4321)]
    cpu_adam_step(
        ref_p,
        grads,
        ref_states["exp_avg"],
        ref_states["exp_avg_sq"],
        step=1,
        lr=1e-2,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.01,
        amsgrad_max=ref_states["max_exp_avg_sq"],
    )
    assert torch.equal(p, ref_p) and torch.equal(out, ref_p.to(torch.bfloat16))
    with pytest.raises(TypeError, match="unknown hyper-parameters"):
        kernel.step(p, grads, states, step=2, lr=1e-2, momentum=0.9)
    with pytest.raises(KeyError, match="max_exp_avg_sq"):
        kernel.step(
            p, grads, {"exp_avg": states["exp_avg"], "exp_avg_sq": states["exp_avg_sq"]}, step=2, lr=1
        )


def test_two_threads_same_result():
    n = 300_001
    base = [torch.randn(n), torch.randn(n), torch.zeros(n), torch.zeros(n)]
    one = [t.clone() for t in base]
    two = [t.clone() for t in base]
    cpu_adam_step(*one, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, threads=1)
    cpu_adam_step(*two, step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0, threads=2)
    assert all(torch.equal(a, b) for a, b in zip(one, two))


def test_input_validation():
    p, g, m, v = torch.randn(10), torch.randn(10), torch.zeros(10), torch.zeros(10)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="grads has 9 elements"):
        cpu_adam_step(p, torch.randn(9), m, v, **kw)
    with pytest.raises(TypeError, match="exp_avg has dtype torch.float64"):
        cpu_adam_step(p, g, m.double(), v, **kw)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_adam_step(torch.randn(10, 2)[:, 0], g, m, v, **kw)
    with pytest.raises(ValueError, match="overlap"):
        cpu_adam_step(p, g, m, m, **kw)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        cpu_adam_step(p, g, m, v, **{**kw, "step": 0})
    with pytest.raises(ValueError, match="beta1=1.0 must be < 1.0"):
        cpu_adam_step(p, g, m, v, **{**kw, "beta1": 1.0})
    with pytest.raises(ValueError, match="lr=-1.0 must be >= 0.0"):
        CPUAdam([torch.nn.Parameter(p)], lr=-1.0)
    with pytest.raises(TypeError, match="dtype torch.float64 is not supported"):
        CPUAdam([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="betas must be a pair"):
        CPUAdam([torch.nn.Parameter(p)], betas=(0.9,))

// Optimizer kernels; compiled once per ISA with -DZERO_OPS_ISA_NS=<name>. See optim_kernels.h.
//
// The loops are plain scalar C++ written so that the compiler vectorises them for the target
// chosen by the build flags: __restrict__ pointers, no branches on data (selects only), and
// -fno-math-errno so sqrt becomes a vector instruction.
//
// [Note: matching torch's rounding]
// Builds use -ffp-contract=off, so the compiler never fuses a multiply-add on its own. Instead
// madd() is an explicit fused multiply-add in the FMA-capable variants (avx2, avx512) exactly
// where torch's vectorised CPU kernels fuse one (lerp_, addcmul_, add_(alpha=)), and a plain
// multiply-then-add in the generic variant (as torch's non-FMA kernels do). With the op order of
// torch.optim's for-loop implementation (comments on each formula), the avx2/avx512 results
// for the optimizer states (m, v, Adagrad's sum) are bit-identical to torch.optim on an
// AVX2/AVX-512 CPU; Adam's parameter update is within a few ulp of the update (see
// [Note: one division per Adam element]), Adagrad's parameter bit-identical. The avx2 and
// avx512 variants agree bit for bit with each other (vector sqrt/div are correctly rounded).
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "half_convert.h"
#include "optim_kernels.h"

#ifndef ZERO_OPS_ISA_NS
#error "compile with -DZERO_OPS_ISA_NS=<generic|avx2|avx512>"
#endif

namespace zero_ops {
namespace ZERO_OPS_ISA_NS {
namespace {

// a * b + c; see [Note: matching torch's rounding].
inline float madd(float a, float b, float c) {
#ifdef ZERO_OPS_USE_FMA
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

template <int D>
inline float load_as_float(const void* base, int64_t i) {
  if constexpr (D == kFloat32) {
    return static_cast<const float*>(base)[i];
  } else if constexpr (D == kBFloat16) {
    return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  } else {
    return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

template <int D>
inline void store_low_precision(void* base, int64_t i, float v) {
  if constexpr (D == kBFloat16) {
    static_cast<uint16_t*>(base)[i] = f32_to_bf16(v);
  } else if constexpr (D == kFloat16) {
    static_cast<uint16_t*>(base)[i] = f32_to_f16(v);
  }
}

// Elements per parallel chunk: large enough that a thread streams memory for a while, small
// enough to split 2 threads evenly on modest sizes.
constexpr int64_t kChunk = int64_t{1} << 16;

// Runs f(begin, end) over [0, n) on `threads` threads (contiguous blocks per thread).
template <typename F>
void parallel_ranges(int64_t n, int threads, F f) {
#ifdef _OPENMP
  if (threads > 1 && n >= 2 * kChunk) {
    const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t c = 0; c < chunks; ++c) {
      f(c * kChunk, std::min(n, (c + 1) * kChunk));
    }
    return;
  }
#else
  (void)threads;
#endif
  f(0, n);
}

// [Note: one division per Adam element]
// torch computes  denom = sqrt(v) / bc2_sqrt + eps;  p += (-step_size * m) / denom,  i.e. two
// divisions and a square root per element. On x86 the divider is a single unpipelined-ish unit
// (a 512-bit divide or sqrt occupies it for ~5-10 cycles), so that form is compute-bound at
// ~0.6 ns/element even in cache, slower than memory streams the 28 bytes. Multiplying numerator
// and denominator by bc2_sqrt gives the same value with one division:
//   p += (-step_size * bc2_sqrt * m) / (sqrt(v) + eps * bc2_sqrt)
// The two scalars are folded once per call (in fp32, as the caller's doubles are rounded), so
// the per-element result differs from torch's by a few ulp of the *update* (not of the
// parameter): ~1e-7 relative of lr-sized steps, far inside the 1e-6 tolerance the tests check.
// Every branch on hyper-parameters is a loop-invariant select (or a template argument for the
// amsgrad store), so gcc/clang vectorise the single loop for every instantiation.
template <int G, int L, bool AMS>
void adam_range(const AdamArgs& a, int64_t begin, int64_t end) {
  float* __restrict__ p = a.param;
  float* __restrict__ m = a.exp_avg;
  float* __restrict__ v = a.exp_avg_sq;
  float* __restrict__ vmax = a.max_exp_avg_sq;
  const void* __restrict__ g = a.grad;
  void* __restrict__ out = a.low_precision_out;
  const float beta2 = static_cast<float>(a.beta2);
  const float one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  const float bc2_sqrt = static_cast<float>(a.bias_correction2_sqrt);
  // See [Note: one division per Adam element].
  const float scaled_eps = static_cast<float>(a.eps) * bc2_sqrt;
  const float scaled_neg_step = static_cast<float>(-a.step_size) * bc2_sqrt;
  // AdamW decay is always applied: multiplying by exactly 1.0f (decay off) changes nothing.
  const float decay = static_cast<float>(a.decoupled_decay);
  const float l2 = static_cast<float>(a.l2_decay);
  const bool use_l2 = a.l2_decay != 0.0;
  // torch's lerp switches formula at weight 0.5; follow it so m matches torch bit for bit.
  const bool lerp_low = std::fabs(1.0 - a.beta1) < 0.5;
  const float lerp_w = static_cast<float>(1.0 - a.beta1);
  const float lerp_w_c = static_cast<float>(a.beta1);
  for (int64_t i = begin; i < end; ++i) {
    const float g_raw = load_as_float<G>(g, i);
    const float p_old = p[i];
    const float grad = use_l2 ? madd(l2, p_old, g_raw) : g_raw;  // Adam: grad.add(param, alpha=wd)
    const float param = p_old * decay;                               // AdamW: param.mul_(1 - lr * wd)
    const float m_old = m[i];
    const float diff = grad - m_old;
    const float mi = lerp_low ? madd(lerp_w, diff, m_old) : madd(-diff, lerp_w_c, grad);  // lerp_
    const float vi = madd(one_minus_beta2 * grad, grad, v[i] * beta2);  // mul_(b2).addcmul_
    float vhat = vi;
    if constexpr (AMS) {
      vhat = std::max(vmax[i], vi);  // torch.maximum(max_exp_avg_sq, exp_avg_sq)
      vmax[i] = vhat;
    }
    const float p_new = param + (scaled_neg_step * mi) / (std::sqrt(vhat) + scaled_eps);
    m[i] = mi;
    v[i] = vi;
    p[i] = p_new;
    if constexpr (L != kNone) store_low_precision<L>(out, i, p_new);
  }
}

template <int G, int L>
void adagrad_range(const AdagradArgs& a, int64_t begin, int64_t end) {
  float* __restrict__ p = a.param;
  float* __restrict__ s = a.sum;
  const void* __restrict__ g = a.grad;
  void* __restrict__ out = a.low_precision_out;
  const float neg_clr = static_cast<float>(-a.clr);
  const float eps = static_cast<float>(a.eps);
  const float wd = static_cast<float>(a.weight_decay);
  const bool use_wd = a.weight_decay != 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const float g_raw = load_as_float<G>(g, i);
    float param = p[i];
    const float grad = use_wd ? madd(wd, param, g_raw) : g_raw;  // grad.add(param, alpha=wd)
    const float si = madd(grad, grad, s[i]);   // addcmul_(grad, grad, value=1)
    const float std_ = std::sqrt(si) + eps;    // sqrt().add_(eps)
    param = param + (neg_clr * grad) / std_;   // addcdiv_(grad, std, value=-clr)
    s[i] = si;
    p[i] = param;
    if constexpr (L != kNone) store_low_precision<L>(out, i, param);
  }
}

template <int G, int L>
void lion_range(const LionArgs& a, int64_t begin, int64_t end) {
  float* __restrict__ p = a.param;
  float* __restrict__ m = a.exp_avg;
  const void* __restrict__ g = a.grad;
  void* __restrict__ out = a.low_precision_out;
  const float lr = static_cast<float>(a.lr);
  const float beta1 = static_cast<float>(a.beta1);
  const float beta2 = static_cast<float>(a.beta2);
  const float one_minus_beta1 = static_cast<float>(1.0 - a.beta1);
  const float one_minus_beta2 = static_cast<float>(1.0 - a.beta2);
  const float decay = static_cast<float>(a.decay);  // 1.0f when off: the multiply is exact
  for (int64_t i = begin; i < end; ++i) {
    const float grad = load_as_float<G>(g, i);
    float param = p[i] * decay;
    const float c = m[i] * beta1 + grad * one_minus_beta1;  // exp_avg * b1 + g * (1 - b1)
    const float sgn = c > 0.0f ? 1.0f : (c < 0.0f ? -1.0f : 0.0f);  // sign(), 0 stays 0
    param = madd(-lr, sgn, param);                          // add_(sign(c), alpha=-lr)
    m[i] = m[i] * beta2 + grad * one_minus_beta2;
    p[i] = param;
    if constexpr (L != kNone) store_low_precision<L>(out, i, param);
  }
}

// Expands a (grad dtype, low-precision-out dtype) pair into the matching instantiation.
template <template <int, int> class K, typename Args>
void dispatch_types(const Args& a) {
  auto run = [&](auto g_tag, auto l_tag) {
    constexpr int G = decltype(g_tag)::value;
    constexpr int L = decltype(l_tag)::value;
    parallel_ranges(a.numel, a.threads, [&](int64_t b, int64_t e) { K<G, L>::run(a, b, e); });
  };
  auto with_out = [&](auto g_tag) {
    switch (a.low_precision_dtype) {
      case kBFloat16: run(g_tag, std::integral_constant<int, kBFloat16>{}); break;
      case kFloat16: run(g_tag, std::integral_constant<int, kFloat16>{}); break;
      default: run(g_tag, std::integral_constant<int, kNone>{}); break;
    }
  };
  switch (a.grad_dtype) {
    case kBFloat16: with_out(std::integral_constant<int, kBFloat16>{}); break;
    case kFloat16: with_out(std::integral_constant<int, kFloat16>{}); break;
    default: with_out(std::integral_constant<int, kFloat32>{}); break;
  }
}

template <int G, int L>
struct AdamK {
  static void run(const AdamArgs& a, int64_t b, int64_t e) {
    if (a.max_exp_avg_sq != nullptr) {
      adam_range<G, L, true>(a, b, e);
    } else {
      adam_range<G, L, false>(a, b, e);
    }
  }
};
template <int G, int L>
struct AdagradK {
  static void run(const AdagradArgs& a, int64_t b, int64_t e) { adagrad_range<G, L>(a, b, e); }
};
template <int G, int L>
struct LionK {
  static void run(const LionArgs& a, int64_t b, int64_t e) { lion_range<G, L>(a, b, e); }
};

}  // namespace

void adam_step(const AdamArgs& a) { dispatch_types<AdamK>(a); }
void adagrad_step(const AdagradArgs& a) { dispatch_types<AdagradK>(a); }
void lion_step(const LionArgs& a) { dispatch_types<LionK>(a); }

bool built_with_openmp() {
#ifdef _OPENMP
  return true;
#else
  return false;
#endif
}

}  // namespace ZERO_OPS_ISA_NS
}  // namespace zero_ops

// Flat-buffer optimizer kernels (Adam/AdamW, Adagrad, Lion) on CPU.
//
// Every kernel updates one contiguous range of parameters in place, in fp32 arithmetic:
//   * the parameter (master copy) and the optimizer states are fp32;
//   * the gradient is fp32, bf16 or fp16 (converted on load);
//   * optionally a bf16/fp16 copy of the updated parameter is written in the same pass
//     (the copy offload sends back to the accelerator), so no second sweep over memory.
//
// The same source (optim_kernels.cpp) is compiled once per instruction set (avx512, avx2,
// generic) into its own namespace; bindings.cpp picks one at run time with
// __builtin_cpu_supports. See [Note: runtime ISA dispatch] in bindings.cpp.
#pragma once

#include <cstdint>

namespace zero_ops {

enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = -1 };

struct AdamArgs {
  float* param;
  const void* grad;
  int grad_dtype;
  float* exp_avg;
  float* exp_avg_sq;
  float* max_exp_avg_sq;  // nullptr unless amsgrad
  void* low_precision_out;  // nullptr or a bf16/fp16 buffer of the same numel
  int low_precision_dtype;
  int64_t numel;
  // Scalars are computed in double by the caller and rounded to fp32 here, as torch does
  // when it applies a Python scalar to an fp32 tensor.
  double beta1;
  double beta2;
  double eps;
  double step_size;          // lr / (1 - beta1^t), or lr without bias correction
  double bias_correction2_sqrt;
  double decoupled_decay;    // AdamW: 1 - lr * weight_decay (1.0 when off)
  double l2_decay;           // Adam:  weight_decay added to the gradient (0.0 when off)
  int threads;
};

struct AdagradArgs {
  float* param;
  const void* grad;
  int grad_dtype;
  float* sum;
  void* low_precision_out;
  int low_precision_dtype;
  int64_t numel;
  double clr;  // lr / (1 + (t - 1) * lr_decay)
  double eps;
  double weight_decay;
  int threads;
};

struct LionArgs {
  float* param;
  const void* grad;
  int grad_dtype;
  float* exp_avg;
  void* low_precision_out;
  int low_precision_dtype;
  int64_t numel;
  double lr;
  double beta1;
  double beta2;
  double decay;  // 1 - lr * weight_decay
  int threads;
};

#define ZERO_OPS_DECLARE_KERNELS(ns)        \
  namespace ns {                            \
  void adam_step(const AdamArgs& a);        \
  void adagrad_step(const AdagradArgs& a);  \
  void lion_step(const LionArgs& a);        \
  bool built_with_openmp();                 \
  }

ZERO_OPS_DECLARE_KERNELS(generic)
#if defined(__x86_64__) || defined(_M_X64)
ZERO_OPS_DECLARE_KERNELS(avx2)
ZERO_OPS_DECLARE_KERNELS(avx512)
#endif

}  // namespace zero_ops

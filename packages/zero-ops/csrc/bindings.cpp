// Python bindings of zero_ops._C: optimizer kernels (raw pointers; the Python layer validates
// tensors) and the async I/O engine.
//
// [Note: runtime ISA dispatch]
// The wheel must run on any x86-64 machine, so nothing is compiled with -march=native.
// Instead optim_kernels.cpp is compiled three times (generic x86-64, AVX2+FMA+F16C,
// AVX-512F/BW/VL/DQ) into the namespaces zero_ops::{generic,avx2,avx512}, and the best one the
// CPU supports is chosen once at import with __builtin_cpu_supports. Other architectures
// (aarch64: NEON is part of the base ISA and auto-vectorised) build only `generic`.
// ZERO_OPS_ISA=<name> (or select_isa()) forces a lower variant, e.g. to test that all variants
// agree (avx2 and avx512 bit for bit; generic within fp32 rounding, see [Note: matching torch's
// rounding] in optim_kernels.cpp).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

#include "aio_engine.h"
#include "optim_kernels.h"

namespace py = pybind11;
using namespace zero_ops;

namespace {

struct KernelSet {
  std::string name;
  void (*adam)(const AdamArgs&);
  void (*adagrad)(const AdagradArgs&);
  void (*lion)(const LionArgs&);
  bool (*openmp)();
};

std::vector<KernelSet> compiled_sets() {
  std::vector<KernelSet> sets;
#if defined(__x86_64__) || defined(_M_X64)
  sets.push_back({"avx512", avx512::adam_step, avx512::adagrad_step, avx512::lion_step,
                  avx512::built_with_openmp});
  sets.push_back({"avx2", avx2::adam_step, avx2::adagrad_step, avx2::lion_step, avx2::built_with_openmp});
#endif
  sets.push_back({"generic", generic::adam_step, generic::adagrad_step, generic::lion_step,
                  generic::built_with_openmp});
  return sets;
}

bool cpu_supports(const std::string& isa) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (isa == "avx512") {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  if (isa == "avx2") {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
  }
#endif
  return isa == "generic";
}

std::string generic_label() {
#if defined(__x86_64__) || defined(_M_X64)
  return "x86-64 baseline (SSE2)";
#elif defined(__aarch64__)
  return "aarch64 (NEON)";
#else
  return "scalar";
#endif
}

KernelSet g_active;
std::string g_reason;

void select(const std::string& wanted) {
  for (const auto& s : compiled_sets()) {
    if (!wanted.empty() && s.name != wanted) continue;
    if (!cpu_supports(s.name)) {
      if (!wanted.empty()) throw std::invalid_argument("this CPU does not support ISA '" + wanted + "'");
      continue;
    }
    g_active = s;
    g_reason = wanted.empty() ? "best variant this CPU supports" : "forced by request";
    return;
  }
  std::string names;
  for (const auto& s : compiled_sets()) names += (names.empty() ? "" : ", ") + s.name;
  throw std::invalid_argument("unknown ISA '" + wanted + "'; compiled variants: " + names);
}

int dtype_code(int code) {
  if (code != kFloat32 && code != kBFloat16 && code != kFloat16 && code != kNone) {
    throw std::invalid_argument("bad dtype code " + std::to_string(code));
  }
  return code;
}

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "zero-ops native kernels (CPU optimizers, async file I/O)";
  const char* env = std::getenv("ZERO_OPS_ISA");
  try {
    select(env != nullptr ? std::string(env) : std::string());
    if (env != nullptr) g_reason = "forced by ZERO_OPS_ISA";
  } catch (const std::invalid_argument&) {
    select("");  // a bad ZERO_OPS_ISA falls back to auto-selection; Python warns about it
    g_reason = std::string("ZERO_OPS_ISA='") + env + "' is not usable here; auto-selected";
  }

  m.def("isa", [] { return g_active.name; });
  m.def("isa_reason", [] { return g_reason; });
  m.def("generic_label", &generic_label);
  m.def("select_isa", [](const std::string& name) { select(name); }, py::arg("name"));
  m.def("compiled_isas", [] {
    std::vector<std::string> out;
    for (const auto& s : compiled_sets()) out.push_back(s.name);
    return out;
  });
  m.def("cpu_supports", &cpu_supports, py::arg("isa"));
  m.def("built_with_openmp", [] { return g_active.openmp(); });

  m.def(
      "adam_step",
      [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg, uintptr_t exp_avg_sq,
         uintptr_t max_exp_avg_sq, uintptr_t lp_out, int lp_dtype, int64_t numel, double beta1,
         double beta2, double eps, double step_size, double bc2_sqrt, double decoupled_decay,
         double l2_decay, int threads) {
        AdamArgs a{ptr<float>(param), ptr<const void>(grad), dtype_code(grad_dtype), ptr<float>(exp_avg),
                   ptr<float>(exp_avg_sq), ptr<float>(max_exp_avg_sq), ptr<void>(lp_out),
                   dtype_code(lp_dtype), numel, beta1, beta2, eps, step_size, bc2_sqrt,
                   decoupled_decay, l2_decay, threads};
        py::gil_scoped_release release;
        g_active.adam(a);
      });
  m.def("adagrad_step", [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t sum,
                           uintptr_t lp_out, int lp_dtype, int64_t numel, double clr, double eps,
                           double weight_decay, int threads) {
    AdagradArgs a{ptr<float>(param), ptr<const void>(grad), dtype_code(grad_dtype), ptr<float>(sum),
                  ptr<void>(lp_out), dtype_code(lp_dtype), numel, clr, eps, weight_decay, threads};
    py::gil_scoped_release release;
    g_active.adagrad(a);
  });
  m.def("lion_step", [](uintptr_t param, uintptr_t grad, int grad_dtype, uintptr_t exp_avg,
                        uintptr_t lp_out, int lp_dtype, int64_t numel, double lr, double beta1,
                        double beta2, double decay, int threads) {
    LionArgs a{ptr<float>(param), ptr<const void>(grad), dtype_code(grad_dtype), ptr<float>(exp_avg),
               ptr<void>(lp_out), dtype_code(lp_dtype), numel, lr, beta1, beta2, decay, threads};
    py::gil_scoped_release release;
    g_active.lion(a);
  });

  // I/O errors become OSError(errno, message, path), so ENOENT is FileNotFoundError, etc.
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      py::object err = py::module_::import("builtins").attr("OSError")(e.err(), e.what(), e.path());
      PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(err.ptr())), err.ptr());
    }
  });

  py::class_<AioEngine>(m, "AioEngine")
      .def(py::init<int64_t, int, bool, bool, int, bool, const std::string&>(), py::arg("block_size"),
           py::arg("queue_depth"), py::arg("single_submit"), py::arg("overlap_events"),
           py::arg("thread_count"), py::arg("use_direct"), py::arg("engine") = "auto")
      .def("backend", &AioEngine::backend)
      .def("submit", &AioEngine::submit, py::arg("is_write"), py::arg("path"), py::arg("buffer"),
           py::arg("nbytes"), py::arg("offset"))
      .def("wait", &AioEngine::wait, py::call_guard<py::gil_scoped_release>())
      .def("pending", &AioEngine::pending)
      .def("direct_bytes", &AioEngine::direct_bytes)
      .def("buffered_bytes", &AioEngine::buffered_bytes);
  m.attr("DIRECT_ALIGNMENT") = kDirectAlignment;
  m.def("libaio_compiled", &LibaioQueue::compiled);
  m.def("libaio_probe", &LibaioQueue::probe, "'' when kernel AIO works here, else why not");
}

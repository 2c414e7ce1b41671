// The fused lm_head's CUDA GEMM and graph-capture test (compiled only into CUDA builds; host code).
#ifdef RL_LOSSES_WITH_CUDA

#include <ATen/ops/addmm.h>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <algorithm>
#include <string>

#include "linear/linear_source.h"

namespace rl_losses {
namespace {

// cuBLAS functions from the library torch has already loaded (libtorch_cuda links it), looked up at run time
// rather than linked: the extension then builds without a cuBLAS link library (pip's CUDA wheels ship only the
// versioned .so) and uses the very cuBLAS torch uses. ATen's own mixed-precision GEMM entry points are C++
// templates whose exported symbols differ between torch versions.
template <typename Fn>
Fn cublas_function(const char* name) {
  static void* const lib = [] {
    const std::string file = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* l = dlopen(file.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    return l ? l : dlopen(file.c_str(), RTLD_LAZY);
  }();
  Fn fn = lib ? reinterpret_cast<Fn>(dlsym(lib, name)) : nullptr;
  TORCH_CHECK(fn, "rl_losses: ", name, " not found in libcublas.so.", CUBLAS_VER_MAJOR,
              " (the cuBLAS this extension was built against)");
  return fn;
}

using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                  const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                  cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);
using GetMathMode = cublasStatus_t (*)(cublasHandle_t, cublasMath_t*);
using SetMathMode = cublasStatus_t (*)(cublasHandle_t, cublasMath_t);

cudaDataType cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    default: TORCH_INTERNAL_ASSERT(false, "linear ops: no cuBLAS GEMM for ", t);
  }
}

// A row-major (r, c) operand as cuBLAS (column-major) sees it: its storage is the (c, r) matrix t^T with leading
// dimension stride(0) (op N), or, for a transposed view (unit row stride), t itself with leading dimension
// stride(1) (op T). A dimension of size 1 leaves its stride free.
struct Operand {
  const void* data;
  cublasOperation_t op;
  int ld;
};
Operand operand(const at::Tensor& t) {
  const int64_t r = t.size(0), c = t.size(1);
  if (t.stride(1) == 1 || c == 1) return {t.const_data_ptr(), CUBLAS_OP_N, static_cast<int>(r == 1 ? c : t.stride(0))};
  TORCH_INTERNAL_ASSERT(t.stride(0) == 1 || r == 1, "linear ops: a GEMM operand that is neither row- nor column-major");
  return {t.const_data_ptr(), CUBLAS_OP_T, static_cast<int>(c == 1 ? r : t.stride(1))};
}

// out (m, n) (+)= a (m, k) @ b (k, n) in fp32 (out fp32 or the inputs' 16-bit dtype): as column-major,
// out^T = b^T a^T. CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION keeps a split-K GEMM's partial sums in
// fp32 where out is bf16/fp16 (ATen's own bf16 GEMMs allow 16-bit reductions by default).
void gemm_16bit(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  static const auto gemm_ex = cublas_function<GemmEx>("cublasGemmEx");
  static const auto get_mode = cublas_function<GetMathMode>("cublasGetMathMode");
  static const auto set_mode = cublas_function<SetMathMode>("cublasSetMathMode");
  const at::Tensor a2 = a.stride(0) == 1 || a.stride(1) == 1 ? a : a.contiguous();
  const at::Tensor b2 = b.stride(0) == 1 || b.stride(1) == 1 ? b : b.contiguous();
  const Operand x = operand(a2), y = operand(b2);
  const int64_t m = out.size(0), n = out.size(1), k = a.size(1);
  TORCH_INTERNAL_ASSERT(out.stride(1) == 1 || n == 1);
  const float one = 1.0f, beta = accumulate ? 1.0f : 0.0f;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  cublasMath_t mode;
  TORCH_CHECK(get_mode(handle, &mode) == CUBLAS_STATUS_SUCCESS, "linear ops: cublasGetMathMode failed");
  set_mode(handle, static_cast<cublasMath_t>(mode | CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  const cublasStatus_t status =
      gemm_ex(handle, y.op, x.op, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &one, y.data,
              cuda_type(b.scalar_type()), y.ld, x.data, cuda_type(a.scalar_type()), x.ld, &beta, out.data_ptr(),
              cuda_type(out.scalar_type()), static_cast<int>(m == 1 ? n : out.stride(0)), CUBLAS_COMPUTE_32F,
              CUBLAS_GEMM_DEFAULT);
  set_mode(handle, mode);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "linear ops: cublasGemmEx failed with status ", static_cast<int>(status),
              " (", m, " x ", n, " from ", k, ")");
}

// fp32 and fp64 inputs take ATen's GEMM (and its TF32 setting); bf16/fp16 inputs cublasGemmEx, whose output may be
// fp32 (ATen's addmm needs the output in the inputs' dtype).
void gemm_cuda(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b, bool accumulate) {
  if (out.numel() == 0) return;
  if (a.size(1) == 0) {  // an empty sum
    if (!accumulate) out.zero_();
    return;
  }
  if (a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble) {
    TORCH_INTERNAL_ASSERT(out.scalar_type() == a.scalar_type());
    at::Tensor o = out;
    at::addmm_out(o, o, a, b, /*beta=*/accumulate ? 1 : 0);
    return;
  }
  gemm_16bit(out, a, b, accumulate);
}

bool capturing(const at::Tensor& t) {
  return t.is_cuda() && c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
}

}  // namespace

const LinearBackend& linear_backend_cuda() {
  static constexpr LinearBackend backend{&gemm_cuda, &capturing};
  return backend;
}

}  // namespace rl_losses

#endif  // RL_LOSSES_WITH_CUDA

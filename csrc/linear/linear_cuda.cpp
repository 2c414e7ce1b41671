// CUDA weight-gradient GEMM of the fused lm_head (compiled only into CUDA builds; host code).
#ifdef RL_LOSSES_WITH_CUDA

#include <ATen/cuda/CUDAContext.h>
#include <cublas_v2.h>
#include <dlfcn.h>

#include <string>

#include "linear/linear_source.h"

namespace rl_losses {
namespace {

// cublasGemmEx from the cuBLAS library torch has already loaded (libtorch_cuda links it). Looked up at
// run time rather than linked: the extension then builds without a cuBLAS link library (pip's CUDA wheels
// ship only the versioned .so) and uses the very cuBLAS torch uses. ATen's own mixed-precision GEMM entry
// points are C++ templates whose exported symbols differ between torch versions.
using GemmEx = cublasStatus_t (*)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                                  const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                                  cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t);

GemmEx cublas_gemm_ex() {
  static const GemmEx fn = []() -> GemmEx {
    const std::string name = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
    void* lib = dlopen(name.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) lib = dlopen(name.c_str(), RTLD_LAZY);
    return lib ? reinterpret_cast<GemmEx>(dlsym(lib, "cublasGemmEx")) : nullptr;
  }();
  TORCH_CHECK(fn, "rl_losses: cublasGemmEx not found in libcublas.so.", CUBLAS_VER_MAJOR,
              " (the cuBLAS this extension was built against)");
  return fn;
}

}  // namespace

// acc (V, H) fp32 (+)= grad_chunk.T @ hidden_chunk with bf16/fp16 inputs: one cuBLAS GEMM reading the inputs
// in their own dtype and accumulating into the fp32 output (beta = 1). ATen's addmm cannot do this: its
// output and addend must have the inputs' dtype, which would force a bf16 accumulator or fp32 input copies.
void accumulate_weight_grad_cuda(const at::Tensor& acc, const at::Tensor& grad_chunk, const at::Tensor& hidden_chunk,
                                 bool overwrite) {
  if (grad_chunk.scalar_type() == acc.scalar_type()) {
    acc.addmm_(grad_chunk.t(), hidden_chunk, /*beta=*/overwrite ? 0 : 1);
    return;
  }
  TORCH_INTERNAL_ASSERT(acc.scalar_type() == at::kFloat && acc.is_contiguous() && grad_chunk.is_contiguous() &&
                        hidden_chunk.is_contiguous());
  const int64_t rows = grad_chunk.size(0), vocab = grad_chunk.size(1), hidden = hidden_chunk.size(1);
  const cudaDataType in_type = grad_chunk.scalar_type() == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_16F;
  TORCH_INTERNAL_ASSERT(grad_chunk.scalar_type() == at::kBFloat16 || grad_chunk.scalar_type() == at::kHalf);
  const float one = 1.0f, beta = overwrite ? 0.0f : 1.0f;
  // cuBLAS is column-major: the row-major acc (V, H) is acc^T (H, V) = hidden^T (H, rows) @ grad (rows, V),
  // where hidden^T is hidden as stored (lda = H) and grad is the transpose of its storage (ldb = V).
  const cublasStatus_t status = cublas_gemm_ex()(
      at::cuda::getCurrentCUDABlasHandle(), CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(hidden), static_cast<int>(vocab),
      static_cast<int>(rows), &one, hidden_chunk.const_data_ptr(), in_type, static_cast<int>(hidden),
      grad_chunk.const_data_ptr(), in_type, static_cast<int>(vocab), &beta, acc.data_ptr(), CUDA_R_32F,
      static_cast<int>(hidden), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, "linear ops: cublasGemmEx failed with status ", static_cast<int>(status),
              " (weight gradient, ", vocab, " x ", hidden, " from ", rows, " rows)");
}

}  // namespace rl_losses

#endif  // RL_LOSSES_WITH_CUDA

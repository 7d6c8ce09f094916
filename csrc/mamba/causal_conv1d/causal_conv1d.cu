// Entry points of the CUDA causal-conv1d pathway: dtype dispatch.
#include "causal_conv1d.h"
#include "causal_conv1d_launch.cuh"

namespace vllm_conv {

cudaError_t causal_conv1d_fwd_launch(const FwdParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.dim == 0) return cudaSuccess;
  switch (p.dtype) {
    case ScalarType::kFloat32: return launch_fwd_dtype<float>(p, stream);
    case ScalarType::kFloat16: return launch_fwd_dtype<__half>(p, stream);
    case ScalarType::kBFloat16: return launch_fwd_dtype<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

cudaError_t causal_conv1d_update_launch(const UpdateParams& p, cudaStream_t stream) {
  if (p.batch == 0 || p.dim == 0) return cudaSuccess;
  switch (p.dtype) {
    case ScalarType::kFloat32: return launch_update_dtype<float>(p, stream);
    case ScalarType::kFloat16: return launch_update_dtype<__half>(p, stream);
    case ScalarType::kBFloat16: return launch_update_dtype<__nv_bfloat16>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace vllm_conv

// The forward kernels for __nv_bfloat16 (see causal_conv1d_launch.cuh).
#include "causal_conv1d_launch.cuh"

namespace vllm_conv {

template cudaError_t launch_fwd_dtype<__nv_bfloat16>(const FwdParams&, cudaStream_t);

}  // namespace vllm_conv

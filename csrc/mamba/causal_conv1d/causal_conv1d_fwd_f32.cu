// The forward kernels for float (see causal_conv1d_launch.cuh).
#include "causal_conv1d_launch.cuh"

namespace vllm_conv {

template cudaError_t launch_fwd_dtype<float>(const FwdParams&, cudaStream_t);

}  // namespace vllm_conv

// Host-side launch of the kernels for one dtype. The forward is instantiated once
// per dtype, each in its own translation unit (causal_conv1d_fwd_<dtype>.cu), so
// that the build compiles them in parallel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "causal_conv1d.h"
#include "causal_conv1d_kernels.cuh"

namespace vllm_conv {

// SMs of the current device, queried once per device.
inline int num_sms() {
  constexpr int kMaxDevices = 64;
  static int cache[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices && cache[dev] > 0) return cache[dev];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) return 0;
  if (dev < kMaxDevices) cache[dev] = n;
  return n;
}

template <typename T, int W, int kBytes>
cudaError_t launch_fwd_kernel(const FwdParams& p, const VecFlags& vf, cudaStream_t stream) {
  constexpr int V = Layout<T, kBytes>::kPerRow;
  const dim3 grid(static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(ceil_div(p.dim, int64_t{kFwdThreads} * V)));
  if (p.silu) {
    causal_conv1d_fwd_kernel<T, W, kBytes, true><<<grid, kFwdThreads, 0, stream>>>(p, vf);
  } else {
    causal_conv1d_fwd_kernel<T, W, kBytes, false><<<grid, kFwdThreads, 0, stream>>>(p, vf);
  }
  return cudaGetLastError();
}

template <typename T, int W>
cudaError_t launch_fwd_fallback(const FwdParams& p, const VecFlags& vf, cudaStream_t stream) {
  constexpr int V = Layout<T, 4>::kPerRow;
  const dim3 grid(static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(ceil_div(p.dim, int64_t{kFwdThreads} * V)));
  if (p.silu) {
    causal_conv1d_fwd_fallback_kernel<T, W, true><<<grid, kFwdThreads, 0, stream>>>(p, vf);
  } else {
    causal_conv1d_fwd_fallback_kernel<T, W, false><<<grid, kFwdThreads, 0, stream>>>(p, vf);
  }
  return cudaGetLastError();
}

template <typename T, int W>
cudaError_t launch_fwd_width(const FwdParams& p, cudaStream_t stream) {
  const FwdVariant fv = choose_fwd_variant<T, W>(p, num_sms());
  if (!fv.vf.x) return launch_fwd_fallback<T, W>(p, fv.vf, stream);
  if (fv.row_bytes == 16) return launch_fwd_kernel<T, W, 16>(p, fv.vf, stream);
  if (fv.row_bytes == 8) return launch_fwd_kernel<T, W, 8>(p, fv.vf, stream);
  return launch_fwd_kernel<T, W, 4>(p, fv.vf, stream);
}

template <typename T>
cudaError_t launch_fwd_dtype(const FwdParams& p, cudaStream_t stream) {
  switch (p.width) {
    case 2: return launch_fwd_width<T, 2>(p, stream);
    case 3: return launch_fwd_width<T, 3>(p, stream);
    case 4: return launch_fwd_width<T, 4>(p, stream);
    case 5: return launch_fwd_width<T, 5>(p, stream);
    case 6: return launch_fwd_width<T, 6>(p, stream);
    case 7: return launch_fwd_width<T, 7>(p, stream);
    case 8: return launch_fwd_width<T, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

extern template cudaError_t launch_fwd_dtype<float>(const FwdParams&, cudaStream_t);
extern template cudaError_t launch_fwd_dtype<__half>(const FwdParams&, cudaStream_t);
extern template cudaError_t launch_fwd_dtype<__nv_bfloat16>(const FwdParams&, cudaStream_t);

template <typename T, int W>
cudaError_t launch_update_width(const UpdateParams& p, cudaStream_t stream) {
  constexpr int V = Layout<T, 16>::kPerRow;
  const VecFlags vf =
      vec_flags<T, W, 16>(p.dim, p.x, p.stride_x_b, p.out, p.stride_out_b, p.weight, p.stride_w_d,
                          p.bias, p.states, p.stride_state_line, p.stride_state_d);
  const dim3 grid(static_cast<unsigned>(p.batch),
                  static_cast<unsigned>(ceil_div(p.dim, int64_t{kUpdateThreads} * V)));
  causal_conv1d_update_kernel<T, W><<<grid, kUpdateThreads, 0, stream>>>(p, vf);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_update_dtype(const UpdateParams& p, cudaStream_t stream) {
  switch (p.width) {
    case 2: return launch_update_width<T, 2>(p, stream);
    case 3: return launch_update_width<T, 3>(p, stream);
    case 4: return launch_update_width<T, 4>(p, stream);
    case 5: return launch_update_width<T, 5>(p, stream);
    case 6: return launch_update_width<T, 6>(p, stream);
    case 7: return launch_update_width<T, 7>(p, stream);
    case 8: return launch_update_width<T, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace vllm_conv

// The CUDA causal-conv1d pathway: parameters and launchers, free of torch headers.
//
// Per feature d of a sequence, with kernel width W (2..8):
//
//     y[t, d] = act(bias[d] + sum_{k<W} w[d, k] * xx[t - (W-1) + k, d])
//
// where xx is the sequence's tokens preceded by W-1 columns of history: its
// cache line when it has an initial state, zeros otherwise. act is SiLU or
// identity; products and sums are fp32 with one cast at the store.
//
// Layouts (element strides; the axis named last has stride 1):
//   x, out (forward):  (num_tokens, dim) rows, i.e. the ops' (dim, num_tokens)
//                      views with stride(0) == 1; the token stride may exceed dim.
//   x, out (update):   (batch, dim) rows, one token per sequence.
//   weight:            (dim, W), stride_w_d between features.
//   bias:              (dim,), contiguous, or null.
//   states:            (num_cache_lines, dim, state_len >= W-1), WIDTH-contiguous:
//                      column j of feature d of line l at l*stride_line + d*stride_d + j.
// x, weight, bias and states share one dtype (fp32, fp16 or bf16).
//
// Padded rows (cache index == pad_slot_id) get zero outputs; their lines and every
// line no sequence names are left untouched. Only columns 0..W-2 of a line are
// read or written.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vllm_conv {

enum class ScalarType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

constexpr int kMinWidth = 2;
constexpr int kMaxWidth = 8;

struct FwdParams {
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;  // null: no bias
  void* states = nullptr;
  void* out = nullptr;
  const int32_t* query_start_loc = nullptr;   // (batch + 1,)
  const int32_t* cache_indices = nullptr;     // (batch,) or null: sequence b uses line b
  const bool* has_initial_state = nullptr;    // (batch,) or null: no sequence has one
  int64_t batch = 0;
  int64_t dim = 0;
  int width = 0;
  int64_t stride_x_t = 0;
  int64_t stride_out_t = 0;
  int64_t stride_w_d = 0;
  int64_t stride_state_line = 0;
  int64_t stride_state_d = 0;
  int64_t pad_slot_id = -1;
  bool silu = false;
  ScalarType dtype = ScalarType::kFloat32;
  // Bytes of a token a thread moves per access: 16, 8 or 4 force it (falling back to
  // narrower rows when x/out rows are not aligned to it), 0 lets the launcher choose.
  int row_bytes = 0;
};

struct UpdateParams {
  const void* x = nullptr;
  const void* weight = nullptr;
  const void* bias = nullptr;
  void* states = nullptr;
  void* out = nullptr;
  const int32_t* state_indices = nullptr;  // (batch,) or null: sequence b uses line b
  int64_t batch = 0;
  int64_t dim = 0;
  int width = 0;
  int64_t stride_x_b = 0;
  int64_t stride_out_b = 0;
  int64_t stride_w_d = 0;
  int64_t stride_state_line = 0;
  int64_t stride_state_d = 0;
  int64_t pad_slot_id = -1;
  bool silu = false;
  ScalarType dtype = ScalarType::kFloat32;
};

// Enqueue the kernel on `stream`; returns the launch status. Nothing is launched
// when there is no sequence or no feature.
cudaError_t causal_conv1d_fwd_launch(const FwdParams& params, cudaStream_t stream);
cudaError_t causal_conv1d_update_launch(const UpdateParams& params, cudaStream_t stream);

}  // namespace vllm_conv

// torch ops of the CUDA causal-conv1d pathway: namespace _C_conv, CUDA dispatch key.
//
// Both ops write into a caller-allocated `out` and return nothing, so that one
// output buffer can take the prefill and the decode halves of a step, and so that
// they can be captured in a CUDA graph (no allocation, no host sync). The Python
// face (vllm/_custom_ops.py) validates arguments with messages naming them; the
// checks here are the last line of defence against memory errors.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <optional>

#include "causal_conv1d.h"

namespace {

using vllm_conv::ScalarType;

ScalarType scalar_type_of(const at::Tensor& t) {
  const at::ScalarType st = t.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
              "_C_conv: x must be float32, float16 or bfloat16, got ", st);
  return st == at::kFloat ? ScalarType::kFloat32
         : st == at::kHalf ? ScalarType::kFloat16
                           : ScalarType::kBFloat16;
}

void check_same(const at::Tensor& x, const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == x.device(), "_C_conv: ", name, " is on ", t.device(),
              ", x on ", x.device());
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "_C_conv: ", name, " must have x's dtype ",
              x.scalar_type(), ", got ", t.scalar_type());
}

void check_index(const at::Tensor& x, const at::Tensor& t, const char* name, int64_t n,
                 at::ScalarType dtype) {
  TORCH_CHECK(t.device() == x.device(), "_C_conv: ", name, " is on ", t.device(),
              ", x on ", x.device());
  TORCH_CHECK(t.scalar_type() == dtype, "_C_conv: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n && (n <= 1 || t.stride(0) == 1), "_C_conv: ",
              name, " must be a contiguous (", n, ",) tensor, got ", t.sizes());
}

// Checks shared by both ops; returns the width.
int check_weights_and_states(const at::Tensor& x, int64_t dim, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, const at::Tensor& states) {
  TORCH_CHECK(x.is_cuda(), "_C_conv: x must be a CUDA tensor");
  check_same(x, weight, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim, "_C_conv: weight must be (dim=", dim,
              ", width), got ", weight.sizes());
  const int64_t width = weight.size(1);
  TORCH_CHECK(width >= vllm_conv::kMinWidth && width <= vllm_conv::kMaxWidth,
              "_C_conv: width must be in [2, 8], got ", width);
  TORCH_CHECK(weight.stride(1) == 1, "_C_conv: weight must have stride(1) == 1");
  if (bias.has_value()) {
    check_same(x, *bias, "bias");
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == dim && (dim <= 1 || bias->stride(0) == 1),
                "_C_conv: bias must be a contiguous (dim=", dim, ",) tensor, got ", bias->sizes());
  }
  check_same(x, states, "conv_states");
  TORCH_CHECK(states.dim() == 3 && states.size(1) == dim && states.size(2) >= width - 1,
              "_C_conv: conv_states must be (num_cache_lines, dim=", dim, ", >= width-1), got ",
              states.sizes());
  TORCH_CHECK(states.size(2) == 1 || states.stride(2) == 1,
              "_C_conv: conv_states must be width-contiguous (stride(2) == 1), got strides ",
              states.strides());
  // Feature blocks are the grid's y dimension (at most 65535 of >= 128 features).
  TORCH_CHECK(dim <= int64_t{65535} * 128, "_C_conv: dim too large: ", dim);
  return static_cast<int>(width);
}

void causal_conv1d_fwd(const at::Tensor& x, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, at::Tensor& conv_states,
                       const at::Tensor& query_start_loc,
                       const std::optional<at::Tensor>& cache_indices,
                       const std::optional<at::Tensor>& has_initial_state, bool silu,
                       int64_t pad_slot_id, int64_t row_bytes, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "_C_conv: x must be (dim, num_tokens), got ", x.sizes());
  const int64_t dim = x.size(0);
  const int64_t num_tokens = x.size(1);
  TORCH_CHECK(dim <= 1 || x.stride(0) == 1, "_C_conv: x must have stride(0) == 1");
  const int width = check_weights_and_states(x, dim, weight, bias, conv_states);
  check_same(x, out, "out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == dim && out.size(1) == num_tokens &&
                  (dim <= 1 || out.stride(0) == 1),
              "_C_conv: out must be (dim, num_tokens) with stride(0) == 1, like x");
  TORCH_CHECK(query_start_loc.dim() == 1 && query_start_loc.size(0) >= 1,
              "_C_conv: query_start_loc must be (batch + 1,)");
  const int64_t batch = query_start_loc.size(0) - 1;
  TORCH_CHECK(batch < (int64_t{1} << 31), "_C_conv: batch too large: ", batch);
  check_index(x, query_start_loc, "query_start_loc", batch + 1, at::kInt);
  if (cache_indices.has_value()) {
    check_index(x, *cache_indices, "cache_indices", batch, at::kInt);
  } else {
    TORCH_CHECK(batch <= conv_states.size(0), "_C_conv: cache_indices is None but batch ", batch,
                " > num_cache_lines ", conv_states.size(0));
  }
  if (has_initial_state.has_value()) {
    check_index(x, *has_initial_state, "has_initial_state", batch, at::kBool);
  }
  TORCH_CHECK(row_bytes == 0 || row_bytes == 4 || row_bytes == 8 || row_bytes == 16,
              "_C_conv: row_bytes must be 0 (choose), 4, 8 or 16, got ", row_bytes);

  vllm_conv::FwdParams p;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.states = conv_states.data_ptr();
  p.out = out.data_ptr();
  p.query_start_loc = query_start_loc.data_ptr<int32_t>();
  p.cache_indices = cache_indices.has_value() ? cache_indices->data_ptr<int32_t>() : nullptr;
  p.has_initial_state =
      has_initial_state.has_value() ? has_initial_state->data_ptr<bool>() : nullptr;
  p.batch = batch;
  p.dim = dim;
  p.width = width;
  p.stride_x_t = x.stride(1);
  p.stride_out_t = out.stride(1);
  p.stride_w_d = weight.stride(0);
  p.stride_state_line = conv_states.stride(0);
  p.stride_state_d = conv_states.stride(1);
  p.pad_slot_id = pad_slot_id;
  p.silu = silu;
  p.dtype = scalar_type_of(x);
  p.row_bytes = static_cast<int>(row_bytes);

  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(vllm_conv::causal_conv1d_fwd_launch(p, c10::cuda::getCurrentCUDAStream()));
}

void causal_conv1d_update(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                          const std::optional<at::Tensor>& bias, bool silu,
                          const std::optional<at::Tensor>& conv_state_indices,
                          int64_t pad_slot_id, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2, "_C_conv: x must be (batch, dim), got ", x.sizes());
  const int64_t batch = x.size(0);
  const int64_t dim = x.size(1);
  TORCH_CHECK(dim <= 1 || x.stride(1) == 1, "_C_conv: x must have stride(1) == 1");
  TORCH_CHECK(batch < (int64_t{1} << 31), "_C_conv: batch too large: ", batch);
  const int width = check_weights_and_states(x, dim, weight, bias, conv_state);
  check_same(x, out, "out");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == batch && out.size(1) == dim &&
                  (dim <= 1 || out.stride(1) == 1),
              "_C_conv: out must be (batch, dim) with stride(1) == 1, like x");
  if (conv_state_indices.has_value()) {
    check_index(x, *conv_state_indices, "conv_state_indices", batch, at::kInt);
  } else {
    TORCH_CHECK(batch <= conv_state.size(0), "_C_conv: conv_state_indices is None but batch ",
                batch, " > num_cache_lines ", conv_state.size(0));
  }

  vllm_conv::UpdateParams p;
  p.x = x.data_ptr();
  p.weight = weight.data_ptr();
  p.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  p.states = conv_state.data_ptr();
  p.out = out.data_ptr();
  p.state_indices =
      conv_state_indices.has_value() ? conv_state_indices->data_ptr<int32_t>() : nullptr;
  p.batch = batch;
  p.dim = dim;
  p.width = width;
  p.stride_x_b = x.stride(0);
  p.stride_out_b = out.stride(0);
  p.stride_w_d = weight.stride(0);
  p.stride_state_line = conv_state.stride(0);
  p.stride_state_d = conv_state.stride(1);
  p.pad_slot_id = pad_slot_id;
  p.silu = silu;
  p.dtype = scalar_type_of(x);

  const c10::cuda::CUDAGuard guard(x.device());
  C10_CUDA_CHECK(vllm_conv::causal_conv1d_update_launch(p, c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

TORCH_LIBRARY(_C_conv, m) {
  m.def(
      "causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, "
      "Tensor query_start_loc, Tensor? cache_indices, Tensor? has_initial_state, bool silu, "
      "int pad_slot_id, int row_bytes, Tensor(b!) out) -> ()");
  m.def(
      "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
      "bool silu, Tensor? conv_state_indices, int pad_slot_id, Tensor(b!) out) -> ()");
}

TORCH_LIBRARY_IMPL(_C_conv, CUDA, m) {
  m.impl("causal_conv1d_fwd", &causal_conv1d_fwd);
  m.impl("causal_conv1d_update", &causal_conv1d_update);
}

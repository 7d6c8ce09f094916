// Device code of the CUDA causal-conv1d pathway (see causal_conv1d.h for the contract).
//
// Each thread owns V consecutive features and moves them as one "row" of kBytes
// per token: kBytes = 16 (V = 16 / sizeof(T), one 16-byte access, a warp reads 512
// contiguous bytes of a token) or kBytes = 4 (V = 4 / sizeof(T), a warp reads 128
// contiguous bytes, and 4x more threads cover the same features). The forward
// kernel's blocks are (sequence, feature block), so a step of few sequences has few
// blocks; narrow rows give it 4x more blocks, and more token rows in flight per
// sequence. The launcher picks per call (causal_conv1d_launch.cuh); the update
// kernel always uses 16-byte rows.
//
// Values travel as raw 32-bit words and are widened to fp32 only where they are
// multiplied; states are moved as values widened from and rounded back to T, which
// is exact, so a state is bit-identical to its input.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "causal_conv1d.h"

namespace vllm_conv {

constexpr int kFwdThreads = 128;
constexpr int kUpdateThreads = 64;

// Which accesses may use whole-row vectors; decided on the host from pointers and strides.
struct VecFlags {
  bool x = false;       // x and out rows (the update kernel; the forward templates on it)
  bool weight = false;  // weight rows packed (stride W) and aligned
  bool bias = false;
  bool state = false;   // lines packed (stride_d == W-1) and aligned
};

inline bool aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A thread's V features are whole rows of kBytes when dim % V == 0 and the rows
// (token rows of x/out, feature rows of weight, lines of the pool) start on kBytes.
template <typename T, int W, int kBytes>
VecFlags vec_flags(int64_t dim, const void* x, int64_t stride_x, const void* out,
                   int64_t stride_out, const void* weight, int64_t stride_w_d, const void* bias,
                   const void* states, int64_t stride_state_line, int64_t stride_state_d) {
  constexpr int64_t es = sizeof(T);
  const bool whole = dim % (kBytes / es) == 0;
  VecFlags vf;
  vf.x = whole && aligned(x, kBytes) && aligned(out, kBytes) && (stride_x * es) % kBytes == 0 &&
         (stride_out * es) % kBytes == 0;
  vf.weight = whole && aligned(weight, kBytes) && stride_w_d == W;
  vf.bias = whole && aligned(bias, kBytes);
  vf.state = whole && aligned(states, kBytes) && stride_state_d == W - 1 &&
             (stride_state_line * es) % kBytes == 0;
  return vf;
}

// The forward's row width and vector flags. 16-byte rows when the grid of
// (sequence, 16-byte feature block) has a block for every SM and the rows are
// aligned; otherwise 4-byte rows, whose grid is 4x larger. params.row_bytes forces
// it (8-byte rows only when asked for; 16 and 8 fall back to 4 when not aligned).
struct FwdVariant {
  int row_bytes;
  VecFlags vf;
};

template <typename T, int W>
FwdVariant choose_fwd_variant(const FwdParams& p, int num_sms) {
  const VecFlags v16 = vec_flags<T, W, 16>(p.dim, p.x, p.stride_x_t, p.out, p.stride_out_t,
                                           p.weight, p.stride_w_d, p.bias, p.states,
                                           p.stride_state_line, p.stride_state_d);
  const int64_t blocks16 = p.batch * ceil_div(p.dim, int64_t{kFwdThreads} * (16 / sizeof(T)));
  const bool want16 = p.row_bytes == 16 || (p.row_bytes == 0 && blocks16 >= num_sms);
  if (want16 && v16.x) return {16, v16};
  if (p.row_bytes == 8) {
    const VecFlags v8 = vec_flags<T, W, 8>(p.dim, p.x, p.stride_x_t, p.out, p.stride_out_t,
                                           p.weight, p.stride_w_d, p.bias, p.states,
                                           p.stride_state_line, p.stride_state_d);
    if (v8.x) return {8, v8};
  }
  return {4, vec_flags<T, W, 4>(p.dim, p.x, p.stride_x_t, p.out, p.stride_out_t, p.weight,
                                p.stride_w_d, p.bias, p.states, p.stride_state_line,
                                p.stride_state_d)};
}

template <typename T>
struct Cvt;

template <>
struct Cvt<float> {
  using Bits = uint32_t;
  __device__ __forceinline__ static float to_float(uint32_t b) { return __uint_as_float(b); }
  __device__ __forceinline__ static uint32_t to_bits(float f) { return __float_as_uint(f); }
};

template <>
struct Cvt<__half> {
  using Bits = uint16_t;
  __device__ __forceinline__ static float to_float(uint32_t b) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(b & 0xffffu)));
  }
  __device__ __forceinline__ static uint32_t to_bits(float f) {
    return __half_as_ushort(__float2half_rn(f));
  }
};

template <>
struct Cvt<__nv_bfloat16> {
  using Bits = uint16_t;
  // bf16 is the top half of an fp32: widening is a shift.
  __device__ __forceinline__ static float to_float(uint32_t b) { return __uint_as_float(b << 16); }
  __device__ __forceinline__ static uint32_t to_bits(float f) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  }
};

template <typename T, int kBytes>
struct Layout {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "rows are 4, 8 or 16 bytes");
  static constexpr int kBits = 8 * sizeof(T);
  static constexpr int kPerWord = 4 / sizeof(T);
  static constexpr int kWords = kBytes / 4;
  static constexpr int kPerRow = kBytes / sizeof(T);  // V
};

// kBytes of consecutive elements, as 32-bit words.
template <int kBytes>
struct Row {
  uint32_t w[kBytes / 4];
};

// Element e (0 <= e < V) of a row, as fp32.
template <typename T, int kBytes>
__device__ __forceinline__ float row_get(const Row<kBytes>& r, int e) {
  using L = Layout<T, kBytes>;
  const uint32_t word = r.w[e / L::kPerWord];
  return Cvt<T>::to_float(word >> (L::kBits * (e % L::kPerWord)));
}

// A row from V fp32 values, each rounded once to T.
template <typename T, int kBytes>
__device__ __forceinline__ Row<kBytes> row_from_floats(
    const float (&v)[Layout<T, kBytes>::kPerRow]) {
  using L = Layout<T, kBytes>;
  Row<kBytes> r;
#pragma unroll
  for (int i = 0; i < L::kWords; ++i) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < L::kPerWord; ++j) {
      word |= Cvt<T>::to_bits(v[i * L::kPerWord + j]) << (L::kBits * j);
    }
    r.w[i] = word;
  }
  return r;
}

template <int kBytes>
__device__ __forceinline__ Row<kBytes> zero_row() {
  Row<kBytes> r;
#pragma unroll
  for (int i = 0; i < kBytes / 4; ++i) r.w[i] = 0u;
  return r;
}

// The first nv (<= V) elements at p; the rest of the row is zero. `vec`: one
// kBytes access (p aligned, nv == V). kNC: the data is read-only for the kernel.
// The vector accesses are explicit: a plain uint4 dereference may be split into words.
template <typename T, int kBytes, bool kNC>
__device__ __forceinline__ Row<kBytes> load_row(const T* p, int nv, bool vec) {
  using L = Layout<T, kBytes>;
  using Bits = typename Cvt<T>::Bits;
  Row<kBytes> r;
  if (vec) {
    if constexpr (kBytes == 16) {
      const uint4* q = reinterpret_cast<const uint4*>(p);
      const uint4 u = kNC ? __ldg(q) : __ldcg(q);
      r.w[0] = u.x;
      r.w[1] = u.y;
      r.w[2] = u.z;
      r.w[3] = u.w;
    } else if constexpr (kBytes == 8) {
      const uint2* q = reinterpret_cast<const uint2*>(p);
      const uint2 u = kNC ? __ldg(q) : __ldcg(q);
      r.w[0] = u.x;
      r.w[1] = u.y;
    } else {
      const unsigned int* q = reinterpret_cast<const unsigned int*>(p);
      r.w[0] = kNC ? __ldg(q) : __ldcg(q);
    }
  } else {
    const Bits* q = reinterpret_cast<const Bits*>(p);
    r = zero_row<kBytes>();
#pragma unroll
    for (int e = 0; e < L::kPerRow; ++e) {
      if (e < nv) {
        r.w[e / L::kPerWord] |= static_cast<uint32_t>(q[e]) << (L::kBits * (e % L::kPerWord));
      }
    }
  }
  return r;
}

template <typename T, int kBytes>
__device__ __forceinline__ void store_row(T* p, const Row<kBytes>& r, int nv, bool vec) {
  using L = Layout<T, kBytes>;
  using Bits = typename Cvt<T>::Bits;
  if (vec) {
    if constexpr (kBytes == 16) {
      __stwb(reinterpret_cast<uint4*>(p), make_uint4(r.w[0], r.w[1], r.w[2], r.w[3]));
    } else if constexpr (kBytes == 8) {
      __stwb(reinterpret_cast<uint2*>(p), make_uint2(r.w[0], r.w[1]));
    } else {
      __stwb(reinterpret_cast<unsigned int*>(p), r.w[0]);
    }
  } else {
    Bits* q = reinterpret_cast<Bits*>(p);
#pragma unroll
    for (int e = 0; e < L::kPerRow; ++e) {
      if (e < nv) {
        q[e] = static_cast<Bits>(r.w[e / L::kPerWord] >> (L::kBits * (e % L::kPerWord)));
      }
    }
  }
}

// dst[v][m] = p[v * stride_f + m] for the first nv features, 0 for the rest.
// `vec` (stride_f == M, nv == V, p aligned): the V*M elements are contiguous, M rows.
template <typename T, int kBytes, int M>
__device__ __forceinline__ void load_cols(const T* p, int64_t stride_f, int nv, bool vec,
                                          float (&dst)[Layout<T, kBytes>::kPerRow][M]) {
  constexpr int V = Layout<T, kBytes>::kPerRow;
  if (vec) {
    Row<kBytes> r[M];
#pragma unroll
    for (int i = 0; i < M; ++i) r[i] = load_row<T, kBytes, false>(p + i * V, V, true);
#pragma unroll
    for (int e = 0; e < V * M; ++e) dst[e / M][e % M] = row_get<T, kBytes>(r[e / V], e % V);
  } else {
    using Bits = typename Cvt<T>::Bits;
    const Bits* q = reinterpret_cast<const Bits*>(p);
#pragma unroll
    for (int v = 0; v < V; ++v) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        dst[v][m] = v < nv ? Cvt<T>::to_float(q[v * stride_f + m]) : 0.0f;
      }
    }
  }
}

// p[v * stride_f + m] = src[v][m] for the first nv features (layout as load_cols).
template <typename T, int kBytes, int M>
__device__ __forceinline__ void store_cols(T* p, int64_t stride_f, int nv, bool vec,
                                           const float (&src)[Layout<T, kBytes>::kPerRow][M]) {
  constexpr int V = Layout<T, kBytes>::kPerRow;
  if (vec) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      float v[V];
#pragma unroll
      for (int j = 0; j < V; ++j) v[j] = src[(i * V + j) / M][(i * V + j) % M];
      store_row<T, kBytes>(p + i * V, row_from_floats<T, kBytes>(v), V, true);
    }
  } else {
    using Bits = typename Cvt<T>::Bits;
    Bits* q = reinterpret_cast<Bits*>(p);
#pragma unroll
    for (int v = 0; v < V; ++v) {
      if (v < nv) {
#pragma unroll
        for (int m = 0; m < M; ++m) {
          q[v * stride_f + m] = static_cast<Bits>(Cvt<T>::to_bits(src[v][m]));
        }
      }
    }
  }
}

__device__ __forceinline__ float silu(float v) { return __fdividef(v, 1.0f + __expf(-v)); }

// One output row from the W-1 previous inputs (win, oldest first) and the new
// input row; then the window slides by one.
template <typename T, int W, int kBytes, bool kSilu>
__device__ __forceinline__ void conv_row(const Row<kBytes>& in,
                                         const float (&w)[Layout<T, kBytes>::kPerRow][W],
                                         const float (&b)[Layout<T, kBytes>::kPerRow],
                                         float (&win)[W - 1][Layout<T, kBytes>::kPerRow], T* out,
                                         int nv, bool vec) {
  constexpr int V = Layout<T, kBytes>::kPerRow;
  float xin[V];
  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    xin[v] = row_get<T, kBytes>(in, v);
    float a = b[v];
#pragma unroll
    for (int k = 0; k < W - 1; ++k) a = fmaf(w[v][k], win[k][v], a);
    a = fmaf(w[v][W - 1], xin[v], a);
    acc[v] = kSilu ? silu(a) : a;
  }
  store_row<T, kBytes>(out, row_from_floats<T, kBytes>(acc), nv, vec);
#pragma unroll
  for (int k = 0; k < W - 2; ++k) {
#pragma unroll
    for (int v = 0; v < V; ++v) win[k][v] = win[k + 1][v];
  }
#pragma unroll
  for (int v = 0; v < V; ++v) win[W - 2][v] = xin[v];
}

// Token rows a thread loads ahead: two chunks of C rows are in registers at
// once (the one being convolved and the next one in flight), next to the
// weights (V*W floats) and the window (V*(W-1)). 256 bytes in flight per thread
// (C = 16 rows of 16 bytes, 64 of 4) except for wide 16-bit kernels with 16-byte
// rows, which take 128 to stay within 255 registers. A build may force the bytes
// (CMake's CONV_FWD_INFLIGHT_BYTES) to compare settings.
template <typename T, int W, int kBytes>
constexpr int fwd_chunk() {
#ifdef VLLM_CONV_FWD_INFLIGHT_BYTES
  return VLLM_CONV_FWD_INFLIGHT_BYTES / kBytes;
#else
  constexpr int V = Layout<T, kBytes>::kPerRow;
  return (V * (2 * W - 1) <= 64 ? 256 : 128) / kBytes;
#endif
}

// Forward: block (sequence, feature block); each thread walks its sequence's
// tokens in order for its V features, prefetching the next C token rows while
// it convolves the current C.
template <typename T, int W, int kBytes, int C, bool kVec, bool kSilu>
__global__ void __launch_bounds__(kFwdThreads)
    causal_conv1d_fwd_kernel(const FwdParams p, const VecFlags vf) {
  constexpr int V = Layout<T, kBytes>::kPerRow;
  const int64_t seq = blockIdx.x;
  const int64_t f0 = (static_cast<int64_t>(blockIdx.y) * kFwdThreads + threadIdx.x) * V;
  if (f0 >= p.dim) return;
  const int nv = static_cast<int>(p.dim - f0 < V ? p.dim - f0 : V);

  const int64_t start = p.query_start_loc[seq];
  const int64_t len = p.query_start_loc[seq + 1] - start;
  const int64_t line =
      p.cache_indices != nullptr ? static_cast<int64_t>(p.cache_indices[seq]) : seq;
  const int64_t sx = p.stride_x_t;
  const int64_t so = p.stride_out_t;
  const T* x = static_cast<const T*>(p.x) + start * sx + f0;
  T* out = static_cast<T*>(p.out) + start * so + f0;

  if (line == p.pad_slot_id) {
    const Row<kBytes> zero = zero_row<kBytes>();
    for (int64_t t = 0; t < len; ++t) store_row<T, kBytes>(out + t * so, zero, nv, kVec);
    return;
  }

  float w[V][W];
  load_cols<T, kBytes, W>(static_cast<const T*>(p.weight) + f0 * p.stride_w_d, p.stride_w_d, nv,
                          vf.weight, w);
  float b[V][1];
  if (p.bias != nullptr) {
    load_cols<T, kBytes, 1>(static_cast<const T*>(p.bias) + f0, 1, nv, vf.bias, b);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) b[v][0] = 0.0f;
  }
  float bias[V];
#pragma unroll
  for (int v = 0; v < V; ++v) bias[v] = b[v][0];

  T* state = static_cast<T*>(p.states) + line * p.stride_state_line + f0 * p.stride_state_d;
  float win[W - 1][V];
  if (p.has_initial_state != nullptr && p.has_initial_state[seq]) {
    float h[V][W - 1];
    load_cols<T, kBytes, W - 1>(state, p.stride_state_d, nv, vf.state, h);
#pragma unroll
    for (int k = 0; k < W - 1; ++k) {
#pragma unroll
      for (int v = 0; v < V; ++v) win[k][v] = h[v][k];
    }
  } else {
#pragma unroll
    for (int k = 0; k < W - 1; ++k) {
#pragma unroll
      for (int v = 0; v < V; ++v) win[k][v] = 0.0f;
    }
  }

  Row<kBytes> cur[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    cur[i] = i < len ? load_row<T, kBytes, true>(x + i * sx, nv, kVec) : zero_row<kBytes>();
  }
  for (int64_t c0 = 0; c0 < len; c0 += C) {
    Row<kBytes> nxt[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const int64_t t = c0 + C + i;
      nxt[i] = t < len ? load_row<T, kBytes, true>(x + t * sx, nv, kVec) : zero_row<kBytes>();
    }
    if (c0 + C <= len) {
#pragma unroll
      for (int i = 0; i < C; ++i) {
        conv_row<T, W, kBytes, kSilu>(cur[i], w, bias, win, out + (c0 + i) * so, nv, kVec);
      }
    } else {
      // The sequence's last, partial chunk: the window must stop at its last token.
      const int n = static_cast<int>(len - c0);
#pragma unroll
      for (int i = 0; i < C; ++i) {
        if (i < n) {
          conv_row<T, W, kBytes, kSilu>(cur[i], w, bias, win, out + (c0 + i) * so, nv, kVec);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < C; ++i) cur[i] = nxt[i];
  }

  // Final state: the last W-1 inputs of [history, tokens]. Only this thread
  // reads or writes these columns of this line.
  float h[V][W - 1];
#pragma unroll
  for (int k = 0; k < W - 1; ++k) {
#pragma unroll
    for (int v = 0; v < V; ++v) h[v][k] = win[k][v];
  }
  store_cols<T, kBytes, W - 1>(state, p.stride_state_d, nv, vf.state, h);
}

// Update (decode): block (sequence, feature block), one token per sequence, rows
// of 16 bytes (vectors where vf allows).
template <typename T, int W>
__global__ void __launch_bounds__(kUpdateThreads)
    causal_conv1d_update_kernel(const UpdateParams p, const VecFlags vf) {
  constexpr int kBytes = 16;
  constexpr int V = Layout<T, kBytes>::kPerRow;
  const int64_t seq = blockIdx.x;
  const int64_t f0 = (static_cast<int64_t>(blockIdx.y) * kUpdateThreads + threadIdx.x) * V;
  if (f0 >= p.dim) return;
  const int nv = static_cast<int>(p.dim - f0 < V ? p.dim - f0 : V);

  const int64_t line =
      p.state_indices != nullptr ? static_cast<int64_t>(p.state_indices[seq]) : seq;
  T* out = static_cast<T*>(p.out) + seq * p.stride_out_b + f0;
  if (line == p.pad_slot_id) {
    store_row<T, kBytes>(out, zero_row<kBytes>(), nv, vf.x);
    return;
  }

  // Every load is independent of the others: one memory latency per thread.
  const Row<kBytes> in =
      load_row<T, kBytes, true>(static_cast<const T*>(p.x) + seq * p.stride_x_b + f0, nv, vf.x);
  T* state = static_cast<T*>(p.states) + line * p.stride_state_line + f0 * p.stride_state_d;
  float h[V][W - 1];
  load_cols<T, kBytes, W - 1>(state, p.stride_state_d, nv, vf.state, h);
  float w[V][W];
  load_cols<T, kBytes, W>(static_cast<const T*>(p.weight) + f0 * p.stride_w_d, p.stride_w_d, nv,
                          vf.weight, w);
  float b[V][1];
  if (p.bias != nullptr) {
    load_cols<T, kBytes, 1>(static_cast<const T*>(p.bias) + f0, 1, nv, vf.bias, b);
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) b[v][0] = 0.0f;
  }

  float acc[V];
  float h_new[V][W - 1];
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const float xv = row_get<T, kBytes>(in, v);
    float a = b[v][0];
#pragma unroll
    for (int k = 0; k < W - 1; ++k) a = fmaf(w[v][k], h[v][k], a);
    a = fmaf(w[v][W - 1], xv, a);
    acc[v] = p.silu ? silu(a) : a;
#pragma unroll
    for (int k = 0; k < W - 2; ++k) h_new[v][k] = h[v][k + 1];
    h_new[v][W - 2] = xv;
  }
  store_row<T, kBytes>(out, row_from_floats<T, kBytes>(acc), nv, vf.x);
  store_cols<T, kBytes, W - 1>(state, p.stride_state_d, nv, vf.state, h_new);
}

}  // namespace vllm_conv

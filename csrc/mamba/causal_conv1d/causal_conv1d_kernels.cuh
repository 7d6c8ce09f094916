// Device code of the CUDA causal-conv1d pathway (see causal_conv1d.h for the contract).
//
// Each thread owns V consecutive features and moves them as one "row" of kBytes
// per token: kBytes = 16, 8 or 4 (V = kBytes / sizeof(T); a warp reads 32 * kBytes
// contiguous bytes of a token). The forward kernel's blocks are (sequence, feature
// block), so a step of few sequences has few blocks; narrower rows give it more,
// smaller blocks. The launcher picks per call (choose_fwd_variant); the update
// kernel always uses 16-byte rows.
//
// Values travel as raw 32-bit words and are widened to fp32 only where they are
// multiplied; states are moved as values widened from and rounded back to T, which
// is exact, so a state is bit-identical to its input.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
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

// The forward's row width and vector flags. Every (sequence, feature block) is one
// block that streams its sequence at roughly the same rate, so the step takes as
// long as the SM with the most blocks: the launcher takes the widest rows (fewest
// instructions per byte) whose grid spreads evenly, at least 80% of the busiest SM's
// blocks on the average SM, else the most even grid. Measured on an H200 (bf16,
// 16 sequences): at dim 8448, 4-byte rows (528 blocks, 4 per SM) reach 77% of copy
// bandwidth where 8-byte rows (272 blocks, 2 or 3 per SM) reach 69%; at dim 10240
// and 4096 8-byte rows are the faster (balance 0.81 and 0.97).
// params.row_bytes forces the width; rows too wide for the alignment of x/out fall
// back to narrower ones, then to the element-wise kernel (vf.x false).
struct FwdVariant {
  int row_bytes;
  VecFlags vf;
};

inline double grid_balance(int64_t blocks, int64_t num_sms) {
  const int64_t sms = num_sms > 0 ? num_sms : 1;
  return static_cast<double>(blocks) / static_cast<double>(ceil_div(blocks, sms) * sms);
}

template <typename T>
int choose_fwd_row_bytes(const FwdParams& p, int num_sms) {
  if (p.row_bytes != 0) return p.row_bytes;
  int best_rb = 4;
  double best = -1.0;
  for (const int rb : {16, 8, 4}) {
    const int64_t per_block = int64_t{kFwdThreads} * (rb / static_cast<int>(sizeof(T)));
    const double balance = grid_balance(p.batch * ceil_div(p.dim, per_block), num_sms);
    if (balance >= 0.8) return rb;
    if (balance > best) {
      best = balance;
      best_rb = rb;
    }
  }
  return best_rb;
}

template <typename T, int W>
FwdVariant choose_fwd_variant(const FwdParams& p, int num_sms) {
  const int want = choose_fwd_row_bytes<T>(p, num_sms);
  VecFlags vf;
  if (want >= 16) {
    vf = vec_flags<T, W, 16>(p.dim, p.x, p.stride_x_t, p.out, p.stride_out_t, p.weight,
                             p.stride_w_d, p.bias, p.states, p.stride_state_line,
                             p.stride_state_d);
    if (vf.x) return {16, vf};
  }
  if (want >= 8) {
    vf = vec_flags<T, W, 8>(p.dim, p.x, p.stride_x_t, p.out, p.stride_out_t, p.weight,
                            p.stride_w_d, p.bias, p.states, p.stride_state_line,
                            p.stride_state_d);
    if (vf.x) return {8, vf};
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

// SiLU, v / (1 + e^-v), with one hardware exp2 and one hardware reciprocal (both
// approximate, relative error ~2^-22): __expf and __fdividef add range fix-ups that
// double the instructions of the forward's inner loop. Large |v| saturates
// correctly: e^-v = inf gives -0, e^-v = 0 gives v.
__device__ __forceinline__ float silu(float v) {
#if defined(__CUDA_ARCH__)
  float e;
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(v * -1.4426950408889634f));
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + e));
  return v * r;
#else
  return v / (1.0f + std::exp(-v));
#endif
}

// Asynchronous copies of one row from global to shared memory (cp.async, sm_80+):
// the thread goes on while the row travels, so rows in flight cost shared memory,
// not registers. 16-byte rows bypass L1 (read once). Before sm_80, and in the host
// emulation of the kernels, the copy is synchronous.
template <int kBytes>
__device__ __forceinline__ void async_copy_row(uint32_t* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (kBytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(kBytes)
                 : "memory");
  }
#else
  const uint32_t* g = static_cast<const uint32_t*>(gmem);
#pragma unroll
  for (int i = 0; i < kBytes / 4; ++i) smem[i] = g[i];
#endif
}

// Closes the group of the copies issued since the last commit.
__device__ __forceinline__ void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most N of this thread's groups are still in flight.
template <int N>
__device__ __forceinline__ void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// A row of kBytes from shared memory (one access).
template <int kBytes>
__device__ __forceinline__ Row<kBytes> smem_row(const uint32_t* s) {
  Row<kBytes> r;
  if constexpr (kBytes == 16) {
    const uint4 u = *reinterpret_cast<const uint4*>(s);
    r.w[0] = u.x;
    r.w[1] = u.y;
    r.w[2] = u.z;
    r.w[3] = u.w;
  } else if constexpr (kBytes == 8) {
    const uint2 u = *reinterpret_cast<const uint2*>(s);
    r.w[0] = u.x;
    r.w[1] = u.y;
  } else {
    r.w[0] = s[0];
  }
  return r;
}

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

// A forward thread's constants and running state: the weights and bias of its V
// features and the window of the W-1 previous inputs (oldest first), fp32.
template <typename T, int W, int kBytes>
struct FwdThread {
  static constexpr int V = Layout<T, kBytes>::kPerRow;
  float w[V][W];
  float bias[V];
  float win[W - 1][V];

  // Weights, bias, and the window: the line's W-1 columns when the sequence has an
  // initial state, zeros otherwise.
  __device__ __forceinline__ void load(const FwdParams& p, const VecFlags& vf, int64_t seq,
                                       int64_t f0, int nv, const T* state) {
    load_cols<T, kBytes, W>(static_cast<const T*>(p.weight) + f0 * p.stride_w_d, p.stride_w_d,
                            nv, vf.weight, w);
    float b[V][1];
    if (p.bias != nullptr) {
      load_cols<T, kBytes, 1>(static_cast<const T*>(p.bias) + f0, 1, nv, vf.bias, b);
    } else {
#pragma unroll
      for (int v = 0; v < V; ++v) b[v][0] = 0.0f;
    }
#pragma unroll
    for (int v = 0; v < V; ++v) bias[v] = b[v][0];
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
  }

  template <bool kSilu>
  __device__ __forceinline__ void conv(const Row<kBytes>& in, T* out, int nv, bool vec) {
    conv_row<T, W, kBytes, kSilu>(in, w, bias, win, out, nv, vec);
  }

  // Final state: the last W-1 inputs of [history, tokens]. Only this thread reads
  // or writes these columns of this line.
  __device__ __forceinline__ void store_state(const FwdParams& p, const VecFlags& vf, int nv,
                                              T* state) const {
    float h[V][W - 1];
#pragma unroll
    for (int k = 0; k < W - 1; ++k) {
#pragma unroll
      for (int v = 0; v < V; ++v) h[v][k] = win[k][v];
    }
    store_cols<T, kBytes, W - 1>(state, p.stride_state_d, nv, vf.state, h);
  }
};

// Where a forward thread works: its sequence's tokens and line, its features.
struct FwdSlice {
  int64_t seq, f0, start, len, line;
  int nv;
};

template <int V>
__device__ __forceinline__ bool fwd_slice(const FwdParams& p, int threads, FwdSlice& s) {
  s.seq = blockIdx.x;
  s.f0 = (static_cast<int64_t>(blockIdx.y) * threads + threadIdx.x) * V;
  if (s.f0 >= p.dim) return false;
  s.nv = static_cast<int>(p.dim - s.f0 < V ? p.dim - s.f0 : V);
  s.start = p.query_start_loc[s.seq];
  s.len = p.query_start_loc[s.seq + 1] - s.start;
  s.line = p.cache_indices != nullptr ? static_cast<int64_t>(p.cache_indices[s.seq]) : s.seq;
  return true;
}

// Forward, whole aligned rows (the usual case): block (sequence, feature block);
// each thread walks its sequence's tokens in order for its V features. Its token
// rows travel by asynchronous copies into a per-thread ring of shared memory,
// kFwdRingGroups groups of G rows, 256 bytes a thread: while it convolves group
// g, groups g+1..g+6 are in flight (224 bytes a thread), and its registers hold
// only the weights and the window. No thread reads another's rows, so the block
// never synchronises.
// A build may change the ring's bytes (CMake's CONV_FWD_RING_BYTES) to compare settings.
constexpr int kFwdRingGroups = 8;
#ifdef VLLM_CONV_FWD_RING_BYTES
constexpr int kFwdRingBytes = VLLM_CONV_FWD_RING_BYTES;
#else
constexpr int kFwdRingBytes = 256;
#endif

template <typename T, int W, int kBytes, bool kSilu>
__global__ void __launch_bounds__(kFwdThreads)
    causal_conv1d_fwd_kernel(const FwdParams p, const VecFlags vf) {
  constexpr int V = Layout<T, kBytes>::kPerRow;
  constexpr int kWords = kBytes / 4;
  constexpr int R = kFwdRingGroups;
  constexpr int G = kFwdRingBytes / (R * kBytes);
  static_assert(G >= 1 && (R & (R - 1)) == 0, "ring of 2^k groups of >= 1 row");
  // ring[slot][thread]: a slot's rows are contiguous over the block's threads.
  alignas(16) __shared__ uint32_t ring[R * G][kFwdThreads * kWords];

  FwdSlice s;
  if (!fwd_slice<V>(p, kFwdThreads, s)) return;
  const int64_t sx = p.stride_x_t;
  const int64_t so = p.stride_out_t;
  const T* x = static_cast<const T*>(p.x) + s.start * sx + s.f0;
  T* out = static_cast<T*>(p.out) + s.start * so + s.f0;
  if (s.line == p.pad_slot_id) {
    const Row<kBytes> zero = zero_row<kBytes>();
    for (int64_t t = 0; t < s.len; ++t) store_row<T, kBytes>(out + t * so, zero, V, true);
    return;
  }
  T* state = static_cast<T*>(p.states) + s.line * p.stride_state_line + s.f0 * p.stride_state_d;
  FwdThread<T, W, kBytes> th;
  th.load(p, vf, s.seq, s.f0, s.nv, state);

  uint32_t* mine = &ring[0][threadIdx.x * kWords];
  constexpr int kSlot = kFwdThreads * kWords;  // words between a thread's slots
  // Token counts fit in int (query_start_loc is int32); rows advance by pointer
  // increments rather than 64-bit products.
  const int len = static_cast<int>(s.len);
  const T* xi = x;  // the next row to issue
  int left = len;   // rows not yet issued
  // Group g: the next G rows into slots (g % R)*G ...; always committed (maybe
  // empty) so that "group g has landed" is "at most R-2 newer groups in flight".
  auto issue = [&](int g) {
    uint32_t* dst = mine + (g & (R - 1)) * G * kSlot;
#pragma unroll
    for (int i = 0; i < G; ++i) {
      if (i < left) async_copy_row<kBytes>(dst + i * kSlot, xi + i * sx);
    }
    const int n = left < G ? left : G;
    xi += n * sx;
    left -= n;
    async_commit();
  };
#pragma unroll
  for (int g = 0; g < R - 1; ++g) issue(g);
  T* o = out;
  for (int g = 0, t0 = 0; t0 < len; ++g, t0 += G) {
    async_wait<R - 2>();
    const uint32_t* src = mine + (g & (R - 1)) * G * kSlot;
    if (t0 + G <= len) {
#pragma unroll
      for (int i = 0; i < G; ++i) {
        th.template conv<kSilu>(smem_row<kBytes>(src + i * kSlot), o, V, true);
        o += so;
      }
    } else {
      // The sequence's last, partial group: the window must stop at its last token.
#pragma unroll
      for (int i = 0; i < G; ++i) {
        if (t0 + i < len) {
          th.template conv<kSilu>(smem_row<kBytes>(src + i * kSlot), o, V, true);
          o += so;
        }
      }
    }
    // Into the slots of group g-1, read one iteration ago.
    issue(g + R - 1);
  }
  async_wait<0>();  // no copy may land in shared memory after the block is gone
  th.store_state(p, vf, s.nv, state);
}

// Forward, element-wise fallback (odd dims or misaligned rows): 4-byte rows read
// element by element into registers; each thread loads the next C rows while it
// convolves the current C.
constexpr int kFwdFallbackChunk = 32;

template <typename T, int W, bool kSilu>
__global__ void __launch_bounds__(kFwdThreads)
    causal_conv1d_fwd_fallback_kernel(const FwdParams p, const VecFlags vf) {
  constexpr int kBytes = 4;
  constexpr int C = kFwdFallbackChunk;
  constexpr int V = Layout<T, kBytes>::kPerRow;
  FwdSlice s;
  if (!fwd_slice<V>(p, kFwdThreads, s)) return;
  const int64_t sx = p.stride_x_t;
  const int64_t so = p.stride_out_t;
  const int nv = s.nv;
  const int64_t len = s.len;
  const T* x = static_cast<const T*>(p.x) + s.start * sx + s.f0;
  T* out = static_cast<T*>(p.out) + s.start * so + s.f0;
  if (s.line == p.pad_slot_id) {
    const Row<kBytes> zero = zero_row<kBytes>();
    for (int64_t t = 0; t < len; ++t) store_row<T, kBytes>(out + t * so, zero, nv, false);
    return;
  }
  T* state = static_cast<T*>(p.states) + s.line * p.stride_state_line + s.f0 * p.stride_state_d;
  FwdThread<T, W, kBytes> th;
  th.load(p, vf, s.seq, s.f0, nv, state);

  Row<kBytes> cur[C];
#pragma unroll
  for (int i = 0; i < C; ++i) {
    cur[i] = i < len ? load_row<T, kBytes, true>(x + i * sx, nv, false) : zero_row<kBytes>();
  }
  for (int64_t c0 = 0; c0 < len; c0 += C) {
    Row<kBytes> nxt[C];
#pragma unroll
    for (int i = 0; i < C; ++i) {
      const int64_t t = c0 + C + i;
      nxt[i] = t < len ? load_row<T, kBytes, true>(x + t * sx, nv, false) : zero_row<kBytes>();
    }
#pragma unroll
    for (int i = 0; i < C; ++i) {
      if (c0 + i < len) th.template conv<kSilu>(cur[i], out + (c0 + i) * so, nv, false);
    }
#pragma unroll
    for (int i = 0; i < C; ++i) cur[i] = nxt[i];
  }
  th.store_state(p, vf, nv, state);
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

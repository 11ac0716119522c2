// The compact Llama-family forward (core/llama.py, CompactLlama) as one native call.
//
// Why: at decode shapes a layer's matmuls take tens of microseconds, and the ~30 small PyTorch ops
// around them (norms, rotary, casts, residual adds, the SiLU gate), each a Python call and a dispatch,
// cost about half as much again as the matmuls (docs/decisions/0001-native-forward.md). Here the whole
// forward is one op: the matmuls are the engine's own kernels where the CPU has them (AMX tiles, a bf16
// GEMV) or the library's (oneDNN pre-packed bf16, else at::linear), attention reads and writes the paged
// cache in place (ATen's kernel where it is the faster, see `attention`), and the elementwise work runs as
// plain loops the compiler vectorises.
//
// Numerics: every elementwise step rounds to the compute dtype where the eager forward's op would
// (bf16: each multiply and add rounded, as ATen's bf16 kernels compute in float and store bf16), and
// -ffp-contract=off keeps the compiler from fusing a multiply and an add. What differs from the eager
// forward is the order of the RMSNorm sum of squares and the exp inside SiLU (a polynomial within
// 1e-7 relative): the last bit of a float32 value, so a bf16 rounding flips now and then.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstring>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <optional>
#include <string_view>
#include <vector>

using at::Tensor;

namespace {

// One weight set per layer, in this order (absent optional ones are empty tensors).
enum { LN1, QKV, QKV_B, O, O_B, Q_NORM, K_NORM, LN2, GATE_UP, DOWN, PER_LAYER };
// The model's own (unfused, row-major) weights per layer for the GEMV, in this order, then the LM head's; or none.
enum { P_Q, P_K, P_V, P_O, P_GATE, P_UP, P_DOWN, PARTS_PER_LAYER };
// The fused weights' AMX tiles per layer (amx_pack; an empty tensor where a weight has none), then the LM head's; or none.
enum { T_QKV, T_O, T_GATE_UP, T_DOWN, TILES_PER_LAYER };

bool present(const Tensor& t) { return t.defined() && t.numel() > 0; }

Tensor library_linear(const Tensor& x, const Tensor& w, const Tensor& b, bool packed) {
  // x [T, in] -> [T, out]
  std::optional<Tensor> bias = present(b) ? std::optional<Tensor>(b) : std::nullopt;
  if (packed) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                         .typed<Tensor(const Tensor&, const Tensor&, const std::optional<Tensor>&, std::string_view,
                                       c10::List<std::optional<c10::Scalar>>, std::optional<std::string_view>)>();
    return op.call(x, w, bias, "none", c10::List<std::optional<c10::Scalar>>(), std::string_view(""));
  }
  return at::linear(x, w, bias);
}

// Loads and stores in the compute dtype, branch-free so that loops over them vectorise (c10's
// float -> bf16 conversion branches on NaN per element). bf16 stores round to nearest even, as ATen's.
inline float ld(float v) { return v; }
inline float ld(c10::BFloat16 v) { return std::bit_cast<float>(static_cast<uint32_t>(v.x) << 16); }
template <typename T>
inline T st(float v);
template <>
inline float st<float>(float v) { return v; }
template <>
[[gnu::always_inline]] inline c10::BFloat16 st<c10::BFloat16>(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;  // an integer compare: vectorises, unlike v != v
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : r), c10::BFloat16::from_bits());
}
// f(float{}) or f(c10::BFloat16{}) for the compute dtype: the two the engines run here (core/llama.py
// sends nothing else).
template <typename F>
void on_dtype(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat)
    f(float{});
  else if (dtype == at::kBFloat16)
    f(c10::BFloat16{});
  else
    TORCH_CHECK(false, "the native forward runs float32 and bfloat16, not ", dtype);
}

// Round to the compute dtype: a no-op for float.
template <typename T>
inline float rnd(float v) {
  return ld(st<T>(v));
}

// y[r] = w * round(x[r] * rsqrt(mean(x[r]^2) + eps)) for `rows` rows of width `n` (Hugging Face's RMSNorm).
template <typename T>
void rms_norm(const T* x, const T* w, T* y, int64_t rows, int64_t n, int64_t x_stride, int64_t y_stride, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* yr = y + r * y_stride;
    float ss = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      float v = ld(xr[i]);
      ss += v * v;
    }
    float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
    for (int64_t i = 0; i < n; ++i)
      yr[i] = st<T>(ld(w[i]) * rnd<T>(ld(xr[i]) * inv));
  }
}

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  // x [T, n] contiguous -> [T, n]
  Tensor y = at::empty_like(x);
  int64_t n = x.size(-1), rows = x.numel() / n;
  on_dtype(x.scalar_type(), [&](auto t) {
    using scalar_t = decltype(t);
    rms_norm<scalar_t>(x.const_data_ptr<scalar_t>(), w.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(),
                       rows, n, n, n, static_cast<float>(eps));
  });
  return y;
}

// In place on the first `heads` heads of each token of qkv [T, heads_all, D]: optional per-head RMSNorm
// (q_norm for the first H heads, k_norm for the next KV: Qwen3), then x * cos + rotate_half(x) * sin.
template <typename T>
void norm_rotate(T* qkv, const T* cos, const T* sin, const T* q_norm, const T* k_norm, int64_t tokens,
                 int64_t heads_all, int64_t H, int64_t KV, int64_t D, float eps) {
  const int64_t h2 = D / 2;
  std::vector<float> tmp(D);
  for (int64_t t = 0; t < tokens; ++t) {
    const T* c = cos + t * D;
    const T* s = sin + t * D;
    for (int64_t h = 0; h < H + KV; ++h) {
      T* x = qkv + (t * heads_all + h) * D;
      const T* nw = h < H ? q_norm : k_norm;
      if (nw) rms_norm<T>(x, nw, x, 1, D, D, D, eps);
      for (int64_t i = 0; i < D; ++i) tmp[i] = ld(x[i]);
      for (int64_t i = 0; i < D; ++i) {
        float rot = i < h2 ? -tmp[i + h2] : tmp[i - h2];
        float a = rnd<T>(tmp[i] * ld(c[i]));
        float b = rnd<T>(rot * ld(s[i]));
        x[i] = st<T>(a + b);
      }
    }
  }
}

// exp(x) for float x, within 2 ulp (Cephes' expf: Cody-Waite range reduction, degree-6 polynomial),
// branch-free so that loops over it vectorise; libm's expf is a call per element (at 9 new tokens the
// MLP's SiLU alone made 12,672 of them per layer).
[[gnu::always_inline]] inline float exp_(float x) {
  x = std::min(std::max(x, -87.33654f), 88.72283f);
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest (1.5 x 2^23 trick; std::floor does not vectorise)
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  return y * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// out[t, i] = round(round(silu(gate[t, i])) * up[t, i]) for gu [T, 2I] = [gate | up].
template <typename T>
void silu_mul(const T* gu, T* out, int64_t tokens, int64_t I) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* g = gu + t * 2 * I;
    const T* u = g + I;
    T* o = out + t * I;
    for (int64_t i = 0; i < I; ++i) {
      float x = ld(g[i]);
      float act = rnd<T>(x / (1.f + exp_(-x)));
      o[i] = st<T>(act * ld(u[i]));
    }
  }
}

// ---- Attention over the paged cache, read in place.
//
// Why: at decode shapes ATen's CPU flash attention costs far more than its arithmetic (one query over
// 121 keys: some 50 us a layer, 8 heads' worth of tiny gemm calls, buffers, a cast of q and of the
// output, a gather of every row in batches), a tenth of the shipped target's one-token forward. Here
// each (sequence, KV head) reads its K and V rows straight from the cache (views or row indices: no
// gather), once per block of up to 4 of the queries that share that head (GQA group x new tokens), and
// writes the output in the compute dtype. Numerics as ATen's: float32 scores q.k times the scale, masked keys
// skipped, exp(score - max), the weighted sum of V times 1 / sum, rounded once to the compute dtype;
// only the order of the float32 sums (and exp_ against Sleef's exp) differs.

// Keys whose weight exp(score - max) is below 2^-64 get 0: all of them together move the output by under
// S x 2^-64 of the largest weight's (1), far below float32's resolution, while their products with V would be
// denormal floats, each a microcode assist (which slows attention by an order of magnitude at the positions
// that have many of them; docs/decisions/0011-attention-in-place.md).
constexpr float kNegligible = -44.3614195558365f;  // ln(2^-64)

// The attention loops in GCC's vector extension, as wide as the build's registers: 16 floats where it targets
// AVX-512 (x86-64-v4), 8 elsewhere (AVX2 or two SSE registers); multiply-adds fused where the build has FMA
// (float32 attention, as ATen's BLAS fuses them; the elementwise loops above keep -ffp-contract=off). Written
// with 16 scalar lanes the loops came out scalar; 16-float vectors on an AVX2 build were spilled to the stack.
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(4 * kLanes)));
typedef uint16_t hvec __attribute__((vector_size(2 * kLanes)));
typedef uint32_t uvec __attribute__((vector_size(4 * kLanes)));

inline fvec vload(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline fvec vload(const c10::BFloat16* p) {  // bf16 -> float: the bits shifted up, exact
  hvec h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<fvec>(__builtin_convertvector(h, uvec) << 16);
}
inline fvec vfma(fvec a, fvec b, fvec c) {  // a * b + c
#if defined(__AVX512F__)
  return _mm512_fmadd_ps(a, b, c);
#elif defined(__FMA__)
  return _mm256_fmadd_ps(a, b, c);
#else
  return a * b + c;
#endif
}
inline float hsum(fvec v) {  // a fixed tree of shuffles and adds
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(v);
#elif defined(__AVX__)
  __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
#else
  float x[kLanes];
  std::memcpy(x, &v, sizeof v);
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int j = 0; j < w; ++j) x[j] += x[j + w];
  return x[0];
#endif
}

// max and sum of x[0..n) in lanes (a max in any order is exact; the sum's order is fixed), so they vectorise.
inline float vmax(const float* x, int64_t n) {
  fvec m = fvec{} - INFINITY;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const fvec v = vload(x + i);
    m = v > m ? v : m;
  }
  float r = -INFINITY;
  for (int j = 0; j < kLanes; ++j) r = std::max(r, m[j]);
  for (; i < n; ++i) r = std::max(r, x[i]);
  return r;
}
inline float vsum(const float* x, int64_t n) {
  fvec a = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) a += vload(x + i);
  float r = hsum(a);
  for (; i < n; ++i) r += x[i];
  return r;
}

// sum_i a[i] * b[i] over D floats, 2 x kLanes at a time in two independent sums.
template <typename C>
inline float dot(const float* a, const C* b, int64_t D) {
  fvec s0 = {}, s1 = {};
  int64_t i = 0;
  for (; i + 2 * kLanes <= D; i += 2 * kLanes) {
    s0 = vfma(vload(a + i), vload(b + i), s0);
    s1 = vfma(vload(a + i + kLanes), vload(b + i + kLanes), s1);
  }
  for (; i + kLanes <= D; i += kLanes) s0 = vfma(vload(a + i), vload(b + i), s0);
  float s = hsum(s0 + s1);
  for (; i < D; ++i) s += a[i] * ld(b[i]);
  return s;
}

#if defined(__AVX512F__)
// The four sums of a0..a3's lanes, as [sum a0, sum a1, sum a2, sum a3] (a fixed tree: 13 instructions, where four
// horizontal sums take 32).
inline __m128 hsum4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 t0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 t1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 u = _mm512_add_ps(_mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(t0, t1, _MM_SHUFFLE(3, 2, 3, 2)));  // per 128 bits: a0..a3
  const __m256 v = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
  return _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
}
#endif

// Row s (a few ahead of the one in use) into cache. Every block asks: asking in the first block only (later ones
// find the rows in L2) is no faster, and this is simpler.
template <int NV, typename C, typename Row>
inline void prefetch_row(const C* X, const Row& row, int64_t s, int64_t S) {
  if (s >= S) return;
  const char* r = reinterpret_cast<const char*>(X + row(s));
  for (size_t o = 0; o < NV * kLanes * sizeof(C); o += 64) __builtin_prefetch(r + o);
}

// p[r][s] = q[r] . K[row(s) ..] * scale, or -inf where mrow[r][s] is false, for QB queries of one KV head and
// D = NV * kLanes: the queries held in registers, each key row read once for all of them. With one query, four
// keys go at a time instead, so that a horizontal sum serves four scores either way (hsum4, AVX-512 builds).
template <int QB, int NV, typename C, typename Row>
inline void scores(const float* q, const C* K, const Row& row, int64_t S, const bool* const* mrow, float scale,
                   float* p) {
  fvec qv[QB][NV];
  for (int r = 0; r < QB; ++r)
    for (int j = 0; j < NV; ++j) qv[r][j] = vload(q + r * NV * kLanes + j * kLanes);
  auto put = [&](int r, int64_t s, float x) { p[r * S + s] = !mrow[r] || mrow[r][s] ? x * scale : -INFINITY; };
  int64_t s = 0;
#if defined(__AVX512F__)
  if constexpr (QB == 4) {
    for (; s < S; ++s) {
      prefetch_row<NV>(K, row, s + 8, S);
      const C* k = K + row(s);
      fvec a[4] = {};
      for (int j = 0; j < NV; ++j) {
        const fvec kv = vload(k + j * kLanes);
        for (int r = 0; r < 4; ++r) a[r] = vfma(qv[r][j], kv, a[r]);
      }
      float x[4];
      _mm_storeu_ps(x, hsum4(a[0], a[1], a[2], a[3]));
      for (int r = 0; r < 4; ++r) put(r, s, x[r]);
    }
  }
  if constexpr (QB == 1) {
    for (; s + 4 <= S; s += 4) {
      fvec a[4] = {};
      for (int u = 0; u < 4; ++u) {
        prefetch_row<NV>(K, row, s + u + 8, S);
        const C* k = K + row(s + u);
        for (int j = 0; j < NV; ++j) a[u] = vfma(qv[0][j], vload(k + j * kLanes), a[u]);
      }
      float x[4];
      _mm_storeu_ps(x, hsum4(a[0], a[1], a[2], a[3]));
      for (int u = 0; u < 4; ++u) put(0, s + u, x[u]);
    }
  }
#endif
  for (; s < S; ++s) {
    prefetch_row<NV>(K, row, s + 8, S);
    const C* k = K + row(s);
    fvec a[QB] = {};
    for (int j = 0; j < NV; ++j) {
      const fvec kv = vload(k + j * kLanes);
      for (int r = 0; r < QB; ++r) a[r] = vfma(qv[r][j], kv, a[r]);
    }
    for (int r = 0; r < QB; ++r) put(r, s, hsum(a[r]));
  }
}

// o[r][0..D) = sum_s w[r][s] * V[row(s) ..] for QB queries (weights [QB][S]) and D = NV * kLanes: the sums held
// in registers across the rows, each value row read once for all of them.
template <int QB, int NV, typename C, typename Row>
inline void weighted_sum(const float* w, const C* V, const Row& row, int64_t S, float* o) {
  fvec acc[QB][NV] = {};
  for (int64_t s = 0; s < S; ++s) {
    prefetch_row<NV>(V, row, s + 8, S);
    const C* v = V + row(s);
    for (int j = 0; j < NV; ++j) {
      const fvec vv = vload(v + j * kLanes);
      for (int r = 0; r < QB; ++r) acc[r][j] = vfma(fvec{} + w[r * S + s], vv, acc[r][j]);
    }
  }
  std::memcpy(o, acc, sizeof acc);
}

// Scores p[0..S) -> the softmax's unnormalised weights exp(score - max) in place (masked, -inf, or negligible: 0);
// returns 1 / their sum.
inline float softmax_weights(float* p, int64_t S) {
  float m = vmax(p, S);
  if (m == -INFINITY) m = 0.f;  // no visible key (never sent): zeros, not NaNs
  for (int64_t s = 0; s < S; ++s) {
    const float x = p[s] - m;
    p[s] = x < kNegligible ? 0.f : exp_(x);
  }
  const float sum = vsum(p, S);
  return sum > 0.f ? 1.f / sum : 0.f;
}

// One KV head's queries, QB at a time (the rest one by one): scores, softmax, weighted sums.
// q [G][D], mrow [G]; p: [QB][S] scratch; o: [QB][D] scratch; out(g) -> where query g's D outputs go.
template <int QB, int NV, typename T, typename C, typename Row, typename Out>
void attend_head(const float* q, int64_t G, const C* Kc, const C* Vc, const Row& row, int64_t S,
                 const bool* const* mrow, float scale, float* p, float* o, const Out& out) {
  constexpr int64_t D = NV * kLanes;
  int64_t g0 = 0;
  for (; g0 + QB <= G; g0 += QB) {
    scores<QB, NV>(q + g0 * D, Kc, row, S, mrow + g0, scale, p);
    float inv[QB];
    for (int r = 0; r < QB; ++r) inv[r] = softmax_weights(p + r * S, S);
    weighted_sum<QB, NV>(p, Vc, row, S, o);
    for (int r = 0; r < QB; ++r) {
      T* dst = out(g0 + r);
      for (int64_t i = 0; i < D; ++i) dst[i] = st<T>(o[r * D + i] * inv[r]);
    }
  }
  if constexpr (QB > 1)  // the rest one at a time
    if (g0 < G)
      attend_head<1, NV, T>(q + g0 * D, G - g0, Kc, Vc, row, S, mrow + g0, scale, p, o,
                            [&](int64_t g) { return out(g0 + g); });
}

// a[i] += w * b[i] over D floats.
template <typename C>
inline void axpy(float* a, float w, const C* b, int64_t D) {
  const fvec wv = fvec{} + w;
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes) {
    fvec v = vfma(wv, vload(b + i), vload(a + i));
    std::memcpy(a + i, &v, sizeof v);
  }
  for (; i < D; ++i) a[i] += w * ld(b[i]);
}

// The new tokens' K and V (rows H.. and H+KV.. of each token in qkv [T, heads_all, D]) into cache rows:
// write_rows[t] when given, else write_start + t.
template <typename T, typename C>
void write_kv(const T* qkv, C* Kc, C* Vc, const int64_t* write_rows, int64_t write_start, int64_t tokens,
              int64_t heads_all, int64_t H, int64_t KV, int64_t D) {
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t row = write_rows ? write_rows[t] : write_start + t;
    const T* k = qkv + (t * heads_all + H) * D;
    const T* v = k + KV * D;
    C* kd = Kc + row * KV * D;
    C* vd = Vc + row * KV * D;
    for (int64_t i = 0; i < KV * D; ++i) kd[i] = st<C>(ld(k[i]));
    for (int64_t i = 0; i < KV * D; ++i) vd[i] = st<C>(ld(v[i]));
  }
}

// out [B * n, H * D] = softmax(q k^T * scale, masked) v for the queries in qkv [B * n, heads_all, D]; key s of
// sequence b is cache row read_rows[b * S + s] (or read_start + s); mask [B, n, S] (true: attend) or none.
// A task is one (sequence, KV head): its queries (GQA group x new tokens) go in blocks held in registers, each
// block reading the head's key and value rows once, prefetched a few rows ahead (the first block's come from L3
// or memory, the weights streaming past them; later blocks find them in L2).
template <typename T, typename C>
void attention(const T* qkv, const C* Kc, const C* Vc, const int64_t* read_rows, int64_t read_start, int64_t S,
               const bool* mask, int64_t B, int64_t n, int64_t heads_all, int64_t H, int64_t KV, int64_t D, float scale,
               T* out) {
  const int64_t group = H / KV, G = group * n, NV = D % kLanes ? 0 : D / kLanes;  // NV: D in vectors (0: not whole)
  at::parallel_for(0, B * KV, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(G * D), p(4 * S), o(4 * D);
    std::vector<const bool*> mrow(G);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / KV, kvh = bh % KV;
      auto row = [&](int64_t s) { return (read_rows ? read_rows[b * S + s] : read_start + s) * KV * D + kvh * D; };
      auto out_of = [&](int64_t g) { return out + ((b * n + g / group) * H + kvh * group + g % group) * D; };
      for (int64_t g = 0; g < G; ++g) {  // query g: token g / group, head kvh * group + g % group
        const T* src = qkv + ((b * n + g / group) * heads_all + kvh * group + g % group) * D;
        for (int64_t i = 0; i < D; ++i) q[g * D + i] = ld(src[i]);
        mrow[g] = mask ? mask + (b * n + g / group) * S : nullptr;
      }
      // blocks of 4 queries where their sums fit the registers (16 vectors), else 2 or 1
      const bool one = G == 1;
      switch (NV) {
        case 1: one ? attend_head<1, 1, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of)
                    : attend_head<4, 1, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of); break;
        case 2: one ? attend_head<1, 2, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of)
                    : attend_head<4, 2, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of); break;
        case 4: one ? attend_head<1, 4, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of)
                    : attend_head<4, 4, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of); break;
        case 8: attend_head<2, 8, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of); break;
        case 16: attend_head<1, 16, T>(q.data(), G, Kc, Vc, row, S, mrow.data(), scale, p.data(), o.data(), out_of); break;
        default:  // D not a whole number of vectors: one query at a time, plain loops
          for (int64_t g = 0; g < G; ++g) {
            float* pg = p.data();
            for (int64_t s = 0; s < S; ++s)
              pg[s] = !mrow[g] || mrow[g][s] ? dot(q.data() + g * D, Kc + row(s), D) * scale : -INFINITY;
            const float inv = softmax_weights(pg, S);
            std::fill(o.begin(), o.end(), 0.f);
            for (int64_t s = 0; s < S; ++s) axpy(o.data(), pg[s], Vc + row(s), D);
            T* dst = out_of(g);
            for (int64_t i = 0; i < D; ++i) dst[i] = st<T>(o[i] * inv);
          }
      }
    }
  });
}

// The rows of the weights in `parts` (each [out, I], contiguous, checked by the caller) side by side, as W pointers.
template <typename W>
std::vector<const W*> weight_rows(at::TensorList parts, int64_t I) {
  std::vector<const W*> rows;
  for (const Tensor& w : parts) {
    const auto* p = static_cast<const W*>(w.const_data_ptr());
    for (int64_t o = 0; o < w.size(0); ++o) rows.push_back(p + o * I);
  }
  return rows;
}

// Calls f(w, o, nr) for each block of R weight rows, in parallel: w the block's R row pointers (a short last
// block repeats its last row, so kernels always read R), o its first output, nr its real rows.
template <int R, typename W, typename F>
void row_blocks(const std::vector<const W*>& rows, F&& f) {
  const int64_t O = static_cast<int64_t>(rows.size());
  at::parallel_for(0, (O + R - 1) / R, 16, [&](int64_t begin, int64_t end) {
    const W* w[R];
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t o = blk * R;
      const int nr = static_cast<int>(std::min<int64_t>(R, O - o));
      for (int r = 0; r < R; ++r) w[r] = rows[o + std::min(r, nr - 1)];
      f(w, o, nr);
    }
  });
}

// ---- bf16 GEMV for a few rows (AVX-512 BF16), over the model's own row-major weights.
//
// Why: at one token a linear layer is a matrix-vector product bound by reading its weights, and
// oneDNN's pre-packed path has a fixed cost per call that is several times this loop's whole run on a
// small weight (docs/decisions/0009-bf16-gemv-and-amx-tiles.md). From a few rows on oneDNN's AMX
// kernels win (`use_gemv` below); where the CPU has AMX, the tile kernel further down beats both and
// this one serves the weights that have no tiles, and CPUs with AVX-512 BF16 but no AMX (AMD's). The
// weights are the model's own tensors (no copy: its modules hold them), read in place.
// Numerics: products in float32 (VDPBF16PS), summed in float32, the bias added, rounded once to bf16
// (nearest even), as the library's kernels do; only the order of the float32 sum differs.
#if defined(__x86_64__)
#include <immintrin.h>
#define GEMV_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Prefetch distance, in weight rows (16 KB ahead at 512 wide; past a tensor's end it is a hint that never
// faults). At one token the forward streams its weights from memory once, so the loads must be in flight
// early: without the prefetch this loop loses to oneDNN's kernels over the whole forward, with it it wins;
// 8 to 32 rows do alike (docs/decisions/0009-bf16-gemv-and-amx-tiles.md).
constexpr int64_t PF = 16;

// out[t * R + r] = sum_i x[t, i] * w[r][i] for R weight rows and T input rows (both compile-time, so the
// R x T sums stay in registers).
template <int R, int T>
GEMV_TARGET inline void gemv_block(const uint16_t* __restrict x, const uint16_t* const* __restrict w, float* out,
                                   int64_t I) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t i = 0; i < I; i += 32) {
    const __mmask32 m = I - i >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1ull << (I - i)) - 1);
    __m512i wv[R];
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w[r] + PF * I + i), _MM_HINT_T0);
      wv[r] = _mm512_maskz_loadu_epi16(m, w[r] + i);
    }
    for (int t = 0; t < T; ++t) {
      const __m512i xv = _mm512_maskz_loadu_epi16(m, x + t * I + i);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)xv, (__m512bh)wv[r]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) out[t * R + r] = _mm512_reduce_add_ps(acc[r][t]);
}

bool gemv_supported() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512bf16");
  return ok;
}

// y [T, sum of parts' rows] = x [T, I] . concat(parts)^T + b: the parts are the model's own weights
// (q, k, v or gate, up: one fused output without a fused copy of the weights).
template <int R, int T>
void gemv_rows(const uint16_t* x, const std::vector<const uint16_t*>& rows, const c10::BFloat16* b, uint16_t* y,
               int64_t I) {
  const int64_t O = static_cast<int64_t>(rows.size());
  row_blocks<R>(rows, [&](const uint16_t* const* w, int64_t o, int nr) {
    float acc[R * T];
    gemv_block<R, T>(x, w, acc, I);
    for (int t = 0; t < T; ++t)
      for (int r = 0; r < nr; ++r) {
        float v = acc[t * R + r];
        if (b) v += ld(b[o + r]);
        y[t * O + o + r] = st<c10::BFloat16>(v).x;
      }
  });
}

Tensor gemv(const Tensor& x, at::TensorList parts, const Tensor& b) {
  const int64_t T = x.size(0), I = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && T >= 1 && T <= 9, "gemv: x [1..9, in] bf16, got ", x.sizes());
  for (const Tensor& w : parts)
    TORCH_CHECK(w.scalar_type() == at::kBFloat16 && w.is_contiguous() && w.dim() == 2 && w.size(1) == I,
                "gemv: bf16 contiguous [out, ", I, "] weights");
  const std::vector<const uint16_t*> rows = weight_rows<uint16_t>(parts, I);
  TORCH_CHECK(!present(b) || (b.numel() == static_cast<int64_t>(rows.size()) && b.scalar_type() == at::kBFloat16),
              "gemv: a bf16 bias of ", rows.size(), " or none");
  Tensor xc = x.contiguous();
  Tensor y = at::empty({T, static_cast<int64_t>(rows.size())}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const c10::BFloat16* bp = present(b) ? b.const_data_ptr<c10::BFloat16>() : nullptr;
  // weight rows per block: enough independent sums to hide VDPBF16PS's latency, few enough for the registers
  switch (T) {
    case 1: gemv_rows<8, 1>(xp, rows, bp, yp, I); break;
    case 2: gemv_rows<8, 2>(xp, rows, bp, yp, I); break;
    case 3: gemv_rows<8, 3>(xp, rows, bp, yp, I); break;
    case 4: gemv_rows<6, 4>(xp, rows, bp, yp, I); break;
    case 5: gemv_rows<4, 5>(xp, rows, bp, yp, I); break;
    case 6: gemv_rows<4, 6>(xp, rows, bp, yp, I); break;
    case 7: gemv_rows<3, 7>(xp, rows, bp, yp, I); break;
    case 8: gemv_rows<3, 8>(xp, rows, bp, yp, I); break;
    case 9: gemv_rows<2, 9>(xp, rows, bp, yp, I); break;
  }
  return y;
}
#else
bool gemv_supported() { return false; }
Tensor gemv(const Tensor&, at::TensorList, const Tensor&) { TORCH_CHECK(false, "gemv: x86-64 only"); }
#endif

// ---- float32 matmuls of a few rows in FMA vectors, over the model's own row-major weights.
//
// Why: in float32 (the engines' dtype on CPUs without bf16 instructions) every matmul went to at::linear,
// whose BLAS kernels handle a few rows badly: at one row they read the weights below the memory bandwidth, and at
// five rows they take about twice as long as at one, so verifying 4 drafts cost twice a plain step and
// speculation barely paid. Here each weight row is read once per call: blocks of R rows stream through
// (prefetched kFmaAhead rows ahead), each multiplied into up to TC input rows at a time, the R x TC sums in
// registers; further input rows reuse the block from L1. A verification of a few rows then costs far less than
// twice a one-row pass (docs/decisions/0010-float32-fma-kernel.md).
// Numerics: products fused into float32 lane sums, then a fixed tree across lanes and the bias: each output's
// order of summation depends on neither the number of rows nor the block, so a token's logits come out
// the same whether it is verified alone, with drafts or in a batch (the BLAS's order changes with the shape).
//
// The weights may be stored in bf16 (W = c10::BFloat16) where every one of them is a bf16 value (a checkpoint
// saved in bf16 and loaded in float32, as the shipped pair and most Llamas are): widened in registers, exactly,
// so the sums are bit for bit the float32 weights' while the weights read from memory halve. At one row the
// kernel is bound by that read; from about 9 rows on by the arithmetic, where widening costs (see kBf16WeightRows and
// docs/decisions/0010-float32-fma-kernel.md).
#if defined(__FMA__) || defined(__AVX512F__)
bool fma_supported() { return true; }

constexpr int64_t kFmaAhead = 16;  // prefetch distance in weight rows (anywhere from 4 to 64 does alike)
// out[t * R + r] = sum_i x[t, i] * w[r][i] for R weight rows and T input rows (both compile-time, so the
// R x T sums stay in registers).
// (Not inlined, a flat array, loops unrolled: inlined into its caller's switch, or as acc[R][T], GCC stored every
// sum back to the stack each step, and the loop ran at a quarter of its speed.)
template <int R, int T, typename W>
[[gnu::noinline]] void fma_block(const float* __restrict x, const W* const* __restrict w, float* out, int64_t I) {
  fvec acc[R * T];
#pragma GCC unroll 16
  for (int j = 0; j < R * T; ++j) acc[j] = fvec{};
  int64_t i = 0;
  for (; i + 16 <= I; i += 16) {  // a cache line of each row a step (half of one in bf16)
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) __builtin_prefetch(w[r] + kFmaAhead * I + i);
#pragma GCC unroll 2
    for (int u = 0; u < 16; u += kLanes) {
      // the R weight vectors in registers, each input vector loaded once for all of them: with the input
      // vectors read as FMA operands instead, the loop was bound by loads (45 against 85 GFLOP/s in L2, 3 x 4)
      fvec wv[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) wv[r] = vload(w[r] + i + u);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) {
        const fvec xv = vload(x + t * I + i + u);
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) acc[r * T + t] = vfma(xv, wv[r], acc[r * T + t]);
      }
    }
  }
  for (; i + kLanes <= I; i += kLanes) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      const fvec wv = vload(w[r] + i);
#pragma GCC unroll 16
      for (int t = 0; t < T; ++t) acc[r * T + t] = vfma(vload(x + t * I + i), wv, acc[r * T + t]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      float s = hsum(acc[r * T + t]);
      for (int64_t j = i; j < I; ++j) s = std::fma(x[t * I + j], ld(w[r][j]), s);
      out[t * R + r] = s;
    }
}

// y [T, rows] = x [T, I] . rows^T + b, R weight rows a block, input rows in chunks of up to TC.
template <int R, int TC, typename W>
void fma_rows(const float* x, int64_t T, const std::vector<const W*>& rows, const float* b, float* y, int64_t I) {
  const int64_t O = static_cast<int64_t>(rows.size());
  row_blocks<R>(rows, [&](const W* const* w, int64_t o, int nr) {
    float acc[R * TC];
    for (int64_t t0 = 0; t0 < T; t0 += TC) {
      const int tc = static_cast<int>(std::min<int64_t>(TC, T - t0));
      const float* xt = x + t0 * I;
      switch (tc) {  // (cases past TC are never taken; they keep the switch one shape for every TC)
        case 1: fma_block<R, 1>(xt, w, acc, I); break;
        case 2: if constexpr (TC >= 2) fma_block<R, 2>(xt, w, acc, I); break;
        case 3: if constexpr (TC >= 3) fma_block<R, 3>(xt, w, acc, I); break;
        case 4: if constexpr (TC >= 4) fma_block<R, 4>(xt, w, acc, I); break;
        case 5: if constexpr (TC >= 5) fma_block<R, 5>(xt, w, acc, I); break;
        default: if constexpr (TC >= 6) fma_block<R, 6>(xt, w, acc, I); break;
      }
      for (int t = 0; t < tc; ++t)
        for (int r = 0; r < nr; ++r) y[(t0 + t) * O + o + r] = acc[t * R + r] + (b ? b[o + r] : 0.f);
    }
  });
}

// Rows per block: independent sums enough to hide the FMA latency, few enough for the registers (16 of them on
// AVX2, 32 on AVX-512). 5 and 6 input rows go in one pass of fewer weight rows (2 x 5 sums on AVX2): split as
// 4 + 1, the 1-row pass has 3 sums in flight, latency-bound, and costs about as much as the 4-row pass, so one
// pass is faster (docs/decisions/0010-float32-fma-kernel.md).
template <typename W>
void fma_dispatch(const float* xp, int64_t T, const std::vector<const W*>& rows, const float* bp, float* yp, int64_t I) {
  constexpr bool k512 = kLanes == 16;
  switch (T) {
    case 1: fma_rows<8, 1>(xp, T, rows, bp, yp, I); break;
    case 2: fma_rows<k512 ? 6 : 4, 2>(xp, T, rows, bp, yp, I); break;
    case 3: fma_rows<k512 ? 4 : 3, 3>(xp, T, rows, bp, yp, I); break;
    case 5: fma_rows<k512 ? 4 : 2, 5>(xp, T, rows, bp, yp, I); break;
    case 6: fma_rows<k512 ? 4 : 2, 6>(xp, T, rows, bp, yp, I); break;
    default: fma_rows<k512 ? 4 : 3, 4>(xp, T, rows, bp, yp, I); break;
  }
}

Tensor fma_linear(const Tensor& x, at::TensorList parts, const Tensor& b) {
  const int64_t T = x.size(0), I = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && T >= 1, "fma_linear: x [T, in] float32, got ", x.sizes());
  TORCH_CHECK(!parts.empty(), "fma_linear: no weights");
  const at::ScalarType wt = parts[0].scalar_type();
  int64_t O = 0;
  for (const Tensor& w : parts) {
    TORCH_CHECK((wt == at::kFloat || wt == at::kBFloat16) && w.scalar_type() == wt && w.is_contiguous() && w.dim() == 2 &&
                    w.size(1) == I,
                "fma_linear: contiguous [out, ", I, "] weights, all float32 or all bf16");
    O += w.size(0);
  }
  TORCH_CHECK(!present(b) || (b.numel() == O && b.scalar_type() == at::kFloat), "fma_linear: a float32 bias of ", O,
              " or none");
  Tensor xc = x.contiguous();
  Tensor y = at::empty({T, O}, x.options());
  const float* xp = xc.const_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const float* bp = present(b) ? b.const_data_ptr<float>() : nullptr;
  if (wt == at::kBFloat16)
    fma_dispatch(xp, T, weight_rows<c10::BFloat16>(parts, I), bp, yp, I);
  else
    fma_dispatch(xp, T, weight_rows<float>(parts, I), bp, yp, I);
  return y;
}
#else
bool fma_supported() { return false; }
Tensor fma_linear(const Tensor&, at::TensorList, const Tensor&) { TORCH_CHECK(false, "fma_linear: a build with FMA only"); }
#endif

// ---- bf16 matmuls of up to 16 rows on AMX tiles, over weights packed once into tiles.
//
// Why: verifying k drafts is a matmul of k + 1 rows, and it should cost what one row costs (both read
// every weight once; at 9 rows the shipped target's tile work is about a tenth of its weight reading).
// oneDNN's AMX kernels have the arithmetic but not the streaming: over the target's matmuls, weights from
// memory, they take two to three times this loop's time at 1 to 9 rows, and the GEMV above, growing with the
// rows, more than this loop too (docs/decisions/0009-bf16-gemv-and-amx-tiles.md). Each weight is packed once
// into 1 KB tiles, [N/16][K/32][16 k-pairs][16 n][2] (`amx_pack`), read in order with a software prefetch 4
// tiles ahead; one C tile accumulates a block of 16 outputs for all rows. Numerics: products and sums in float32
// (TDPBF16PS), the bias added, one rounding to bf16, as the GEMV.
#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>

bool amx_supported() {
  static const bool ok = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;  // AMX-BF16, AMX-TILE
    // Linux hands out the 8 KB tile state only on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

constexpr int64_t TILE_PF = 4;  // tiles of prefetch distance (4 KB)

#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw")))
// y [T, N] (bf16) = x [T, K] . W^T + b for output blocks [nb0, nb1), W as tiles [NB][KB][16][16][2].
AMX_TARGET void amx_blocks(const uint16_t* x, const uint16_t* tiles, const c10::BFloat16* b, uint16_t* y, int64_t T,
                           int64_t KB, int64_t N, int64_t nb0, int64_t nb1) {
  TileConfig cfg{};
  cfg.palette = 1;
  cfg.rows[0] = static_cast<uint8_t>(T), cfg.colsb[0] = 64;  // tmm0, C: T rows x 16 float32
  cfg.rows[1] = static_cast<uint8_t>(T), cfg.colsb[1] = 64;  // tmm1, A: T rows x 32 bf16 of x
  cfg.rows[2] = 16, cfg.colsb[2] = 64;                       // tmm2, B: 16 k-pairs x 16 outputs x 2
  _tile_loadconfig(&cfg);
  alignas(64) float c[16 * 16];
  const int64_t ldx = KB * 32 * 2;  // bytes per row of x
  for (int64_t nb = nb0; nb < nb1; ++nb) {
    const uint16_t* bt = tiles + nb * KB * 512;
    _tile_zero(0);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const char* pf = reinterpret_cast<const char*>(bt + (kb + TILE_PF) * 512);
      for (int line = 0; line < 1024; line += 64) _mm_prefetch(pf + line, _MM_HINT_T0);
      _tile_loadd(1, x + kb * 32, ldx);
      _tile_loadd(2, bt + kb * 512, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < 16; ++n) {
        float v = c[t * 16 + n];
        if (b) v += ld(b[nb * 16 + n]);
        y[t * N + nb * 16 + n] = st<c10::BFloat16>(v).x;
      }
  }
  _tile_release();
}

Tensor amx_linear(const Tensor& x, const Tensor& tiles, const Tensor& b) {
  const int64_t T = x.size(0), K = x.size(1), NB = tiles.size(0), KB = tiles.size(1), N = NB * 16;
  TORCH_CHECK(amx_supported(), "amx_linear: no AMX here");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && T >= 1 && T <= 16 && K == KB * 32,
              "amx_linear: x [1..16, ", KB * 32, "] bf16, got ", x.sizes());
  TORCH_CHECK(tiles.dim() == 5 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(), "amx_linear: tiles from amx_pack");
  TORCH_CHECK(!present(b) || (b.numel() == N && b.scalar_type() == at::kBFloat16), "amx_linear: a bf16 bias of ", N, " or none");
  Tensor xc = x.contiguous();
  Tensor y = at::empty({T, N}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.const_data_ptr());
  const auto* tp = reinterpret_cast<const uint16_t*>(tiles.const_data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.mutable_data_ptr());
  const c10::BFloat16* bp = present(b) ? b.const_data_ptr<c10::BFloat16>() : nullptr;
  at::parallel_for(0, NB, 8, [&](int64_t nb0, int64_t nb1) { amx_blocks(xp, tp, bp, yp, T, KB, N, nb0, nb1); });
  return y;
}
#else
bool amx_supported() { return false; }
Tensor amx_linear(const Tensor&, const Tensor&, const Tensor&) { TORCH_CHECK(false, "amx_linear: x86-64 Linux only"); }
#endif

// W [N, K] bf16 (N a multiple of 16, K of 32) -> its AMX tiles [N/16][K/32][16 k-pairs][16 n][2].
Tensor amx_pack(const Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % 16 == 0 && w.size(1) % 32 == 0,
              "amx_pack: a bf16 [16n, 32m] weight, got ", w.sizes());
  const int64_t N = w.size(0), K = w.size(1);
  return w.view({N / 16, 16, K / 32, 16, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

// Which matmuls go through the GEMV: up to 3 rows for any weight, up to 8 for small ones (a drafter's). Its
// cost grows by about a fifth of a one-row pass per row (VDPBF16PS per row and weight chunk), while oneDNN's
// AMX kernels barely grow, so they win from 4 rows on (they tie at 4 in the shipped target's forward); on a
// small weight oneDNN's fixed cost per call keeps the GEMV ahead up to 8 rows
// (docs/decisions/0009-bf16-gemv-and-amx-tiles.md).
//
// float32: the FMA kernel up to 64 rows, past which the library's blocked GEMM is the faster: the FMA kernel's
// lead is largest at 5 to 9 rows and shrinks as the rows grow (docs/decisions/0010-float32-fma-kernel.md).
inline bool use_gemv(const Tensor& x, at::TensorList parts) {
  if (!parts.empty() && x.scalar_type() == at::kFloat) return fma_supported() && x.size(0) <= 64;
  if (parts.empty() || !gemv_supported() || x.scalar_type() != at::kBFloat16) return false;
  const int64_t T = x.size(0);
  int64_t elems = 0;
  for (const Tensor& w : parts) elems += w.numel();
  return T <= 3 || (T <= 8 && elems <= 65536);
}

// float32 matmuls of up to this many rows read the bf16 copies of the weights (`parts16`) where there are some:
// up to here a step is bound by reading the weights, and half the bytes make it markedly faster; past it the
// arithmetic bounds it and widening each weight costs more than the bytes save
// (docs/decisions/0010-float32-fma-kernel.md).
constexpr int64_t kBf16WeightRows = 8;

// The layer's matmul: AMX tiles (`tiles`, undefined or empty when off) up to 16 rows, else the bf16 GEMV or the
// float32 FMA kernel over the model's weights (`parts`, empty when off; their exact bf16 copies `parts16` for up
// to kBf16WeightRows rows) for a few rows, else the library's (pre-packed where `packed`).
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b, bool packed, at::TensorList parts = {},
              const Tensor& tiles = Tensor(), at::TensorList parts16 = {}) {
  if (present(tiles) && x.size(0) <= 16 && x.scalar_type() == at::kBFloat16 && amx_supported())
    return amx_linear(x, tiles, b);
  if (!use_gemv(x, parts)) return library_linear(x, w, b, packed);
  if (x.scalar_type() != at::kFloat) return gemv(x, parts, b);
  return fma_linear(x, !parts16.empty() && x.size(0) <= kBf16WeightRows ? parts16 : parts, b);
}

// The forward. input_ids, positions [B, n]; cos/sin tables [max_len, D] in the compute dtype;
// weights: PER_LAYER tensors per layer (see the enum); k_cache/v_cache: per layer [rows, KV, D].
// K/V access (core.kv_cache.KVAccess): with write_rows empty, batch 1 reads and writes views
// (rows write_start.. and read_start..read_start+S); else write_rows [B*n] and read_rows [B, S].
// mask [B, 1, n, S] bool or none; aten_attention: ATen's attention (benchmarks) instead of ours. Returns [logits [B, keep, V], then the residual stream entering
// each layer in `capture` [B, n, hidden]].
std::vector<Tensor> forward(const Tensor& input_ids, const Tensor& positions, const Tensor& embed, const Tensor& cos_t,
                            const Tensor& sin_t, at::TensorList weights, const Tensor& final_norm,
                            const Tensor& lm_head, bool packed, at::TensorList parts, at::TensorList parts16, at::TensorList tiles,
                            at::TensorList k_cache, at::TensorList v_cache,
                            const Tensor& write_rows, const Tensor& read_rows, int64_t write_start, int64_t read_start,
                            int64_t S, const std::optional<Tensor>& mask, int64_t keep, at::IntArrayRef capture,
                            double eps, int64_t H, int64_t KV, int64_t D, bool aten_attention) {
  at::NoGradGuard no_grad;
  const int64_t B = input_ids.size(0), n = input_ids.size(1), T = B * n;
  const int64_t L = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * PER_LAYER, "expected ", L * PER_LAYER, " weights, got ",
              weights.size());
  TORCH_CHECK(parts.empty() || static_cast<int64_t>(parts.size()) == L * PARTS_PER_LAYER + 1, "expected no parts or ",
              L * PARTS_PER_LAYER + 1, ", got ", parts.size());
  TORCH_CHECK(tiles.empty() || static_cast<int64_t>(tiles.size()) == L * TILES_PER_LAYER + 1, "expected no tiles or ",
              L * TILES_PER_LAYER + 1, ", got ", tiles.size());
  auto tile = [&](int64_t l, int64_t i) { return tiles.empty() ? Tensor() : tiles[l * TILES_PER_LAYER + i]; };
  TORCH_CHECK(parts16.empty() || parts16.size() == parts.size(), "expected no bf16 parts or as many as parts");
  // a layer's slice of `parts` or of their bf16 copies `parts16` (empty where the list is)
  auto part = [&](at::TensorList ps, int64_t l, int64_t first, int64_t count) {
    return ps.empty() ? at::TensorList() : ps.slice(l * PARTS_PER_LAYER + first, count);
  };
  const int64_t heads_all = H + 2 * KV;
  const bool rows_mode = present(write_rows);

  // Our attention reads the cache in place where its dtype is one the loops compute (float32 or bf16: the
  // engines' KV dtypes on CPUs) and rows are [rows, KV, D] contiguous, and where it is the faster: always for up to
  // 4 queries per KV head (decoding, drafting), else up to 640 keys. Beyond, ATen's BLAS-backed kernel wins
  // (with 5 to 9 tokens ours is the faster at a hundred keys, level at about 600 and the slower at 900;
  // docs/decisions/0011-attention-in-place.md).
  const at::ScalarType kv_dtype = k_cache[0].scalar_type();
  const int64_t S_read = rows_mode ? read_rows.size(1) : S;
  bool own_attention = !aten_attention && (kv_dtype == at::kFloat || kv_dtype == at::kBFloat16) &&
                       (H / KV * n <= 4 || S_read <= 640);
  for (int64_t l = 0; l < L; ++l)
    own_attention = own_attention && k_cache[l].is_contiguous() && v_cache[l].is_contiguous() &&
                    k_cache[l].scalar_type() == kv_dtype && v_cache[l].scalar_type() == kv_dtype;
  Tensor mask_c;  // [B, 1, n, S_read] bool, contiguous
  if (own_attention && mask.has_value()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool && mask->numel() == B * n * S_read, "decoder: a bool mask [B, 1, n, S]");
    mask_c = mask->contiguous();
  }
  const bool* mask_ptr = mask_c.defined() ? mask_c.const_data_ptr<bool>() : nullptr;
  Tensor read_rows_c = rows_mode ? read_rows.contiguous() : read_rows, write_rows_c = rows_mode ? write_rows.contiguous() : write_rows;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  Tensor x = at::embedding(embed, input_ids.reshape({T}));  // [T, hidden]
  Tensor pos = positions.reshape({T});
  Tensor cos = cos_t.index_select(0, pos), sin = sin_t.index_select(0, pos);  // [T, D]
  std::vector<Tensor> out(1);

  for (int64_t l = 0; l < L; ++l) {
    const Tensor* w = weights.data() + l * PER_LAYER;
    for (int64_t c : capture)
      if (c == l) out.push_back(x.view({B, n, -1}).clone());
    Tensor qkv = linear(rms_norm(x, w[LN1], eps), w[QKV], w[QKV_B], packed, part(parts, l, P_Q, 3), tile(l, T_QKV),
                        part(parts16, l, P_Q, 3)).contiguous();  // [T, heads_all * D]
    on_dtype(x.scalar_type(), [&](auto t) {
      using scalar_t = decltype(t);
      norm_rotate<scalar_t>(qkv.mutable_data_ptr<scalar_t>(), cos.const_data_ptr<scalar_t>(),
                            sin.const_data_ptr<scalar_t>(),
                            present(w[Q_NORM]) ? w[Q_NORM].const_data_ptr<scalar_t>() : nullptr,
                            present(w[K_NORM]) ? w[K_NORM].const_data_ptr<scalar_t>() : nullptr, T, heads_all, H, KV,
                            D, static_cast<float>(eps));
    });
    const Tensor &Kc = k_cache[l], &Vc = v_cache[l];
    Tensor a;  // [T, H * D]
    if (own_attention) {
      a = at::empty({T, H * D}, x.options());
      on_dtype(x.scalar_type(), [&](auto t) {
        using scalar_t = decltype(t);
        on_dtype(Kc.scalar_type(), [&](auto c) {
          using cache_t = decltype(c);
          const scalar_t* q = qkv.const_data_ptr<scalar_t>();
          write_kv<scalar_t, cache_t>(q, Kc.mutable_data_ptr<cache_t>(), Vc.mutable_data_ptr<cache_t>(),
                                      rows_mode ? write_rows_c.const_data_ptr<int64_t>() : nullptr, write_start, T,
                                      heads_all, H, KV, D);
          attention<scalar_t, cache_t>(q, Kc.const_data_ptr<cache_t>(), Vc.const_data_ptr<cache_t>(),
                                       rows_mode ? read_rows_c.const_data_ptr<int64_t>() : nullptr, read_start, S_read,
                                       mask_ptr, B, n, heads_all, H, KV, D, scale, a.mutable_data_ptr<scalar_t>());
        });
      });
    } else {  // ATen's (a cache in another dtype)
      Tensor heads = qkv.view({B, n, heads_all, D});
      Tensor q = heads.narrow(2, 0, H), k = heads.narrow(2, H, KV), v = heads.narrow(2, H + KV, KV);
      Tensor K, V;  // [B, S, KV, D] in the cache's dtype
      if (!rows_mode) {
        Kc.narrow(0, write_start, n).copy_(k[0]);
        Vc.narrow(0, write_start, n).copy_(v[0]);
        K = Kc.narrow(0, read_start, S).unsqueeze(0);
        V = Vc.narrow(0, read_start, S).unsqueeze(0);
      } else {
        Kc.index_copy_(0, write_rows, k.reshape({T, KV, D}).to(Kc.scalar_type()));
        Vc.index_copy_(0, write_rows, v.reshape({T, KV, D}).to(Vc.scalar_type()));
        // index_select on dim 0 copies whole rows (a memcpy each); advanced indexing went element by element
        const Tensor flat = read_rows.reshape({-1});
        K = Kc.index_select(0, flat).view({B, read_rows.size(1), KV, D});
        V = Vc.index_select(0, flat).view({B, read_rows.size(1), KV, D});
      }
      a = at::scaled_dot_product_attention(q.transpose(1, 2).to(Kc.scalar_type()), K.transpose(1, 2),
                                           V.transpose(1, 2), mask, 0.0, false, std::nullopt, KV != H);  // [B, H, n, D]
      a = a.transpose(1, 2).reshape({T, H * D}).to(x.scalar_type());
    }
    x.add_(linear(a, w[O], w[O_B], packed, part(parts, l, P_O, 1), tile(l, T_O), part(parts16, l, P_O, 1)));
    Tensor gu = linear(rms_norm(x, w[LN2], eps), w[GATE_UP], Tensor(), packed, part(parts, l, P_GATE, 2), tile(l, T_GATE_UP),
                       part(parts16, l, P_GATE, 2)).contiguous();  // [T, 2I]
    const int64_t I = gu.size(1) / 2;
    Tensor act = at::empty({T, I}, x.options());
    on_dtype(x.scalar_type(), [&](auto t) {
      using scalar_t = decltype(t);
      silu_mul<scalar_t>(gu.const_data_ptr<scalar_t>(), act.mutable_data_ptr<scalar_t>(), T, I);
    });
    x.add_(linear(act, w[DOWN], Tensor(), packed, part(parts, l, P_DOWN, 1), tile(l, T_DOWN), part(parts16, l, P_DOWN, 1)));
  }
  for (int64_t c : capture)
    if (c == L) out.push_back(x.view({B, n, -1}).clone());
  Tensor last = x.view({B, n, -1}).narrow(1, n - keep, keep).reshape({B * keep, -1}).contiguous();
  out[0] = linear(rms_norm(last, final_norm, eps), lm_head, Tensor(), packed, part(parts, L, 0, 1), tile(L, 0),
                  part(parts16, L, 0, 1)).view({B, keep, -1});
  return out;
}


// An EAGLE-3 head's decoder layers for one new token of one sequence (core/eagle3.py EagleLayer.forward, the
// same arithmetic as its eager ops; the drafter's runner, drafter/eagle3_drafter.py, calls it for each draft
// step of a lone stream, where the eager layer's small ops cost about as much as its matmuls, as in
// docs/decisions/0001-native-forward.md). The first layer
// reads cat(input_layernorm(embedding), hidden_norm(state)) with the normalised or the raw state as its residual
// (norm_before_residual), later layers the residual stream. Per layer l: weights E_* below, its keys the cache
// rows read_start[l] .. read_start[l] + S[l] (row 0 and a sliding window's earlier rows left out by the caller),
// the new K/V written at write_row. Returns [logits [1, V], the state for the next step [1, hidden]: the stream
// before the final norm, or after it with norm_output].
enum { E_LN_IN, E_HIDDEN_NORM, E_QKV, E_Q_NORM, E_K_NORM, E_O, E_LN2, E_GATE_UP, E_DOWN, E_PER_LAYER };

std::vector<Tensor> eagle3_step(const Tensor& input_ids, const Tensor& embed, const Tensor& state, const Tensor& cos,
                                const Tensor& sin, at::TensorList weights, const Tensor& final_norm, const Tensor& lm_head,
                                bool packed, at::TensorList parts, at::TensorList parts16, at::TensorList tiles,
                                at::TensorList k_cache, at::TensorList v_cache, int64_t write_row,
                                at::IntArrayRef read_start, at::IntArrayRef S, bool norm_before_residual, bool norm_output,
                                double eps, int64_t H, int64_t KV, int64_t D) {
  at::NoGradGuard no_grad;
  const int64_t L = static_cast<int64_t>(k_cache.size());
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == L * E_PER_LAYER, "eagle3_step: expected ", L * E_PER_LAYER,
              " weights, got ", weights.size());
  TORCH_CHECK(parts.empty() || static_cast<int64_t>(parts.size()) == L * PARTS_PER_LAYER + 1, "eagle3_step: parts");
  TORCH_CHECK(parts16.empty() || parts16.size() == parts.size(), "eagle3_step: bf16 parts");
  TORCH_CHECK(tiles.empty() || static_cast<int64_t>(tiles.size()) == L * TILES_PER_LAYER + 1, "eagle3_step: tiles");
  TORCH_CHECK(input_ids.numel() == 1 && state.dim() == 2 && state.size(0) == 1, "eagle3_step: one token");
  auto part = [&](at::TensorList ps, int64_t l, int64_t first, int64_t count) {
    return ps.empty() ? at::TensorList() : ps.slice(l * PARTS_PER_LAYER + first, count);
  };
  auto tile = [&](int64_t l, int64_t i) { return tiles.empty() ? Tensor() : tiles[l * TILES_PER_LAYER + i]; };
  const int64_t heads_all = H + 2 * KV;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const Tensor e = at::embedding(embed, input_ids.reshape({1}));  // [1, hidden]
  Tensor h = state.contiguous(), residual;
  for (int64_t l = 0; l < L; ++l) {
    const Tensor* w = weights.data() + l * E_PER_LAYER;
    Tensor x;
    if (l == 0) {
      const Tensor hn = rms_norm(h, w[E_HIDDEN_NORM], eps);
      residual = norm_before_residual ? hn : h.clone();
      x = at::cat({rms_norm(e, w[E_LN_IN], eps), hn}, 1);  // [1, 2 * hidden]
    } else {
      residual.add_(h);
      x = rms_norm(residual, w[E_LN_IN], eps);
    }
    Tensor qkv = linear(x, w[E_QKV], Tensor(), packed, part(parts, l, P_Q, 3), tile(l, T_QKV),
                        part(parts16, l, P_Q, 3)).contiguous();  // [1, heads_all * D]
    const Tensor &Kc = k_cache[l], &Vc = v_cache[l];
    TORCH_CHECK(Kc.is_contiguous() && Vc.is_contiguous() && Kc.scalar_type() == Vc.scalar_type() &&
                (Kc.scalar_type() == at::kFloat || Kc.scalar_type() == at::kBFloat16), "eagle3_step: the KV cache");
    Tensor a = at::empty({1, H * D}, x.options());
    on_dtype(x.scalar_type(), [&](auto t) {
      using scalar_t = decltype(t);
      norm_rotate<scalar_t>(qkv.mutable_data_ptr<scalar_t>(), cos.const_data_ptr<scalar_t>(), sin.const_data_ptr<scalar_t>(),
                            present(w[E_Q_NORM]) ? w[E_Q_NORM].const_data_ptr<scalar_t>() : nullptr,
                            present(w[E_K_NORM]) ? w[E_K_NORM].const_data_ptr<scalar_t>() : nullptr, 1, heads_all, H, KV,
                            D, static_cast<float>(eps));
      on_dtype(Kc.scalar_type(), [&](auto c) {
        using cache_t = decltype(c);
        const scalar_t* q = qkv.const_data_ptr<scalar_t>();
        write_kv<scalar_t, cache_t>(q, Kc.mutable_data_ptr<cache_t>(), Vc.mutable_data_ptr<cache_t>(), nullptr, write_row,
                                    1, heads_all, H, KV, D);
        attention<scalar_t, cache_t>(q, Kc.const_data_ptr<cache_t>(), Vc.const_data_ptr<cache_t>(), nullptr,
                                     read_start[l], S[l], nullptr, 1, 1, heads_all, H, KV, D, scale,
                                     a.mutable_data_ptr<scalar_t>());
      });
    });
    residual.add_(linear(a, w[E_O], Tensor(), packed, part(parts, l, P_O, 1), tile(l, T_O), part(parts16, l, P_O, 1)));
    Tensor gu = linear(rms_norm(residual, w[E_LN2], eps), w[E_GATE_UP], Tensor(), packed, part(parts, l, P_GATE, 2),
                       tile(l, T_GATE_UP), part(parts16, l, P_GATE, 2)).contiguous();  // [1, 2I]
    const int64_t I = gu.size(1) / 2;
    Tensor act = at::empty({1, I}, x.options());
    on_dtype(x.scalar_type(), [&](auto t) {
      using scalar_t = decltype(t);
      silu_mul<scalar_t>(gu.const_data_ptr<scalar_t>(), act.mutable_data_ptr<scalar_t>(), 1, I);
    });
    h = linear(act, w[E_DOWN], Tensor(), packed, part(parts, l, P_DOWN, 1), tile(l, T_DOWN), part(parts16, l, P_DOWN, 1));
  }
  Tensor out = residual.add_(h);
  Tensor normed = rms_norm(out, final_norm, eps);
  Tensor logits = linear(normed, lm_head, Tensor(), packed, part(parts, L, 0, 1), tile(L, 0), part(parts16, L, 0, 1));
  return {logits, norm_output ? normed : out};
}

}  // namespace

// Registered as catch-all kernels: the packed weights are oneDNN tensors, whose dispatch key a CPU-only
// registration would not match.
TORCH_LIBRARY(splitspec, m) {
  m.def(
      "decoder(Tensor input_ids, Tensor positions, Tensor embed, Tensor cos, Tensor sin, Tensor[] weights, "
      "Tensor final_norm, Tensor lm_head, bool packed, Tensor[] parts, Tensor[] parts16, Tensor[] tiles, Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, "
      "Tensor write_rows, Tensor read_rows, int write_start, int read_start, int S, Tensor? mask, int keep, "
      "int[] capture, float eps, int H, int KV, int D, bool aten_attention) -> Tensor[]",
      &forward);
  // one matmul as the forward dispatches it (benchmarks time the layers alone through it)
  m.def("linear(Tensor x, Tensor w, Tensor bias, bool packed, Tensor[] parts, Tensor tiles, Tensor[] parts16) -> Tensor",
        [](const Tensor& x, const Tensor& w, const Tensor& b, bool packed, at::TensorList parts, const Tensor& tiles,
           at::TensorList parts16) {
          return linear(x, w, b, packed, parts, tiles, parts16);
        });
  m.def("gemv(Tensor x, Tensor[] parts, Tensor bias) -> Tensor", &gemv);
  m.def("gemv_supported() -> bool", []() { return gemv_supported(); });
  m.def("fma_linear(Tensor x, Tensor[] parts, Tensor bias) -> Tensor", &fma_linear);
  m.def("fma_supported() -> bool", []() { return fma_supported(); });
  m.def("amx_linear(Tensor x, Tensor tiles, Tensor bias) -> Tensor", &amx_linear);
  m.def("amx_pack(Tensor w) -> Tensor", &amx_pack);
  m.def("amx_supported() -> bool", []() { return amx_supported(); });
  m.def(
      "eagle3_step(Tensor input_ids, Tensor embed, Tensor state, Tensor cos, Tensor sin, Tensor[] weights, "
      "Tensor final_norm, Tensor lm_head, bool packed, Tensor[] parts, Tensor[] parts16, Tensor[] tiles, "
      "Tensor(a!)[] k_cache, Tensor(b!)[] v_cache, int write_row, int[] read_start, int[] S, bool norm_before_residual, "
      "bool norm_output, float eps, int H, int KV, int D) -> Tensor[]",
      &eagle3_step);
}

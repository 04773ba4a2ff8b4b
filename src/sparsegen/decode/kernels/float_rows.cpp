// The fp32 product of a decode step's few rows with a linear layer's weight, streamed once.
//
// With 2 to 16 rows, MKL's sgemm (either way round) reads the weight at a third of the memory
// bus's speed on these CPUs (docs/benchmarks.md, "the server's batched step"). Here each thread
// takes a range of output features; for a tile of kOutputs weight rows it sums their dot products
// with up to kRows input rows at once, in vector registers, the input rows tile by tile while the
// tile's weight rows stay in L1: the weight is read from memory once for all the rows.
//
//   x [rows, in] fp32, weight [out, in] fp32 (nn.Linear's layout) -> [rows, out] fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kOutputs = 6;  // 24 accumulators, 6 weight vectors and an input one: 31 of 32 registers
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float total(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kOutputs = 2;  // 8 accumulators of 16 registers
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float total(Vec v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#else
#define SPARSEGEN_PLAIN 1
constexpr int kOutputs = 1;
#endif

namespace {

constexpr int kRows = 4;

// out[r][o] for outputs [o0, o0 + kO) and rows [r0, r0 + kR).
template <int kO, int kR>
void tile(const float* x, const float* w, int64_t in, int64_t out_features, int64_t o0, int64_t r0, float* out) {
#ifdef SPARSEGEN_PLAIN
  for (int i = 0; i < kO; ++i)
    for (int k = 0; k < kR; ++k) {
      float sum = 0.f;
      for (int64_t j = 0; j < in; ++j) sum += w[(o0 + i) * in + j] * x[(r0 + k) * in + j];
      out[(r0 + k) * out_features + o0 + i] = sum;
    }
#else
  Vec acc[kO][kR];
  for (int i = 0; i < kO; ++i)
    for (int k = 0; k < kR; ++k) acc[i][k] = zero();
  const int64_t whole = in - in % kLanes;
  for (int64_t j = 0; j < whole; j += kLanes) {
    Vec wv[kO];
#pragma GCC unroll 8
    for (int i = 0; i < kO; ++i) {
      wv[i] = load(w + (o0 + i) * in + j);
      // the next tile's rows, on the first input tile only, into L2 (into L1 they came 15-20%
      // slower here: docs/benchmarks.md); past the weight's end on the last tile: a prefetch is a
      // hint and never faults
      if (r0 == 0) _mm_prefetch(reinterpret_cast<const char*>(w + (o0 + kO + i) * in + j), _MM_HINT_T1);
    }
#pragma GCC unroll 8
    for (int k = 0; k < kR; ++k) {
      const Vec xv = load(x + (r0 + k) * in + j);
#pragma GCC unroll 8
      for (int i = 0; i < kO; ++i) acc[i][k] = fma(wv[i], xv, acc[i][k]);
    }
  }
  for (int i = 0; i < kO; ++i)
    for (int k = 0; k < kR; ++k) {
      float sum = total(acc[i][k]);
      for (int64_t j = whole; j < in; ++j) sum += w[(o0 + i) * in + j] * x[(r0 + k) * in + j];
      out[(r0 + k) * out_features + o0 + i] = sum;
    }
#endif
}

template <int kO>
void outputs(const float* x, const float* w, int64_t rows, int64_t in, int64_t out_features, int64_t o0, float* out) {
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {  // the kO weight rows stay in L1 across row tiles
    switch (std::min<int64_t>(kRows, rows - r0)) {
      case 1: tile<kO, 1>(x, w, in, out_features, o0, r0, out); break;
      case 2: tile<kO, 2>(x, w, in, out_features, o0, r0, out); break;
      case 3: tile<kO, 3>(x, w, in, out_features, o0, r0, out); break;
      default: tile<kO, kRows>(x, w, in, out_features, o0, r0, out); break;
    }
  }
}

}  // namespace

torch::Tensor float_rows_linear(torch::Tensor x, torch::Tensor weight) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "float_rows_linear: x must be fp32 [rows, in], contiguous");
  TORCH_CHECK(weight.scalar_type() == torch::kFloat && weight.dim() == 2 && weight.is_contiguous() &&
                  weight.size(1) == x.size(1),
              "float_rows_linear: weight must be fp32 [out, in], contiguous, with x's in");
  const int64_t rows = x.size(0), in = x.size(1), out_features = weight.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t tiles = out_features / kOutputs;
  at::parallel_for(0, tiles, 8, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) outputs<kOutputs>(xp, wp, rows, in, out_features, t * kOutputs, op);
  });
  for (int64_t o = tiles * kOutputs; o < out_features; ++o) outputs<1>(xp, wp, rows, in, out_features, o, op);
  return out;
}

// The shape alone, for tracing: a compiled step keeps the op as one opaque call, for any row count.
torch::Tensor float_rows_linear_meta(torch::Tensor x, torch::Tensor weight) {
  return at::empty_symint({x.sym_size(0), weight.sym_size(0)}, x.options());
}

// Registered with the dispatcher from C++, so a call costs no Python.
TORCH_LIBRARY_FRAGMENT(sparsegen, m) { m.def("float_rows_linear(Tensor x, Tensor weight) -> Tensor"); }
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) { m.impl("float_rows_linear", &float_rows_linear); }
TORCH_LIBRARY_IMPL(sparsegen, Meta, m) { m.impl("float_rows_linear", &float_rows_linear_meta); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

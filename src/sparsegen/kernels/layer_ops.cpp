// A decoder layer's elementwise work, one pass each, for the eager forwards of a prompt read.
//
// In bf16 a Llama-style RMSNorm is seven of PyTorch's kernels (widen to fp32, square, mean, add,
// rsqrt, multiply, round back, times the weight) and the MLP's SiLU-times-up two, each a pass over
// the rows with fp32 intermediates: on a 2-core Zen 4 a 512-token read of the default model spent a
// third of its time outside its GEMMs (docs/benchmarks.md). Here each is one pass over the row,
// rounding where the model's own forward rounds, so the values are its values (up to the order of
// a row's sum of squares and an exp within 2 ulp):
//
//   rms_norm(x [..., d], weight [d], eps) = weight * round(x * rsqrt(mean(x^2) + eps))
//   silu_mul(gate [..., d], up [..., d]) = round(round(silu(gate)) * up)
// where round is to x's dtype (bf16, or nothing for fp32) and the weight has x's dtype.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "bf16_bits.h"
#include "float_lanes.h"

namespace {

// A row of fp32 or bf16 numbers, eight at a time (AVX2) and one at a time.
struct Floats {
  using Element = float;
  static float get(const float* p) { return *p; }
  static float kept(float value) { return value; }  // fp32 rounds nothing more
  static void put(float* p, float value) { *p = value; }
#ifdef SPARSEGEN_AVX2
  static __m256 get8(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 kept8(__m256 value) { return value; }
  static void put8(float* p, __m256 value) { _mm256_storeu_ps(p, value); }
#endif
};

struct Bf16 {
  using Element = uint16_t;
  static float get(const uint16_t* p) { return bf16_bits::widen(*p); }
  static float kept(float value) { return bf16_bits::widen(bf16_bits::narrow(value)); }
  static void put(uint16_t* p, float value) { *p = bf16_bits::narrow(value); }
#ifdef SPARSEGEN_AVX2
  static __m256 get8(const uint16_t* p) { return bf16_bits::widen8(p); }
  static __m256 kept8(__m256 value) { return bf16_bits::round8(value); }
  static void put8(uint16_t* p, __m256 value) { bf16_bits::narrow8(p, value); }
#endif
};

template <typename T>
float sum_of_squares(const typename T::Element* x, int64_t d) {
  float total = 0.f;
  int64_t c = 0;
#ifdef SPARSEGEN_AVX2
  __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
  for (; c + 16 <= d; c += 16) {
    const __m256 a = T::get8(x + c), b = T::get8(x + c + 8);
    even = _mm256_fmadd_ps(a, a, even);
    odd = _mm256_fmadd_ps(b, b, odd);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(even, odd));
  for (float lane : lanes) total += lane;
#endif
  for (; c < d; ++c) total += T::get(x + c) * T::get(x + c);
  return total;
}

template <typename T>
void norm_row(const typename T::Element* x, const typename T::Element* weight, float eps, int64_t d,
              typename T::Element* out) {
  const float inverse = 1.f / std::sqrt(sum_of_squares<T>(x, d) / static_cast<float>(d) + eps);
  int64_t c = 0;
#ifdef SPARSEGEN_AVX2
  const __m256 scale = _mm256_set1_ps(inverse);
  for (; c + 8 <= d; c += 8)
    T::put8(out + c, _mm256_mul_ps(T::get8(weight + c), T::kept8(_mm256_mul_ps(T::get8(x + c), scale))));
#endif
  for (; c < d; ++c) T::put(out + c, T::get(weight + c) * T::kept(T::get(x + c) * inverse));
}

template <typename T>
void silu_mul_row(const typename T::Element* gate, const typename T::Element* up, int64_t d,
                  typename T::Element* out) {
  int64_t c = 0;
#ifdef SPARSEGEN_AVX2
  const __m256 one = _mm256_set1_ps(1.f), low = _mm256_set1_ps(-87.3f), high = _mm256_set1_ps(88.f);
  for (; c + 8 <= d; c += 8) {
    const __m256 g = T::get8(gate + c);
    const __m256 e = lanes::exp8(_mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), g), low), high));
    const __m256 silu = T::kept8(_mm256_div_ps(g, _mm256_add_ps(one, e)));
    T::put8(out + c, _mm256_mul_ps(silu, T::get8(up + c)));
  }
#endif
  for (; c < d; ++c) {
    const float g = T::get(gate + c);
    T::put(out + c, T::kept(g / (1.f + std::exp(-g))) * T::get(up + c));
  }
}

// Rows of d numbers shared among the threads, a few thousand numbers at least to a task.
template <typename Row>
void each_row(int64_t rows, int64_t d, Row row) {
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(d, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) row(r);
  });
}

template <typename T>
typename T::Element* elements(const torch::Tensor& t) {
  return reinterpret_cast<typename T::Element*>(t.data_ptr());
}

template <typename T>
torch::Tensor rms_norm_as(const torch::Tensor& x, const torch::Tensor& weight, float eps) {
  const int64_t d = x.size(-1), rows = x.numel() / std::max<int64_t>(d, 1);
  auto out = torch::empty_like(x);
  const auto *from = elements<T>(x), *w = elements<T>(weight);
  auto* to = elements<T>(out);
  each_row(rows, d, [&](int64_t r) { norm_row<T>(from + r * d, w, eps, d, to + r * d); });
  return out;
}

template <typename T>
torch::Tensor silu_mul_as(const torch::Tensor& gate, const torch::Tensor& up) {
  const int64_t d = gate.size(-1), rows = gate.numel() / std::max<int64_t>(d, 1);
  auto out = torch::empty_like(gate);
  const auto *g = elements<T>(gate), *u = elements<T>(up);
  auto* to = elements<T>(out);
  each_row(rows, d, [&](int64_t r) { silu_mul_row<T>(g + r * d, u + r * d, d, to + r * d); });
  return out;
}

bool float_or_bf16(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(float_or_bf16(x) && weight.scalar_type() == x.scalar_type() && x.dim() >= 1 && weight.dim() == 1 &&
                  weight.size(0) == x.size(-1),
              "rms_norm: x [..., d] fp32 or bf16, weight [d] of x's dtype");
  const auto rows = x.contiguous(), w = weight.contiguous();
  if (x.scalar_type() == torch::kBFloat16) return rms_norm_as<Bf16>(rows, w, static_cast<float>(eps));
  return rms_norm_as<Floats>(rows, w, static_cast<float>(eps));
}

torch::Tensor silu_mul(torch::Tensor gate, torch::Tensor up) {
  TORCH_CHECK(float_or_bf16(gate) && up.scalar_type() == gate.scalar_type() && gate.sizes() == up.sizes(),
              "silu_mul: gate and up of one shape, both fp32 or both bf16");
  const auto g = gate.contiguous(), u = up.contiguous();
  if (gate.scalar_type() == torch::kBFloat16) return silu_mul_as<Bf16>(g, u);
  return silu_mul_as<Floats>(g, u);
}

TORCH_LIBRARY_FRAGMENT(sparsegen, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate, Tensor up) -> Tensor");
}
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("silu_mul", &silu_mul);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

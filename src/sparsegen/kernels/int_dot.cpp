// A linear layer with 4-bit weights whose products are integer dot products: each row of the input
// is rounded to int8 in blocks of 32 (one fp32 step per block) inside the op, and each block's
// 32 weight nibbles times 32 input bytes are summed as integers (vpmaddubsw + vpmaddwd on AVX2,
// vpdpbusd with AVX-512 VNNI), then scaled once per block. The idea is llama.cpp's q4 x q8 dot;
// the layout is sparsegen's own (sparsegen/quant/int_dot.py repacks a checkpoint's grid into it):
//
//   nibbles [out, in / 2] uint8: per block of 32 inputs, 16 bytes; byte j holds input j in its low
//            nibble and input j + 16 in its high one, each an unsigned code u in 0..15;
//   scales, mins [out, in / 32] fp32: the weight is u * scale - min.
//
// For input row r and output o: sum over blocks b of step_rb * (scale_ob * sum_j u_j a_rj - min_ob * A_rb),
// with a the int8 codes, step the block's fp32 step and A the sum of its codes.
//
// int8_linear does the same for 8-bit weights (a tied head's, as llama.cpp's Q8_0): codes [out, in]
// int8 in input order and scales [out, in / 32] fp32, the weight q * scale. The byte products take
// an unsigned operand, so each block multiplies |q| by a * sign(q) (vpsignb), which is exact.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "int8_blocks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kRowsAtOnce = 4;

struct RoundedRows {  // the input rows in int8, per block: the step and step * sum of codes
  std::vector<int8_t> codes;
  std::vector<float> step, step_times_sum;
};

RoundedRows round_rows(const float* x, int64_t rows, int64_t in) {
  const int64_t blocks = in / kBlock;
  RoundedRows r{std::vector<int8_t>(rows * in), std::vector<float>(rows * blocks),
                std::vector<float>(rows * blocks)};
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const float* from = x + i * kBlock;
    float largest = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) largest = std::max(largest, std::fabs(from[j]));
    const float step = largest / 127.f, inverse = largest > 0.f ? 127.f / largest : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t code = static_cast<int32_t>(std::nearbyint(from[j] * inverse));
      r.codes[i * kBlock + j] = static_cast<int8_t>(code);
      sum += code;
    }
    r.step[i] = step;
    r.step_times_sum[i] = step * static_cast<float>(sum);
  }
  return r;
}

#ifdef SPARSEGEN_AVX2
inline __m256 block_dot(__m256i u, const int8_t* a) {
  return block_dot_codes(u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
}

// Eight partial sums of q . a over one block of signed weights, as floats.
inline __m256 signed_block_dot(__m256i q, const int8_t* a) {
  return signed_block_dot_codes(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
}
#endif

inline float dot_floats(const float* a, const float* b, int64_t n) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

#ifdef SPARSEGEN_AVX2
// One block's contribution for each of kRows input rows: acc[k] += (w . a_k) * scale * step_k, with
// w the block's unsigned codes (int4) or signed ones (int8).
template <int kRows, bool kSigned>
inline void add_block(const RoundedRows& r, __m256i w, float scale, int64_t first_block, int64_t blocks,
                      __m256* acc) {
  for (int k = 0; k < kRows; ++k) {  // unrolled: kRows is known, so acc stays in registers
    const int64_t rb = first_block + k * blocks;
    const __m256 factor = _mm256_set1_ps(scale * r.step[rb]);
    const int8_t* a = r.codes.data() + rb * kBlock;
    acc[k] = _mm256_fmadd_ps(kSigned ? signed_block_dot(w, a) : block_dot(w, a), factor, acc[k]);
  }
}

template <bool kSigned>
inline __m256i load_block(const uint8_t* w, int64_t b) {
  if (kSigned) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * kBlock));
  return weight_block(w + b * kBlock / 2);
}

template <int kRows, bool kSigned>
void products(const RoundedRows& r, const uint8_t* w, const float* scale, int64_t row0, int64_t blocks,
              float* result) {
  // two accumulators a row (even and odd blocks), so consecutive blocks do not wait on each other
  __m256 even[kRows], odd[kRows];
  for (int k = 0; k < kRows; ++k) even[k] = odd[k] = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 1 < blocks; b += 2) {
    add_block<kRows, kSigned>(r, load_block<kSigned>(w, b), scale[b], row0 * blocks + b, blocks, even);
    add_block<kRows, kSigned>(r, load_block<kSigned>(w, b + 1), scale[b + 1], row0 * blocks + b + 1, blocks, odd);
  }
  if (b < blocks) add_block<kRows, kSigned>(r, load_block<kSigned>(w, b), scale[b], row0 * blocks + b, blocks, even);
  for (int k = 0; k < kRows; ++k) result[k] += sum256(_mm256_add_ps(even[k], odd[k]));
}
#endif

// The integer sum of one block's weights times one row's codes, without vector instructions.
template <bool kSigned>
inline int32_t plain_block_dot(const uint8_t* w, const int8_t* a) {
  int32_t dot = 0;
  if (kSigned) {
    for (int64_t j = 0; j < kBlock; ++j) dot += static_cast<int8_t>(w[j]) * a[j];
  } else {
    for (int64_t j = 0; j < kBlock / 2; ++j) dot += (w[j] & 15) * a[j] + (w[j] >> 4) * a[j + kBlock / 2];
  }
  return dot;
}

// Outputs [first, last) for input rows [row0, row0 + count), count <= kRowsAtOnce; `mins` is null
// for signed (int8) weights.
template <bool kSigned>
void output_range(const RoundedRows& r, const uint8_t* weights, const float* scales, const float* mins,
                  int64_t in, int64_t out_features, int64_t row0, int64_t count, int64_t first, int64_t last,
                  float* out) {
  const int64_t blocks = in / kBlock, row_bytes = kSigned ? in : in / 2;
  for (int64_t o = first; o < last; ++o) {
    const uint8_t* w = weights + o * row_bytes;
    const float* scale = scales + o * blocks;
    float result[kRowsAtOnce];
    for (int64_t k = 0; k < count; ++k)  // the minimum's share: one dot product a row, vectorized
      result[k] = kSigned ? 0.f : -dot_floats(mins + o * blocks, r.step_times_sum.data() + (row0 + k) * blocks, blocks);
#ifdef SPARSEGEN_AVX2
    switch (count) {
      case 1: products<1, kSigned>(r, w, scale, row0, blocks, result); break;
      case 2: products<2, kSigned>(r, w, scale, row0, blocks, result); break;
      case 3: products<3, kSigned>(r, w, scale, row0, blocks, result); break;
      default: products<4, kSigned>(r, w, scale, row0, blocks, result); break;
    }
#else
    for (int64_t b = 0; b < blocks; ++b) {
      for (int64_t k = 0; k < count; ++k) {
        const int64_t rb = (row0 + k) * blocks + b;
        const int32_t dot = plain_block_dot<kSigned>(w + b * row_bytes / blocks, r.codes.data() + rb * kBlock);
        result[k] += scale[b] * r.step[rb] * dot;
      }
    }
#endif
    for (int64_t k = 0; k < count; ++k) out[(row0 + k) * out_features + o] = result[k];
  }
}

template <bool kSigned>
torch::Tensor integer_linear(const torch::Tensor& x, const uint8_t* w, const float* s, const float* m,
                             int64_t out_features) {
  const int64_t rows = x.size(0), in = x.size(1);
  const RoundedRows r = round_rows(x.data_ptr<float>(), rows, in);
  auto out = torch::empty({rows, out_features}, x.options());
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    for (int64_t row0 = 0; row0 < rows; row0 += kRowsAtOnce)
      output_range<kSigned>(r, w, s, m, in, out_features, row0, std::min(kRowsAtOnce, rows - row0), first, last, o);
  });
  return out;
}

}  // namespace

// x [rows, in] fp32 -> [rows, out] fp32.
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor nibbles, torch::Tensor scales, torch::Tensor mins) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(), "int4_linear: fp32 [rows, in]");
  const int64_t in = x.size(1), out_features = nibbles.size(0);
  TORCH_CHECK(in % kBlock == 0 && nibbles.size(1) * 2 == in && nibbles.scalar_type() == torch::kUInt8 &&
                  nibbles.is_contiguous(),
              "int4_linear: nibbles [out, in / 2] uint8 with in a multiple of 32");
  TORCH_CHECK(scales.is_contiguous() && mins.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  mins.scalar_type() == torch::kFloat && scales.numel() == out_features * in / kBlock &&
                  mins.numel() == scales.numel(),
              "int4_linear: fp32 scales and mins [out, in / 32]");
  return integer_linear<false>(x, nibbles.data_ptr<uint8_t>(), scales.data_ptr<float>(), mins.data_ptr<float>(),
                               out_features);
}

// x [rows, in] fp32 times int8 codes [out, in] with fp32 scales [out, in / 32] -> [rows, out] fp32.
torch::Tensor int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(), "int8_linear: fp32 [rows, in]");
  const int64_t in = x.size(1), out_features = codes.size(0);
  TORCH_CHECK(in % kBlock == 0 && codes.size(1) == in && codes.scalar_type() == torch::kChar && codes.is_contiguous(),
              "int8_linear: codes [out, in] int8 with in a multiple of 32");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat &&
                  scales.numel() == out_features * in / kBlock,
              "int8_linear: fp32 scales [out, in / 32]");
  const auto* w = reinterpret_cast<const uint8_t*>(codes.data_ptr<int8_t>());
  return integer_linear<true>(x, w, scales.data_ptr<float>(), nullptr, out_features);
}

// The shape alone, for tracing: a compiled step keeps the op as one opaque call.
torch::Tensor int4_linear_meta(torch::Tensor x, torch::Tensor nibbles, torch::Tensor scales, torch::Tensor mins) {
  return at::empty_symint({x.sym_size(0), nibbles.sym_size(0)}, x.options());  // symbolic rows: one graph for any count
}

torch::Tensor int8_linear_meta(torch::Tensor x, torch::Tensor codes, torch::Tensor scales) {
  return at::empty_symint({x.sym_size(0), codes.sym_size(0)}, x.options());
}

// Registered with the dispatcher from C++, so a call costs no Python.
TORCH_LIBRARY_FRAGMENT(sparsegen, m) {
  m.def("int4_linear(Tensor x, Tensor nibbles, Tensor scales, Tensor mins) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor codes, Tensor scales) -> Tensor");
}
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int8_linear", &int8_linear);
}
TORCH_LIBRARY_IMPL(sparsegen, Meta, m) {
  m.impl("int4_linear", &int4_linear_meta);
  m.impl("int8_linear", &int8_linear_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

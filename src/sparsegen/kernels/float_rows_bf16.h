// The few-row product over bf16 weights: what float_rows.cpp does for fp32, for a model loaded in bf16.
//
// oneDNN's bf16 GEMM reads the weight at half the memory bus's speed or less from 2 to 32 rows on
// these CPUs (docs/benchmarks.md, "bf16 weights in the server's batched step"). The weight is packed
// once into panels of kWidth output features, input pair by input pair ([panels][in / 2][kWidth][2]):
// a vector of the panel's line holds the two weights of an input pair for kLanes outputs, which is
// the operand order of AVX512-BF16's `vdpbf16ps`. With those instructions one of them multiplies
// the pair by the row's two inputs (broadcast as one 32-bit word) and adds both products; without
// them (AVX-512F or AVX2 alone) the pair is split into two fp32 vectors, shifted into place, and
// two FMAs do the same. The products of two bf16 values are exact in fp32; the sums are fp32, in
// blocks of kPairBlock pairs added into the output (a bounded rounding error, as a blocked sum).
// A row's result never depends on the other rows in the call.
#pragma once

#include <cstdint>
#include <vector>

#include "bf16_bits.h"

namespace bf16_rows {

constexpr int64_t kPairBlock = 32;

using bf16_bits::narrow;
using bf16_bits::widen;

#ifdef SPARSEGEN_PLAIN
template <int kR>
void tile(const uint32_t* x, const uint16_t* panel, int64_t pairs, int64_t r0, bool, float* sums) {
  std::fill(sums, sums + kR * kWidth, 0.f);
  for (int64_t b = 0; b < pairs; b += kPairBlock) {
    float part[kR][kWidth] = {};
    for (int64_t j = b; j < std::min(pairs, b + kPairBlock); ++j)
      for (int r = 0; r < kR; ++r) {
        const uint32_t both = x[(r0 + r) * pairs + j];
        const float x0 = widen(static_cast<uint16_t>(both)), x1 = widen(static_cast<uint16_t>(both >> 16));
        for (int64_t o = 0; o < kWidth; ++o)
          part[r][o] += widen(panel[(j * kWidth + o) * 2]) * x0 + widen(panel[(j * kWidth + o) * 2 + 1]) * x1;
      }
    for (int r = 0; r < kR; ++r)
      for (int64_t o = 0; o < kWidth; ++o) sums[r * kWidth + o] += part[r][o];
  }
}
#else
#if defined(__AVX512F__)
using Bits = __m512i;
inline Bits load_bits(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline Bits broadcast_bits(uint32_t v) { return _mm512_set1_epi32(static_cast<int>(v)); }
inline Vec low_half(Bits v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline Vec high_half(Bits v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))); }
#else
using Bits = __m256i;
inline Bits load_bits(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline Bits broadcast_bits(uint32_t v) { return _mm256_set1_epi32(static_cast<int>(v)); }
inline Vec low_half(Bits v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline Vec high_half(Bits v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536))); }
#endif

// acc += the pairs of `weights` times the input pair `inputs` (both bf16 pairs in 32-bit words).
inline Vec pair_product(Vec acc, Bits weights, Bits inputs) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return _mm512_dpbf16_ps(acc, (__m512bh)weights, (__m512bh)inputs);
#else
  acc = fma(low_half(weights), low_half(inputs), acc);
  return fma(high_half(weights), high_half(inputs), acc);
#endif
}

// sums[r][0, kWidth) = x[r0 + r, :] . panel for rows [r0, r0 + kR); x as bf16 pairs in 32-bit words.
template <int kR>
void tile(const uint32_t* x, const uint16_t* panel, int64_t pairs, int64_t r0, bool prefetch, float* sums) {
  for (int64_t b = 0; b < pairs; b += kPairBlock) {
    Vec acc[kR][kVectors];
    for (int r = 0; r < kR; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v] = zero();
    for (int64_t j = b; j < std::min(pairs, b + kPairBlock); ++j) {
      const uint16_t* w = panel + j * kWidth * 2;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + 2 * kPrefetch), _MM_HINT_T0);
      Bits wv[kVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) wv[v] = load_bits(w + v * kLanes * 2);
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) {
        const Bits xv = broadcast_bits(x[(r0 + r) * pairs + j]);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = pair_product(acc[r][v], wv[v], xv);
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int v = 0; v < kVectors; ++v) {
        float* s = sums + r * kWidth + v * kLanes;
        store(s, b == 0 ? acc[r][v] : add(load(s), acc[r][v]));
      }
  }
}
#endif

struct PairTile {
  template <int kR>
  static void run(const uint32_t* x, const uint16_t* panel, int64_t pairs, int64_t r0, bool prefetch, float* sums) {
    tile<kR>(x, panel, pairs, r0, prefetch, sums);
  }
  static uint16_t store(float sum) { return narrow(sum); }
};

// The rows of x [rows, in] (bf16 bits) as input pairs in 32-bit words, an odd `in` padded with a zero.
inline std::vector<uint32_t> input_pairs(const uint16_t* x, int64_t rows, int64_t in) {
  const int64_t pairs = (in + 1) / 2;
  std::vector<uint32_t> out(rows * pairs);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < pairs; ++j) {
      const uint32_t second = 2 * j + 1 < in ? x[r * in + 2 * j + 1] : 0;
      out[r * pairs + j] = x[r * in + 2 * j] | (second << 16);
    }
  return out;
}

// weight [out, in] (bf16 bits) -> [panels][pairs][kWidth][2], zero padded.
inline void pack(const uint16_t* from, int64_t out_features, int64_t in, uint16_t* to) {
  const int64_t pairs = (in + 1) / 2, panels = (out_features + kWidth - 1) / kWidth;
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t j = 0; j < pairs; ++j)
        for (int64_t o = 0; o < kWidth; ++o)
          for (int64_t h = 0; h < 2; ++h) {
            const int64_t row = p * kWidth + o, column = 2 * j + h;
            to[((p * pairs + j) * kWidth + o) * 2 + h] = row < out_features && column < in ? from[row * in + column] : 0;
          }
  });
}

}  // namespace bf16_rows

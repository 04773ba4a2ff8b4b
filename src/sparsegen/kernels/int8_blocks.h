// The integer-dot pieces int_dot.cpp and sparse_mlp.cpp share (each includes this header once, in
// its translation unit): the AVX2 / VNNI feature macros, the block of 32, a block of int4 nibbles
// as 32 unsigned codes (int_dot.cpp's layout), and the products of a block of codes with 32 int8
// codes (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with AVX-512 VNNI) as eight fp32 partial sums.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SPARSEGEN_AVX2 1
#endif
#if defined(SPARSEGEN_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define SPARSEGEN_VNNI 1
#endif

#include <cstdint>

namespace {

constexpr int64_t kBlock = 32;

#ifdef SPARSEGEN_AVX2
// The 32 codes of one weight block, in input order, as unsigned bytes.
inline __m256i weight_block(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1);
  return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

// Eight partial sums of u . codes over one block (u unsigned, codes signed), as floats.
inline __m256 block_dot_codes(__m256i u, __m256i codes) {
#ifdef SPARSEGEN_VNNI
  const __m256i sums = _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, codes);
#else
  const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(u, codes), _mm256_set1_epi16(1));
#endif
  return _mm256_cvtepi32_ps(sums);
}

// Eight partial sums of q . codes over one block of signed weights: the byte products take an
// unsigned operand, so |q| times codes * sign(q) (vpsignb), which is exact.
inline __m256 signed_block_dot_codes(__m256i q, __m256i codes) {
  return block_dot_codes(_mm256_sign_epi8(q, q), _mm256_sign_epi8(codes, q));
}

inline float sum256(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

}  // namespace

// bf16 numbers as their 16 bits: widened to fp32 exactly, and fp32 rounded to them as torch rounds
// (to nearest even, a NaN kept a NaN), one at a time and, with AVX2, eight at a time.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace bf16_bits {

inline float widen(uint16_t bits) {
  const uint32_t word = static_cast<uint32_t>(bits) << 16;
  float value;
  std::memcpy(&value, &word, 4);
  return value;
}

inline uint16_t narrow(float value) {
  uint32_t word;
  std::memcpy(&word, &value, 4);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);
  return static_cast<uint16_t>((word + 0x7fffu + ((word >> 16) & 1u)) >> 16);
}

#if defined(__AVX2__)
inline __m256 widen8(const uint16_t* p) {
  const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
}

// `narrow` for eight lanes, still widened (the low half of each word zero): fp32 rounded to bf16 in
// place, without packing the halves.
inline __m256 round8(__m256 value) {
  const __m256i word = _mm256_castps_si256(value);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(word, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(word, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
  const __m256i rounded = _mm256_and_si256(up, _mm256_set1_epi32(-65536));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(value, value, _CMP_UNORD_Q));
  const __m256i quiet = _mm256_or_si256(_mm256_and_si256(word, _mm256_set1_epi32(-65536)), _mm256_set1_epi32(0x400000));
  return _mm256_castsi256_ps(_mm256_blendv_epi8(rounded, quiet, nan));
}

// `narrow` for eight lanes, stored as eight bf16 numbers at p (one instruction with AVX512-BF16).
inline void narrow8(uint16_t* p, __m256 value) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), reinterpret_cast<__m128i>(_mm256_cvtneps_pbh(value)));
#else
  const __m256i halves = _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(round8(value)), 16), _mm256_setzero_si256());
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(_mm256_permute4x64_epi64(halves, 0x08)));
#endif
}
#endif

}  // namespace bf16_bits

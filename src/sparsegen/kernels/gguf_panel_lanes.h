// The pieces every panel product shares (gguf_panels.h, gguf_panels_k.h, gguf_panels_q6k.h): the
// panel height and the integer dots of unsigned codes against signed input bytes, with VNNI or
// without it.
//
// Included after gguf_blocks.h (its namespace and intrinsics headers).
#pragma once

constexpr int64_t kPanel = 8;

#ifdef SPARSEGEN_AVX2
// Sums of unsigned codes times signed input bytes, four products a lane. With VNNI one vpdpbusd adds
// them into int32 lanes. Without it, vpmaddubsw's int16 pair sums are added as they are and widened
// once, by the vpmaddwd that multiplies them by their scale: one multiply a step instead of two (and
// no vpmulld), the prompt GEMM's bound on AVX2 CPUs. int16 holds kCodeSums4 steps of 4-bit codes
// (8 * 2 * 15 * 128 = 30,720 < 2^15) and kCodeSums6 of 6-bit ones (2 * 2 * 63 * 128 = 32,256).
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr int kCodeSums4 = 1 << 30, kCodeSums6 = 1 << 30;
inline __m256i add_codes(__m256i sums, __m256i u, __m256i a) { return _mm256_dpbusd_epi32(sums, u, a); }
inline __m256i scale_lanes(__m256i scale) { return scale; }
inline __m256i scaled_sums(__m256i sums, __m256i scale) { return _mm256_mullo_epi32(sums, scale); }
inline __m256i joined_sums(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
#else
constexpr int kCodeSums4 = 8, kCodeSums6 = 2;
inline __m256i add_codes(__m256i sums, __m256i u, __m256i a) {
  return _mm256_add_epi16(sums, _mm256_maddubs_epi16(u, a));
}
// An int32 scale a lane (|scale| < 2^15) as the int16 pair vpmaddwd multiplies both halves by.
inline __m256i scale_lanes(__m256i scale) {
  return _mm256_or_si256(_mm256_and_si256(scale, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(scale, 16));
}
inline __m256i scaled_sums(__m256i sums, __m256i pairs) { return _mm256_madd_epi16(sums, pairs); }
inline __m256i joined_sums(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_add_epi16(a, b), _mm256_set1_epi16(1));
}
#endif

inline __m256i quad_of(const int8_t* a) {
  int32_t four;
  std::memcpy(&four, a, 4);
  return _mm256_set1_epi32(four);
}
#endif

// The 64-byte path of gguf_blocks.h's two K-quants of a Q4_K_M file, Q4_K and Q6_K, on CPUs with
// AVX-512 BW and VL: half the vector work of the 32-byte path, each sub-block's scale spread over its
// pair sums' lanes by one permute. Included by gguf_blocks.h after the pieces it uses (Rounded,
// half_at, load32, k4_words), inside its anonymous namespace; block256 calls it.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPARSEGEN_AVX512 1

alignas(64) constexpr int16_t kLaneIota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10, 11, 12, 13, 14, 15,
                                               16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31};

// Which scale each of 32 int16 lanes of pair sums takes: first + (lane >> kShift) * step.
template <int kShift>
inline __m512i lane_scale_index(int first, int step) {
  const __m512i lane = _mm512_load_si512(kLaneIota);
  const __m512i times = _mm512_set1_epi16(static_cast<int16_t>(step));
  const __m512i which = _mm512_mullo_epi16(_mm512_srli_epi16(lane, kShift), times);
  return _mm512_add_epi16(_mm512_set1_epi16(static_cast<int16_t>(first)), which);
}

inline __m512i load_halves(const int8_t* low, const int8_t* high) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(load32(low)), load32(high), 1);
}

// One row's sums (16 int32) folded to 8, then into its accumulators: acc += sums * factor;
// offset += (sums16 . offsets) * offset_factor.
inline void fold_wide(__m512i sums, __m256i offsets, const int16_t* sums16, float factor, float offset_factor,
                      __m256& acc, __m256& offset) {
  const __m256i eight = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(eight), _mm256_set1_ps(factor), acc);
  const __m256i by16 = _mm256_madd_epi16(load32(sums16), offsets);
  offset = _mm256_fmadd_ps(_mm256_cvtepi32_ps(by16), _mm256_set1_ps(offset_factor), offset);
}

// Q4_K: a 64-byte load holds two 32-byte chunks; its low nibbles are sub-blocks 4h and 4h + 2
// (inputs 128h..+31 and 128h+64..+95), its high nibbles sub-blocks 4h + 1 and 4h + 3.
template <int kRows>
inline void q4_k_wide(const uint8_t* w, const Rounded& r, const int64_t* at, __m256* acc, __m256* offset) {
  const K4Scales words = k4_words(w + 4);
  const __m128i sc8 = _mm_cvtsi64_si128(static_cast<int64_t>(words.scales));
  const __m128i m8 = _mm_cvtsi64_si128(static_cast<int64_t>(words.minimums));
  const __m512i scales = _mm512_cvtepu8_epi16(_mm256_zextsi128_si256(sc8));
  const __m256i minimums = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));  // minimum j / 2 for input j
  __m512i sums[kRows];
  for (int k = 0; k < kRows; ++k) sums[k] = _mm512_setzero_si512();
  const __m512i fifteen = _mm512_set1_epi8(15);
  for (int h = 0; h < 2; ++h) {
    const __m512i q = _mm512_loadu_si512(w + 16 + 64 * h);
    const __m512i lo = _mm512_and_si512(q, fifteen), hi = _mm512_and_si512(_mm512_srli_epi16(q, 4), fifteen);
    const __m512i scale_lo = _mm512_permutexvar_epi16(lane_scale_index<4>(4 * h, 2), scales);
    const __m512i scale_hi = _mm512_permutexvar_epi16(lane_scale_index<4>(4 * h + 1, 2), scales);
    for (int k = 0; k < kRows; ++k) {
      const int8_t* a = r.codes.data() + at[k] * 256 + 128 * h;
      const __m512i low = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, load_halves(a, a + 64)), scale_lo);
      const __m512i high = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, load_halves(a + 32, a + 96)), scale_hi);
      sums[k] = _mm512_add_epi32(sums[k], _mm512_add_epi32(low, high));
    }
  }
  const float d = half_at(w), dmin = half_at(w + 2);
  for (int k = 0; k < kRows; ++k) {
    const float step = r.step[at[k]];
    fold_wide(sums[k], minimums, r.sums16.data() + at[k] * 16, d * step, dmin * step, acc[k], offset[k]);
  }
}

// Q6_K: 64 bytes of low nibbles are inputs 128n..+63 (their two high bits from the 32 bytes of qh
// at shifts 0 and 2), their high nibbles inputs 128n+64..+127 (shifts 4 and 6); 16 scales of 16.
template <int kRows>
inline void q6_k_wide(const uint8_t* w, const Rounded& r, const int64_t* at, __m256* acc, __m256* offset) {
  const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 192)));
  const __m512i scales = _mm512_castsi256_si512(scales16);
  const __m512i lane = _mm512_load_si512(kLaneIota);
  const __m512i upper = _mm512_srli_epi16(lane, 4);  // 0 for the first 16 int16 lanes, 1 for the rest
  const __m512i shift_lo = _mm512_slli_epi16(upper, 1), shift_hi = _mm512_add_epi16(shift_lo, _mm512_set1_epi16(4));
  const __m512i fifteen = _mm512_set1_epi8(15), three = _mm512_set1_epi8(3);
  __m512i sums[kRows];
  for (int k = 0; k < kRows; ++k) sums[k] = _mm512_setzero_si512();
  for (int n = 0; n < 2; ++n) {
    const __m512i q = _mm512_loadu_si512(w + 64 * n);
    const __m512i h = _mm512_broadcast_i64x4(load32(w + 128 + 32 * n));
    const __m512i bits_lo = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_lo), three), 4);
    const __m512i bits_hi = _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, shift_hi), three), 4);
    const __m512i lo = _mm512_or_si512(_mm512_and_si512(q, fifteen), bits_lo);
    const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(q, 4), fifteen), bits_hi);
    const __m512i scale_lo = _mm512_permutexvar_epi16(lane_scale_index<3>(8 * n, 1), scales);
    const __m512i scale_hi = _mm512_permutexvar_epi16(lane_scale_index<3>(8 * n + 4, 1), scales);
    for (int k = 0; k < kRows; ++k) {
      const int8_t* a = r.codes.data() + at[k] * 256 + 128 * n;
      const __m512i low = _mm512_madd_epi16(_mm512_maddubs_epi16(lo, _mm512_loadu_si512(a)), scale_lo);
      const __m512i high = _mm512_madd_epi16(_mm512_maddubs_epi16(hi, _mm512_loadu_si512(a + 64)), scale_hi);
      sums[k] = _mm512_add_epi32(sums[k], _mm512_add_epi32(low, high));
    }
  }
  const float d = half_at(w + 208);
  for (int k = 0; k < kRows; ++k) {
    const float step = r.step[at[k]];
    fold_wide(sums[k], scales16, r.sums16.data() + at[k] * 16, d * step, 32.f * d * step, acc[k], offset[k]);
  }
}
#endif


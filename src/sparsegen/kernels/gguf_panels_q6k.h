// Q6_K in panels of eight output rows (gguf_panels.h's scheme), for the tensors a Q4_K_M file keeps
// in six bits: the output head and half the down and value products. In the file's order each row
// and super-block asks for a horizontal sum and sixteen scalar scales; with several input rows (a
// server's batched step) the 1.5B model's head ran at a third of the panels' multiply-add rate.
//
// One panel-super-block (eight rows' super-block b, 8 * 210 bytes, the same bytes permuted):
//   [8 fp16 d][16 planes of 8 bytes: plane s holds each row's scale s (int8)]
//   [16 steps of 96 bytes, step 8n + t for half n and t < 8, read in turn: row r's ql bytes
//    64n + 4t.., then its ql bytes 64n + 32 + 4t.., then its qh bytes 32n + 4t.., each at 4r..4r+3]
// The file's block is ql[128], qh[64], scales[16], d. For half n and l < 32, ql byte 64n + l holds
// inputs 128n + l (low nibble) and 128n + 64 + l (high); ql byte 64n + 32 + l holds 128n + 32 + l
// and 128n + 96 + l; qh byte 32n + l holds the top two bits of 128n + l, + 32, + 64, + 96 in its
// bit pairs 0-1, 2-3, 4-5, 6-7. Each sixteen inputs share a scale; a code is the six bits - 32.
//
// Included by gguf_panels.h after gguf_blocks.h (Rounded, load32); gguf_panel_lanes.h gives kPanel,
// add_codes, scale_lanes, scaled_sums, kCodeSums6 and quad_of, gguf_panels_k.h pair_products.
#pragma once

#include "gguf_panel_lanes.h"
#include "gguf_panels_k.h"

constexpr int64_t kQ6Scales = 16, kQ6Steps = 144;  // panel offsets: the scale planes, the steps of codes

inline int64_t q6_k_panel_byte(int64_t r, int64_t j) {
  if (j < 128) {  // ql byte j: half n, its first or second 32 bytes
    const int64_t n = j / 64, within = j % 64, second = within / 32;
    return kQ6Steps + 96 * (8 * n + (within % 32) / 4) + 32 * second + 4 * r + j % 4;
  }
  if (j < 192) {  // qh byte j - 128
    const int64_t h = j - 128;
    return kQ6Steps + 96 * (8 * (h / 32) + (h % 32) / 4) + 64 + 4 * r + h % 4;
  }
  if (j < 208) return kQ6Scales + 8 * (j - 192) + r;  // scale j - 192
  return 2 * r + (j - 208);                           // d
}

#ifdef SPARSEGEN_AVX2
// The six-bit codes of inputs 128n + 4t + 32q.. (q < 4) for eight rows, from their ql and qh groups.
inline void q6_k_codes(const uint8_t* p, int n, int t, __m256i* u) {
  const __m256i low4 = _mm256_set1_epi8(15), top2 = _mm256_set1_epi8(0x30);
  const uint8_t* step = p + kQ6Steps + 96 * (8 * n + t);
  const __m256i a = load32(step), b = load32(step + 32), h = load32(step + 64);
  u[0] = _mm256_or_si256(_mm256_and_si256(a, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), top2));
  u[1] = _mm256_or_si256(_mm256_and_si256(b, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), top2));
  u[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), low4), _mm256_and_si256(h, top2));
  u[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), low4),
                         _mm256_and_si256(_mm256_srli_epi16(h, 2), top2));
}

// One Q6_K panel (eight outputs) times input rows [row0, row0 + kRows): result[k * 8 + r].
// Per super-block: step * d * sum_s scale_s * (u_s . a_s - 32 * sum(a_s)), all of it in int32.
template <int kRows>
void q6_k_panel_rows(const uint8_t* p, int64_t blocks, const Rounded& r, int64_t row0, float* result) {
  constexpr int64_t kBytes = kPanel * 210;
  __m256 acc[kRows];
  for (int k = 0; k < kRows; ++k) acc[k] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b, p += kBytes) {
    __m256i scale[16], pairs[8];  // the rows' scales; and scales 2i, 2i + 1 as two int16 a lane
    for (int s = 0; s < 16; ++s)
      scale[s] = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kQ6Scales + 8 * s)));
    for (int i = 0; i < 8; ++i)
      pairs[i] = _mm256_or_si256(_mm256_and_si256(scale[2 * i], _mm256_set1_epi32(0xffff)),
                                 _mm256_slli_epi32(scale[2 * i + 1], 16));
    for (int s = 0; s < 16; ++s) scale[s] = scale_lanes(scale[s]);
    __m256i scaled[kRows];
    for (int k = 0; k < kRows; ++k) scaled[k] = _mm256_setzero_si256();
    // t < 4: scales 8n + 2q; t >= 4: 8n + 2q + 1; the code sums widened every kSteps steps
    constexpr int kSteps = kCodeSums6 < 4 ? kCodeSums6 : 4;
    for (int n = 0; n < 2; ++n)
      for (int t0 = 0; t0 < 8; t0 += kSteps) {
        __m256i part[kRows][4];
        for (int k = 0; k < kRows; ++k)
          for (int q = 0; q < 4; ++q) part[k][q] = _mm256_setzero_si256();
        for (int t = t0; t < t0 + kSteps; ++t) {
          __m256i u[4];
          q6_k_codes(p, n, t, u);
          for (int k = 0; k < kRows; ++k) {
            const int8_t* a = r.codes.data() + ((row0 + k) * blocks + b) * 256 + 128 * n + 4 * t;
            for (int q = 0; q < 4; ++q) part[k][q] = add_codes(part[k][q], u[q], quad_of(a + 32 * q));
          }
        }
        for (int k = 0; k < kRows; ++k)
          for (int q = 0; q < 4; ++q)
            scaled[k] = _mm256_add_epi32(scaled[k], scaled_sums(part[k][q], scale[8 * n + 2 * q + t0 / 4]));
      }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    for (int k = 0; k < kRows; ++k) {
      const int64_t at = (row0 + k) * blocks + b;
      const __m256i offset = pair_products(pairs, r.sums16.data() + at * 16);
      const __m256i total = _mm256_sub_epi32(scaled[k], _mm256_slli_epi32(offset, 5));
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, _mm256_set1_ps(r.step[at])), acc[k]);
    }
  }
  for (int k = 0; k < kRows; ++k) _mm256_storeu_ps(result + 8 * k, acc[k]);
}
#endif

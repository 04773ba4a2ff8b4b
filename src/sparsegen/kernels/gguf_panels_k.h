// Q4_K in panels of eight output rows (gguf_panels.h's scheme for the K-quant that most of a
// Q4_K_M file is): one vpdpbusd gives eight rows' partial sums of a sub-block, and the rows' 6-bit
// sub-block scales and minimums are unpacked eight at a time. In the file's order each row and
// super-block asks for a scalar unpacking of its 12 scale bytes and a horizontal sum, which kept the
// 1.5B model's gate and up products (rows of six super-blocks) compute-bound below the bus.
//
// One panel-super-block (eight rows' super-block b, 8 * 144 bytes, the same bytes permuted):
//   [8 fp16 d][8 fp16 dmin][12 planes of 8 bytes: plane i holds byte i of each row's packed scales]
//   [codes: 32 groups of 32 bytes]: group g holds row r's nibble bytes 4g..4g+3 at bytes 4r..4r+3.
// The file's nibble byte q (chunk c = q / 32, l = q % 32) holds input 64c + l low and 64c + 32 + l
// high, so group g = 8c + t carries inputs 64c + 4t.. (sub-block 2c) and 64c + 32 + 4t.. (2c + 1).
//
// Included by gguf_panels.h after gguf_blocks.h (Rounded, load32); gguf_panel_lanes.h gives kPanel,
// add_codes, scaled_sums and quad_of.
#pragma once

#include "gguf_panel_lanes.h"

inline int64_t q4_k_panel_byte(int64_t r, int64_t j) {
  if (j < 2) return 2 * r + j;                 // d
  if (j < 4) return 16 + 2 * r + (j - 2);      // dmin
  if (j < 16) return 32 + 8 * (j - 4) + r;     // scale byte j - 4
  const int64_t q = j - 16;                    // nibble byte q of 128
  return 128 + 32 * (q / 4) + 4 * r + q % 4;
}

#ifdef SPARSEGEN_AVX2
// The eight rows' sub-block scales (scale_lanes' form) and minimums (int16, twice a row: a vpmaddwd
// against two sums of 16 inputs gives minimum * the sub-block's input sum).
struct PanelScales {
  __m256i scale[8], minimum[8];
};

inline __m256i widen_bytes(uint64_t bytes) {
  return _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<int64_t>(bytes)));
}

// get_scale_min_k4 for eight rows at once: the rows' byte i lie side by side in plane i, so each
// field is the same shift and mask of one 64-bit word ((x >> 6) << 4 of a byte is (x >> 2) & 0x30).
inline PanelScales q4_k_panel_scales(const uint8_t* planes) {
  uint64_t p[12];
  std::memcpy(p, planes, sizeof(p));
  constexpr uint64_t kLow6 = 0x3f3f3f3f3f3f3f3fULL, kLow4 = 0x0f0f0f0f0f0f0f0fULL, kTop = 0x3030303030303030ULL;
  PanelScales s;
  for (int j = 0; j < 8; ++j) {
    const uint64_t scale = j < 4 ? p[j] & kLow6 : (p[j + 4] & kLow4) | ((p[j - 4] >> 2) & kTop);
    const uint64_t minimum = j < 4 ? p[j + 4] & kLow6 : ((p[j + 4] >> 4) & kLow4) | ((p[j] >> 2) & kTop);
    s.scale[j] = scale_lanes(widen_bytes(scale));
    const __m256i m = widen_bytes(minimum);
    s.minimum[j] = _mm256_or_si256(m, _mm256_slli_epi32(m, 16));
  }
  return s;
}

// Each lane's sum over j < 8 of its two int16 in pairs[j] times the input's sums[2j], sums[2j + 1]
// (sixteen sums of sixteen inputs each, met by the eight rows' sub-block constants in vpmaddwd).
inline __m256i pair_products(const __m256i* pairs, const int16_t* sums) {
  __m256i total = _mm256_setzero_si256();
  for (int j = 0; j < 8; ++j) {
    int32_t pair;
    std::memcpy(&pair, sums + 2 * j, 4);
    total = _mm256_add_epi32(total, _mm256_madd_epi16(pairs[j], _mm256_set1_epi32(pair)));
  }
  return total;
}

// One Q4_K panel (eight outputs) times input rows [row0, row0 + kRows): result[k * 8 + r].
// Per super-block: step * (d * sum_j scale_j (u_j . a_j) - dmin * sum_j minimum_j sum(a_j)).
template <int kRows>
void q4_k_panel_rows(const uint8_t* p, int64_t blocks, const Rounded& r, int64_t row0, float* result) {
  constexpr int64_t kBytes = kPanel * 144;
  static_assert(kCodeSums4 >= 8, "a sub-block's eight steps must fit the code sums");
  __m256 acc[kRows];
  for (int k = 0; k < kRows; ++k) acc[k] = _mm256_setzero_ps();
  const __m256i fifteen = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b, p += kBytes) {
    const PanelScales s = q4_k_panel_scales(p + 32);
    __m256i scaled[kRows];
    for (int k = 0; k < kRows; ++k) scaled[k] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      __m256i low[kRows], high[kRows];
      for (int k = 0; k < kRows; ++k) low[k] = high[k] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i q = load32(p + 128 + 32 * (8 * c + t));
        const __m256i lo = _mm256_and_si256(q, fifteen), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), fifteen);
        for (int k = 0; k < kRows; ++k) {
          const int8_t* a = r.codes.data() + ((row0 + k) * blocks + b) * 256 + 64 * c + 4 * t;
          low[k] = add_codes(low[k], lo, quad_of(a));
          high[k] = add_codes(high[k], hi, quad_of(a + 32));
        }
      }
      for (int k = 0; k < kRows; ++k) {
        const __m256i both =
            _mm256_add_epi32(scaled_sums(low[k], s.scale[2 * c]), scaled_sums(high[k], s.scale[2 * c + 1]));
        scaled[k] = _mm256_add_epi32(scaled[k], both);
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
    for (int k = 0; k < kRows; ++k) {
      const int64_t at = (row0 + k) * blocks + b;
      const __m256i minimums = pair_products(s.minimum, r.sums16.data() + at * 16);
      const __m256 step = _mm256_set1_ps(r.step[at]);
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(scaled[k]), _mm256_mul_ps(d, step), acc[k]);
      acc[k] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(minimums), _mm256_mul_ps(dmin, step), acc[k]);
    }
  }
  for (int k = 0; k < kRows; ++k) _mm256_storeu_ps(result + 8 * k, acc[k]);
}
#endif

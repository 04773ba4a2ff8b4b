// Q4_0 and Q4_1 tensors (Q4_K: gguf_panels_k.h; Q6_K: gguf_panels_q6k.h) repacked once at load into
// panels of eight output rows, so that one decode step's product is whole-vector work: each integer
// dot yields eight outputs' partial sums in eight lanes, and each block's fp16 scales (and Q4_1's
// minimums) of the eight rows are one load.
// The file's row-major blocks ask instead for a horizontal sum and a scalar scale per row and block,
// about 7 cycles a block on a Zen 4, which made the default model's products compute-bound.
//
// One panel-block (eight rows' block b, 8 * block_bytes bytes, the same bytes permuted):
//   [8 fp16 d][8 fp16 m, Q4_1 only][codes: 4 groups of 32 bytes]
// Group g holds row r's nibble bytes 4g..4g+3 at bytes 4r..4r+3: low nibbles are the row's
// inputs 4g..4g+3, high nibbles inputs 16+4g..16+4g+3 (the file's byte j: input j low, j + 16 high).
// So four input codes broadcast to every lane meet eight rows' four codes in one vpdpbusd
// (or vpmaddubsw).
//
// Included by gguf_dot.cpp after gguf_blocks.h (its namespace and pieces: Rounded, load32, sum-free).
#pragma once

#include "gguf_panel_lanes.h"
#include "gguf_panels_k.h"
#include "gguf_panels_q6k.h"

inline bool panel_format(int64_t format) {
  return format == kQ4_0 || format == kQ4_1 || format == kQ4_K || format == kQ6_K;
}

// Where byte j of row r's file block sits in its panel-block.
inline int64_t panel_byte(int64_t format, int64_t r, int64_t j) {
  if (format == kQ4_K) return q4_k_panel_byte(r, j);
  if (format == kQ6_K) return q6_k_panel_byte(r, j);
  const int64_t header = format == kQ4_1 ? 4 : 2, codes = format == kQ4_1 ? 32 : 16;
  if (j < 2) return 2 * r + j;                       // d
  if (j < header) return 16 + 2 * r + (j - 2);       // m
  const int64_t q = j - header;                      // nibble byte q of 16
  return codes + 32 * (q / 4) + 4 * r + q % 4;
}

// File rows [out, blocks * block_bytes] to panels (or back, `inverse`); out a multiple of kPanel.
void permute_panels(const uint8_t* from, uint8_t* to, int64_t format, int64_t out, int64_t blocks, bool inverse) {
  const int64_t block_bytes = info_of(format).block_bytes;
  at::parallel_for(0, out / kPanel, 16, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t panel_at = (p * blocks + b) * kPanel * block_bytes;
        for (int64_t r = 0; r < kPanel; ++r) {
          const int64_t file_at = ((p * kPanel + r) * blocks + b) * block_bytes;
          for (int64_t j = 0; j < block_bytes; ++j) {
            const int64_t at = panel_at + panel_byte(format, r, j);
            if (inverse)
              to[file_at + j] = from[at];
            else
              to[at] = from[file_at + j];
          }
        }
      }
    }
  });
}

// Where each 4 bytes of row r's file block start in its panel-block, or -1 where they are not together
// there (fp16 factors, Q4_K's scale bytes): [kPanel][block_bytes / 4 + 1], per format, built once.
inline const std::vector<int32_t>& panel_quads(int64_t format) {
  static const auto build = [](int64_t f) {
    const int64_t quads = info_of(f).block_bytes / 4 + 1;
    std::vector<int32_t> at(kPanel * quads, -1);
    for (int64_t r = 0; r < kPanel; ++r)
      for (int64_t q = 0; 4 * q + 3 < info_of(f).block_bytes; ++q) {
        const int64_t first = panel_byte(f, r, 4 * q);
        bool together = true;
        for (int64_t i = 1; i < 4; ++i) together = together && panel_byte(f, r, 4 * q + i) == first + i;
        if (together) at[r * quads + q] = static_cast<int32_t>(first);
      }
    return at;
  };
  static const std::vector<int32_t> q4_0 = build(kQ4_0), q4_1 = build(kQ4_1);
  static const std::vector<int32_t> q4_k = build(kQ4_K), q6_k = build(kQ6_K);
  return format == kQ4_0 ? q4_0 : format == kQ4_1 ? q4_1 : format == kQ4_K ? q4_k : q6_k;
}

// Row r's file block put back together from its panel-block (the paths without a panel kernel).
inline void file_block_of(const uint8_t* panel_block, int64_t format, int64_t r, uint8_t* block) {
  const int64_t bytes = info_of(format).block_bytes, quads = bytes / 4 + 1;
  const int32_t* at = panel_quads(format).data() + r * quads;
  for (int64_t q = 0; 4 * q < bytes; ++q) {
    if (at[q] >= 0) {
      std::memcpy(block + 4 * q, panel_block + at[q], 4);
      continue;
    }
    for (int64_t j = 4 * q; j < std::min<int64_t>(4 * q + 4, bytes); ++j)
      block[j] = panel_block[panel_byte(format, r, j)];
  }
}

// Panels decoded block by block, each row's file block gathered back first (the K-quants' prompt GEMM).
template <typename T>
void decode_panels_by_block(const uint8_t* w, int64_t format, int64_t in, int64_t out_features, T* o) {
  const FormatInfo f = info_of(format);
  const int64_t blocks = in / f.per_block;
  at::parallel_for(0, out_features / kPanel, 4, [&](int64_t first, int64_t last) {
    uint8_t block[256];
    for (int64_t p = first; p < last; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* panel = w + (p * blocks + b) * kPanel * f.block_bytes;
        for (int64_t r = 0; r < kPanel; ++r) {
          file_block_of(panel, format, r, block);
          decode_block(format, block, o + (p * kPanel + r) * in + b * f.per_block);
        }
      }
    }
  });
}

// Panels [out, row bytes] decoded to the weight [out, in] as plain_decode decodes the file's blocks:
// d u + m for Q4_1, d (u - 8) for Q4_0 (a prompt's float GEMM, without putting the file order back).
template <typename T>
void decode_panels(const uint8_t* w, int64_t format, int64_t in, int64_t out_features, T* o) {
  if (format == kQ4_K || format == kQ6_K) return decode_panels_by_block(w, format, in, out_features, o);
  const int64_t block_bytes = info_of(format).block_bytes, blocks = in / 32;
  const bool has_min = format == kQ4_1;
  const int64_t codes = has_min ? 32 : 16;
  at::parallel_for(0, out_features / kPanel, 4, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* panel = w + (p * blocks + b) * kPanel * block_bytes;
        for (int64_t r = 0; r < kPanel; ++r) {
          const float d = half_at(panel + 2 * r), m = has_min ? half_at(panel + 16 + 2 * r) : 0.f;
          int32_t code[32];
          for (int64_t q = 0; q < 16; ++q) {
            const uint8_t byte = panel[codes + 32 * (q / 4) + 4 * r + q % 4];
            code[q] = (byte & 15) - (has_min ? 0 : 8), code[q + 16] = (byte >> 4) - (has_min ? 0 : 8);
          }
          float v[32];
          scaled_codes(code, 32, d, m * (has_min ? -1.f : 0.f), v);
          store_floats(v, 32, o + (p * kPanel + r) * in + b * 32);
        }
      }
    }
  });
}

#ifdef SPARSEGEN_AVX2
// One panel (eight outputs) times input rows [row0, row0 + kRows): result[k * 8 + r].
// Per block: d * step * (u . a) + m * step * sum(a), Q4_0's m being -8 d.
template <int64_t F, int kRows>
void panel_rows(const uint8_t* p, int64_t blocks, const Rounded& r, int64_t row0, float* result) {
  constexpr int64_t kBytes = kPanel * (F == kQ4_1 ? 20 : 18), kCodes = F == kQ4_1 ? 32 : 16;
  static_assert(kCodeSums4 >= 8, "a block's low and high four steps, joined, must fit the code sums");
  __m256 scaled[kRows], offset[kRows];
  for (int k = 0; k < kRows; ++k) scaled[k] = offset[k] = _mm256_setzero_ps();
  const __m256i fifteen = _mm256_set1_epi8(15);
  for (int64_t b = 0; b < blocks; ++b, p += kBytes) {
    __m256i low[kRows], high[kRows];
    for (int k = 0; k < kRows; ++k) low[k] = high[k] = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
      const __m256i q = load32(p + kCodes + 32 * g);
      const __m256i lo = _mm256_and_si256(q, fifteen), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), fifteen);
      for (int k = 0; k < kRows; ++k) {
        const int8_t* a = r.codes.data() + ((row0 + k) * blocks + b) * 32;
        low[k] = add_codes(low[k], lo, quad_of(a + 4 * g));
        high[k] = add_codes(high[k], hi, quad_of(a + 16 + 4 * g));
      }
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256 m = F == kQ4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)))
                                : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
    for (int k = 0; k < kRows; ++k) {
      const int64_t at = (row0 + k) * blocks + b;
      const __m256 dots = _mm256_cvtepi32_ps(joined_sums(low[k], high[k]));
      scaled[k] = _mm256_fmadd_ps(dots, _mm256_mul_ps(d, _mm256_set1_ps(r.step[at])), scaled[k]);
      offset[k] = _mm256_fmadd_ps(m, _mm256_set1_ps(r.step_sum[at]), offset[k]);
    }
  }
  for (int k = 0; k < kRows; ++k) _mm256_storeu_ps(result + 8 * k, _mm256_add_ps(scaled[k], offset[k]));
}

template <int64_t F, int kRows>
void rows_of_panel(const uint8_t* p, int64_t blocks, const Rounded& r, int64_t row0, float* result) {
  if constexpr (F == kQ4_K)
    q4_k_panel_rows<kRows>(p, blocks, r, row0, result);
  else if constexpr (F == kQ6_K)
    q6_k_panel_rows<kRows>(p, blocks, r, row0, result);
  else
    panel_rows<F, kRows>(p, blocks, r, row0, result);
}

template <int64_t F>
void panel_tile(const uint8_t* p, int64_t blocks, const Rounded& r, int64_t row0, int count, float* result) {
  switch (count) {
    case 1: return rows_of_panel<F, 1>(p, blocks, r, row0, result);
    case 2: return rows_of_panel<F, 2>(p, blocks, r, row0, result);
    case 3: return rows_of_panel<F, 3>(p, blocks, r, row0, result);
    default: return rows_of_panel<F, 4>(p, blocks, r, row0, result);
  }
}
#endif

// One panel times up to four input rows, any CPU: each row's file block put back, then the plain product.
void panel_tile_any(int64_t format, const uint8_t* p, int64_t blocks, const Rounded& r, int64_t row0, int count,
                    float* result) {
#ifdef SPARSEGEN_AVX2
  if (format == kQ4_K) return panel_tile<kQ4_K>(p, blocks, r, row0, count, result);
  if (format == kQ6_K) return panel_tile<kQ6_K>(p, blocks, r, row0, count, result);
  if (format == kQ4_1) return panel_tile<kQ4_1>(p, blocks, r, row0, count, result);
  return panel_tile<kQ4_0>(p, blocks, r, row0, count, result);
#else
  const int64_t block_bytes = info_of(format).block_bytes;
  uint8_t block[256];
  for (int k = 0; k < count; ++k) {
    for (int64_t n = 0; n < kPanel; ++n) {
      float sum = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        file_block_of(p + b * kPanel * block_bytes, format, n, block);
        sum += plain_block_product(format, block, r, row0 + k, b);
      }
      result[8 * k + n] = sum;
    }
  }
#endif
}

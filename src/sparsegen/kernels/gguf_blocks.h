// The block formats of a GGUF tensor for gguf_dot.cpp (its one includer: this header's namespace is that
// translation unit's anonymous one): each block decoded, the input rounded, their integer-dot products.
// The weight is [out, row_bytes] uint8, each row the ggml blocks of one output (ggml-common.h):
//
//   Q4_0  fp16 d, 16 bytes of nibbles          w = d (u - 8)           u in 0..15   (32 a block)
//   Q4_1  fp16 d, fp16 m, 16 bytes of nibbles  w = d u + m
//   Q5_0  fp16 d, 4 bytes of fifth bits, nibbles  w = d (u - 16)       u in 0..31
//   Q5_1  fp16 d, fp16 m, fifth bits, nibbles  w = d u + m
//   Q8_0  fp16 d, 32 int8                      w = d q
//   Q4_K  fp16 d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles (256 a block):
//         w = d sc_j u - dmin m_j over 8 sub-blocks of 32
//   Q5_K  as Q4_K with 32 bytes of fifth bits before the nibbles
//   Q6_K  128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, fp16 d:
//         w = d sc_k (u - 32) over 16 sub-blocks of 16, u in 0..63
//
// Each input row is rounded to int8 inside the op as llama.cpp rounds it: for the 32-blocks per
// block of 32 (Q8_0: step = max|x| / 127 kept as fp16; the sum of codes beside it, which Q4_1/Q5_1's
// minimum and Q4_0/Q5_0's offset multiply), for the K-quants per 256 (Q8_K: an fp32 step, sums of
// codes per 16). Unsigned codes times signed bytes sum exactly in vpmaddubsw's int16 pairs (|u| <= 63),
// signed Q8_0 codes by the sign trick; sub-block scales multiply int16 pair sums in vpmaddwd. The
// result is the dequantized weight times the rounded input, up to fp32 summation order.
#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPARSEGEN_AVX2 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Format : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

struct FormatInfo {
  int64_t per_block, block_bytes;
  bool k_quant;
};

FormatInfo info_of(int64_t format) {
  switch (format) {
    case kQ4_0: return {32, 18, false};
    case kQ4_1: return {32, 20, false};
    case kQ5_0: return {32, 22, false};
    case kQ5_1: return {32, 24, false};
    case kQ8_0: return {32, 34, false};
    case kQ4_K: return {256, 144, true};
    case kQ5_K: return {256, 176, true};
    case kQ6_K: return {256, 210, true};
    default: TORCH_CHECK(false, "gguf_linear: no kernel for ggml type ", format);
  }
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#ifdef SPARSEGEN_AVX2
  return _cvtsh_ss(bits);
#else
  return c10::detail::fp16_ieee_to_fp32_value(bits);
#endif
}

inline float to_half_and_back(float value) { return static_cast<float>(c10::Half(value)); }

// The input rows rounded to int8. Per block of 32 (`k_quant` false): step (fp16-rounded) and
// step * sum of codes. Per block of 256: step, and the sums of codes per 16 (int16).
struct Rounded {
  int64_t in;
  std::vector<int8_t> codes;
  std::vector<float> step, step_sum;
  std::vector<int16_t> sums16;
};

void round_block32(const float* x, int8_t* codes, float* step, float* step_sum) {
  float largest = 0.f;
  for (int j = 0; j < 32; ++j) largest = std::max(largest, std::fabs(x[j]));
  const float inverse = largest > 0.f ? 127.f / largest : 0.f;
  int32_t sum = 0;
  for (int j = 0; j < 32; ++j) {
    codes[j] = static_cast<int8_t>(std::nearbyint(x[j] * inverse));
    sum += codes[j];
  }
  *step = to_half_and_back(largest / 127.f);
  *step_sum = *step * static_cast<float>(sum);
}

void round_block256(const float* x, int8_t* codes, float* step, int16_t* sums16) {
  float largest = 0.f, signed_largest = 0.f;  // Q8_K scales by the signed value of largest magnitude
  for (int j = 0; j < 256; ++j) {
    if (std::fabs(x[j]) > largest) largest = std::fabs(x[j]), signed_largest = x[j];
  }
  if (largest == 0.f) {
    std::memset(codes, 0, 256);
    std::memset(sums16, 0, 16 * sizeof(int16_t));
    *step = 0.f;
    return;
  }
  const float inverse = -127.f / signed_largest;
  for (int j = 0; j < 256; ++j) codes[j] = static_cast<int8_t>(std::min(127.f, std::nearbyint(inverse * x[j])));
  for (int k = 0; k < 16; ++k) {
    int32_t sum = 0;
    for (int j = 0; j < 16; ++j) sum += codes[16 * k + j];
    sums16[k] = static_cast<int16_t>(sum);
  }
  *step = 1.f / inverse;
}

Rounded round_rows(const float* x, int64_t rows, int64_t in, bool k_quant) {
  const int64_t per_block = k_quant ? 256 : 32, blocks = rows * in / per_block;
  Rounded r{in, std::vector<int8_t>(rows * in), std::vector<float>(blocks), std::vector<float>(k_quant ? 0 : blocks),
            std::vector<int16_t>(k_quant ? rows * in / 16 : 0)};
  at::parallel_for(0, blocks, 64, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      if (k_quant)
        round_block256(x + b * 256, r.codes.data() + b * 256, &r.step[b], r.sums16.data() + b * 16);
      else
        round_block32(x + b * 32, r.codes.data() + b * 32, &r.step[b], &r.step_sum[b]);
    }
  });
  return r;
}

// ---- One weight block, decoded: what every format yields for the products ----------------------

// The 6-bit scales and minimums of Q4_K / Q5_K's eight sub-blocks (get_scale_min_k4), four bytes
// at a time: the 12 bytes are words A, B, C; scales 0-3 are A's low six bits, minimums 0-3 B's;
// scales 4-7 are C's low nibbles with A's top two bits above them, minimums 4-7 C's high nibbles
// with B's top bits (a shift within a 32-bit word keeps each byte's own bits once masked). Each
// comes back as eight bytes in one 64-bit word, scale (minimum) j in byte j: kept in registers,
// never stored and read back wider (a store-forwarding stall a block).
struct K4Scales {
  uint64_t scales, minimums;
};

inline K4Scales k4_words(const uint8_t* q) {
  uint32_t a, b, c;
  std::memcpy(&a, q, 4);
  std::memcpy(&b, q + 4, 4);
  std::memcpy(&c, q + 8, 4);
  constexpr uint32_t kLow6 = 0x3f3f3f3fu, kLow4 = 0x0f0f0f0fu, kTwo = 0x03030303u;
  const uint64_t scales_high = (c & kLow4) | (((a >> 6) & kTwo) << 4);
  const uint64_t minimums_high = ((c >> 4) & kLow4) | (((b >> 6) & kTwo) << 4);
  return {(a & kLow6) | (scales_high << 32), (b & kLow6) | (minimums_high << 32)};
}

inline void k4_scales(const uint8_t* q, uint8_t* sc, uint8_t* m) {
  const K4Scales words = k4_words(q);
  std::memcpy(sc, &words.scales, 8);
  std::memcpy(m, &words.minimums, 8);
}

// The plain decode of one block into integer codes per weight and, per sub-block of 16, an integer
// scale: w = factor * scale_k * code - offset_factor * offset_k (k = j / 16). Used without AVX2.
struct PlainBlock {
  int32_t code[256];
  int32_t scale[16], offset[16];
  float factor, offset_factor;
};

void plain_decode(int64_t format, const uint8_t* b, PlainBlock& p) {
  const bool five = format == kQ5_0 || format == kQ5_1 || format == kQ5_K;
  if (!info_of(format).k_quant) {
    const float d = half_at(b);
    const bool has_min = format == kQ4_1 || format == kQ5_1;
    const uint8_t* qs = b + (has_min ? 4 : 2) + (five ? 4 : 0);
    uint32_t high = 0;
    if (five) std::memcpy(&high, b + (has_min ? 4 : 2), 4);
    for (int j = 0; j < 32; ++j) {
      if (format == kQ8_0) {
        p.code[j] = static_cast<int8_t>(b[2 + j]);
        continue;
      }
      const int32_t low = j < 16 ? (qs[j] & 15) : (qs[j - 16] >> 4);
      const int32_t centre = has_min ? 0 : (five ? 16 : 8);
      p.code[j] = low + (five ? static_cast<int32_t>((high >> j) & 1) << 4 : 0) - centre;
    }
    p.scale[0] = p.scale[1] = 1;
    p.factor = d;
    p.offset[0] = p.offset[1] = has_min ? -1 : 0;  // w = d u + m: the minimum is an offset of -1 * m
    p.offset_factor = has_min ? half_at(b + 2) : 0.f;
    return;
  }
  if (format == kQ6_K) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int n = 0; n < 2; ++n) {
      for (int l = 0; l < 32; ++l) {
        const uint8_t h = qh[32 * n + l];
        p.code[128 * n + l] = ((ql[64 * n + l] & 15) | ((h & 3) << 4)) - 32;
        p.code[128 * n + l + 32] = ((ql[64 * n + l + 32] & 15) | (((h >> 2) & 3) << 4)) - 32;
        p.code[128 * n + l + 64] = ((ql[64 * n + l] >> 4) | (((h >> 4) & 3) << 4)) - 32;
        p.code[128 * n + l + 96] = ((ql[64 * n + l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32;
      }
    }
    for (int k = 0; k < 16; ++k) p.scale[k] = static_cast<int8_t>(b[192 + k]), p.offset[k] = 0;
    p.factor = half_at(b + 208);
    p.offset_factor = 0.f;
    return;
  }
  uint8_t sc[8], m[8];
  k4_scales(b + 4, sc, m);
  const uint8_t* qs = b + 16 + (five ? 32 : 0);
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) {
      const int32_t high_lo = five ? ((b[16 + l] >> (2 * c)) & 1) << 4 : 0;
      const int32_t high_hi = five ? ((b[16 + l] >> (2 * c + 1)) & 1) << 4 : 0;
      p.code[64 * c + l] = (qs[32 * c + l] & 15) + high_lo;
      p.code[64 * c + 32 + l] = (qs[32 * c + l] >> 4) + high_hi;
    }
  }
  for (int k = 0; k < 16; ++k) p.scale[k] = sc[k / 2], p.offset[k] = m[k / 2];
  p.factor = half_at(b);
  p.offset_factor = half_at(b + 2);
}

// One block times one rounded input row, without vector instructions.
float plain_block_product(int64_t format, const uint8_t* block, const Rounded& r, int64_t row, int64_t b) {
  PlainBlock p;
  plain_decode(format, block, p);
  const int64_t per_block = info_of(format).per_block, at = row * r.in + b * per_block;
  const int8_t* a = r.codes.data() + at;
  int64_t scaled = 0, offsets = 0;
  for (int k = 0; k < per_block / 16; ++k) {
    int64_t dot = 0, sum = 0;
    for (int j = 16 * k; j < 16 * k + 16; ++j) dot += p.code[j] * a[j], sum += a[j];
    scaled += p.scale[k] * dot;
    offsets += p.offset[k] * sum;
  }
  const float step = r.step[at / per_block];
  return step * (p.factor * static_cast<float>(scaled) - p.offset_factor * static_cast<float>(offsets));
}

#ifdef SPARSEGEN_AVX2
inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }

// The 32 codes of a 32-block's 16 nibble bytes: byte j holds input j low, input j + 16 high.
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return low_nibbles(_mm256_inserti128_si256(_mm256_castsi128_si256(packed), _mm_srli_epi16(packed, 4), 1));
}

// 16 where bit j of the 32 bits is set, byte j; 0 elsewhere: byte j takes the bits' byte j / 8,
// then keeps its own bit j % 8.
inline __m256i fifth_bits32(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i byte_of = _mm256_set_epi8(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2,
                                          1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), byte_of);
  const __m256i own_bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, own_bit), own_bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(16));
}

inline __m256i pair_sums(__m256i u, __m256i a) { return _mm256_maddubs_epi16(u, a); }
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }

inline float sum_of(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// A 32-block against kRows input rows: acc += (u . a) * d * step; offset += c * step_sum.
template <int64_t F, int kRows>
inline void block32(const uint8_t* w, const Rounded& r, const int64_t* at, __m256* acc, float* offset) {
  const float d = half_at(w);
  __m256i u;
  float c = 0.f;
  if (F == kQ8_0) {
    u = load32(w + 2);
  } else if (F == kQ4_0) {
    u = nibbles32(w + 2), c = -8.f * d;
  } else if (F == kQ4_1) {
    u = nibbles32(w + 4), c = half_at(w + 2);
  } else if (F == kQ5_0) {
    u = _mm256_or_si256(nibbles32(w + 6), fifth_bits32(w + 2)), c = -16.f * d;
  } else {
    u = _mm256_or_si256(nibbles32(w + 8), fifth_bits32(w + 4)), c = half_at(w + 2);
  }
  for (int k = 0; k < kRows; ++k) {
    const __m256i a = load32(r.codes.data() + at[k] * 32);
    const __m256i pairs = F == kQ8_0 ? pair_sums(_mm256_sign_epi8(u, u), _mm256_sign_epi8(a, u)) : pair_sums(u, a);
    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(pairs)), _mm256_set1_ps(d * r.step[at[k]]), acc[k]);
    if (F != kQ8_0) offset[k] += c * r.step_sum[at[k]];
  }
}

// int16 scales for a 32-chunk's two halves (pair sums 0-7 and 8-15).
inline __m256i halves(int16_t first, int16_t second) {
  return _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(first)), _mm_set1_epi16(second), 1);
}

// Q4_K and Q6_K 64 bytes an instruction where the CPU has AVX-512 (BW, VL): SPARSEGEN_AVX512.
#include "gguf_blocks_wide.h"

// A K-quant super-block against kRows rows: the integer sums of scale * (u . a) per row, then
// acc += sums * d * step, and the minimums' (or Q6_K's -32 offset's) term from the sums per 16.
template <int64_t F, int kRows>
inline void block256(const uint8_t* w, const Rounded& r, const int64_t* at, __m256* acc, __m256* offset) {
#ifdef SPARSEGEN_AVX512
  if constexpr (F == kQ4_K) return q4_k_wide<kRows>(w, r, at, acc, offset);
  if constexpr (F == kQ6_K) return q6_k_wide<kRows>(w, r, at, acc, offset);
#endif
  __m256i sums[kRows];
  for (int k = 0; k < kRows; ++k) sums[k] = _mm256_setzero_si256();
  __m256i offsets;  // per 16 inputs, the integer its input sum is multiplied by
  float d, offset_factor;
  if (F == kQ6_K) {
    const uint8_t *ql = w, *qh = w + 128;
    const int8_t* sc = reinterpret_cast<const int8_t*>(w + 192);
    d = half_at(w + 208), offset_factor = 32.f * d;
    offsets = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc)));
    for (int n = 0; n < 2; ++n) {
      const __m256i qa = load32(ql + 64 * n), qb = load32(ql + 64 * n + 32), h = load32(qh + 32 * n);
      const __m256i three = _mm256_set1_epi8(3);
      const __m256i u[4] = {
          _mm256_or_si256(low_nibbles(qa), _mm256_slli_epi16(_mm256_and_si256(h, three), 4)),
          _mm256_or_si256(low_nibbles(qb), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), three), 4)),
          _mm256_or_si256(high_nibbles(qa), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), three), 4)),
          _mm256_or_si256(high_nibbles(qb), _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), three), 4))};
      for (int c = 0; c < 4; ++c) {
        const __m256i scales = halves(sc[8 * n + 2 * c], sc[8 * n + 2 * c + 1]);
        for (int k = 0; k < kRows; ++k) {
          const __m256i a = load32(r.codes.data() + at[k] * 256 + 128 * n + 32 * c);
          sums[k] = _mm256_add_epi32(sums[k], _mm256_madd_epi16(pair_sums(u[c], a), scales));
        }
      }
    }
  } else {
    const K4Scales words = k4_words(w + 4);
    uint8_t sc[8];
    std::memcpy(sc, &words.scales, 8);
    d = half_at(w), offset_factor = half_at(w + 2);
    const __m128i minimums = _mm_cvtsi64_si128(static_cast<int64_t>(words.minimums));
    offsets = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(minimums, minimums));  // minimum j / 2 for input j
    const uint8_t* qs = w + (F == kQ5_K ? 48 : 16);
    const __m256i high = F == kQ5_K ? load32(w + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i q = load32(qs + 32 * c);
      __m256i lo = low_nibbles(q), hi = high_nibbles(q);
      if (F == kQ5_K) {
        const __m256i one = _mm256_set1_epi8(1);
        const __m128i shift = _mm_cvtsi32_si128(2 * c), next = _mm_cvtsi32_si128(2 * c + 1);
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high, shift), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(high, next), one), 4));
      }
      const __m256i scale_lo = _mm256_set1_epi16(sc[2 * c]), scale_hi = _mm256_set1_epi16(sc[2 * c + 1]);
      for (int k = 0; k < kRows; ++k) {
        const int8_t* a = r.codes.data() + at[k] * 256 + 64 * c;
        const __m256i both = _mm256_add_epi32(_mm256_madd_epi16(pair_sums(lo, load32(a)), scale_lo),
                                              _mm256_madd_epi16(pair_sums(hi, load32(a + 32)), scale_hi));
        sums[k] = _mm256_add_epi32(sums[k], both);
      }
    }
  }
  for (int k = 0; k < kRows; ++k) {
    const float step = r.step[at[k]];
    acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[k]), _mm256_set1_ps(d * step), acc[k]);
    const __m256i by16 = _mm256_madd_epi16(load32(r.sums16.data() + at[k] * 16), offsets);
    offset[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(by16), _mm256_set1_ps(offset_factor * step), offset[k]);
  }
}
#endif

}  // namespace

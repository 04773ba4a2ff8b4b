// A block decoded to its floats: what a prompt's bf16 (AMX) GEMM multiplies, the whole matrix decoded
// once per product. plain_decode's integer codes and per-element scale lookups took 10 ms of a 512-token
// read's ~20 ms per 1.5B product on an AMX Xeon (2 threads), twice the GEMM: here each format's codes
// become floats in loops the compiler vectorizes, each sub-block's two factors computed once, and bf16
// is rounded to nearest even in integer lanes (as torch's conversion rounds). The values are
// plain_decode's: a_k * code - b_k, a_k = factor * scale_k, b_k = offset_factor * offset_k.
//
// Included by gguf_dot.cpp after gguf_blocks.h (its namespace and pieces: info_of, half_at, k4_scales).
#pragma once

#include <type_traits>

// fp32 to bf16 bits, rounded to nearest even; NaN stays a quiet NaN (torch's c10::BFloat16 rounding).
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7fffffffu) > 0x7f800000u ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(rounded);
}

template <typename T>
inline void store_floats(const float* v, int64_t n, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, v, n * sizeof(float));
  } else {
    static_assert(sizeof(T) == 2, "fp32 or bf16 rows");
    uint16_t bits[256];
    for (int64_t j = 0; j < n; ++j) bits[j] = bf16_bits(v[j]);
    std::memcpy(out, bits, n * 2);
  }
}

// 16 or 32 codes of one sub-block to floats: v = a * code - b.
inline void scaled_codes(const int32_t* code, int64_t n, float a, float b, float* v) {
  for (int64_t j = 0; j < n; ++j) v[j] = a * static_cast<float>(code[j]) - b;
}

// Q4_K: 8 sub-blocks of 32, the low nibbles of 32 bytes one sub-block, their high nibbles the next.
inline void decode_q4_k(const uint8_t* b, float* v) {
  uint8_t sc[8], m[8];
  k4_scales(b + 4, sc, m);
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* qs = b + 16;
  int32_t low[32], high[32];
  for (int c = 0; c < 4; ++c) {
    for (int l = 0; l < 32; ++l) low[l] = qs[32 * c + l] & 15, high[l] = qs[32 * c + l] >> 4;
    scaled_codes(low, 32, d * static_cast<float>(sc[2 * c]), dmin * static_cast<float>(m[2 * c]), v + 64 * c);
    scaled_codes(high, 32, d * static_cast<float>(sc[2 * c + 1]), dmin * static_cast<float>(m[2 * c + 1]),
                 v + 64 * c + 32);
  }
}

// Q6_K: two halves of 128; in each, four runs t of 32 codes (low nibbles of ql's two 32-byte rows, then
// their high nibbles), run t's two high bits at 2t in qh, each 16 codes their own int8 scale: the
// first 16 of run t scale 2t, the next 2t + 1.
inline void decode_q6_k(const uint8_t* b, float* v) {
  const int8_t* scale = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int n = 0; n < 2; ++n) {
    const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
    for (int half = 0; half < 2; ++half) {
      float a[4];
      for (int t = 0; t < 4; ++t) a[t] = d * static_cast<float>(scale[8 * n + 2 * t + half]);
      float* out = v + 128 * n + 16 * half;
      for (int l = 16 * half; l < 16 * half + 16; ++l) {
        const int32_t h = qh[l], first = ql[l], second = ql[l + 32];
        out[l - 16 * half] = a[0] * static_cast<float>(((first & 15) | ((h & 3) << 4)) - 32);
        out[l - 16 * half + 32] = a[1] * static_cast<float>(((second & 15) | (((h >> 2) & 3) << 4)) - 32);
        out[l - 16 * half + 64] = a[2] * static_cast<float>(((first >> 4) | (((h >> 4) & 3) << 4)) - 32);
        out[l - 16 * half + 96] = a[3] * static_cast<float>(((second >> 4) | (((h >> 6) & 3) << 4)) - 32);
      }
    }
  }
}

// One block decoded into its per_block floats of a weight row, as plain_decode reads it.
template <typename T>
void decode_block(int64_t format, const uint8_t* block, T* row) {
  float v[256];
  if (format == kQ4_K) {
    decode_q4_k(block, v);
  } else if (format == kQ6_K) {
    decode_q6_k(block, v);
  } else {  // the formats of 32 (one scale, set for both halves) and Q5_K: plain_decode's codes
    PlainBlock p;
    plain_decode(format, block, p);
    for (int k = 0; k < info_of(format).per_block / 16; ++k)
      scaled_codes(p.code + 16 * k, 16, p.factor * static_cast<float>(p.scale[k]),
                   p.offset_factor * static_cast<float>(p.offset[k]), v + 16 * k);
  }
  store_floats(v, info_of(format).per_block, row);
}

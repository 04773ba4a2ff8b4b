// The vector operations of sparse_mlp.cpp (its one includer: this header's namespace is that
// translation unit's anonymous one): fp32 vectors of kLanes (AVX-512: 16, AVX2: 8, else a plain
// struct of 8 the compiler may vectorize), bf16 and int8/int4 codes widened to them, and the
// integer dot of a block of 32 weights with 32 int8 codes (AVX2 bytes; vpdpbusd with AVX-512 VNNI).
#pragma once

#include <torch/extension.h>

#include "int8_blocks.h"

#if defined(SPARSEGEN_AVX2) && defined(__AVX512F__)
#define SPARSEGEN_AVX512 1
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#if defined(SPARSEGEN_AVX512)
using Vec = __m512;
constexpr int64_t kLanes = 16;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const uint16_t* p) {  // bf16: the upper half of an fp32
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float sum_of(Vec v) { return _mm512_reduce_add_ps(v); }
#elif defined(SPARSEGEN_AVX2)
using Vec = __m256;
constexpr int64_t kLanes = 8;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float sum_of(Vec v) { return sum256(v); }
#else
constexpr int64_t kLanes = 8;
struct Vec {  // no vector instructions: eight floats the compiler may still vectorize
  float v[kLanes];
};
inline Vec zero() { return Vec{}; }
inline Vec load(const float* p) { Vec r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
inline Vec load(const uint16_t* p) {
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) { const uint32_t bits = uint32_t(p[i]) << 16; std::memcpy(&r.v[i], &bits, 4); }
  return r;
}
inline void store(float* p, Vec v) { std::memcpy(p, v.v, sizeof(v.v)); }
inline Vec broadcast(float x) { Vec r; std::fill(r.v, r.v + kLanes, x); return r; }
inline Vec fma(Vec a, Vec b, Vec c) { for (int64_t i = 0; i < kLanes; ++i) c.v[i] += a.v[i] * b.v[i]; return c; }
inline float sum_of(Vec v) { float s = 0.f; for (float x : v.v) s += x; return s; }
#endif

inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

#ifdef SPARSEGEN_AVX2
using IVec = __m256;  // eight partial sums of integer dots, scaled to fp32
inline IVec izero() { return _mm256_setzero_ps(); }
inline float isum(IVec v) { return sum256(v); }
// acc + factor * (the block's weights . a), the weights int4 nibbles or int8 codes.
template <bool kInt4>
inline IVec block_dot(const uint8_t* w, const int8_t* a, float factor, IVec acc) {
  const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  __m256 dot;
  if (kInt4) {
    dot = block_dot_codes(weight_block(w), codes);
  } else {
    dot = signed_block_dot_codes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), codes);
  }
  return _mm256_fmadd_ps(dot, _mm256_set1_ps(factor), acc);
}
#else
using IVec = float;
inline IVec izero() { return 0.f; }
inline float isum(IVec v) { return v; }
template <bool kInt4>
inline IVec block_dot(const uint8_t* w, const int8_t* a, float factor, IVec acc) {
  int32_t dot = 0;
  for (int64_t j = 0; j < kBlock; ++j)
    dot += (kInt4 ? (j < 16 ? w[j] & 15 : w[j - 16] >> 4) : static_cast<int8_t>(w[j])) * a[j];
  return acc + factor * static_cast<float>(dot);
}
#endif

// kLanes weights of a down block widened to fp32: int8 codes, or nibbles (>> shift & 15).
template <bool kInt4>
inline Vec widen(const uint8_t* p, int shift) {
#if defined(SPARSEGEN_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if (!kInt4) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  const __m512i u = _mm512_and_si512(_mm512_srli_epi32(_mm512_cvtepu8_epi32(bytes), shift), _mm512_set1_epi32(15));
  return _mm512_cvtepi32_ps(u);
#elif defined(SPARSEGEN_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  if (!kInt4) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  const __m256i u = _mm256_and_si256(_mm256_srli_epi32(_mm256_cvtepu8_epi32(bytes), shift), _mm256_set1_epi32(15));
  return _mm256_cvtepi32_ps(u);
#else
  Vec r;
  for (int64_t i = 0; i < kLanes; ++i) r.v[i] = kInt4 ? float((p[i] >> shift) & 15) : float(int8_t(p[i]));
  return r;
#endif
}

}  // namespace

// The float arithmetic the KV kernels share: a query's dot product with a held row and a
// probability-weighted sum of held rows, over rows held in fp32 or fp16 (F16C widens eight halves
// in one instruction, so an fp16 row costs half the bytes of an fp32 one and no more work), and
// exp over a row of scores (or any eight arguments).
#pragma once

#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define SPARSEGEN_AVX2 1
#endif

namespace lanes {

#ifdef SPARSEGEN_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
#endif

// to[c] = from[c] for c < dim, fp16 widened to fp32: a block of held rows widened once, into L1,
// and then read by every query of its head (widening costs a core as much as the products).
inline void widen(float* to, const c10::Half* from, int64_t dim) {
  int64_t c = 0;
#ifdef SPARSEGEN_AVX2
  for (; c + 8 <= dim; c += 8) _mm256_storeu_ps(to + c, load8(from + c));
#endif
  for (; c < dim; ++c) to[c] = static_cast<float>(from[c]);
}

// a . b for an fp32 a and an fp32 or fp16 b.
template <typename T>
inline float dot(const float* a, const T* b, int64_t dim) {
#ifdef SPARSEGEN_AVX2
  if (dim % 16 == 0) {
    __m256 even = _mm256_setzero_ps(), odd = _mm256_setzero_ps();
    for (int64_t c = 0; c < dim; c += 16) {
      even = _mm256_fmadd_ps(_mm256_loadu_ps(a + c), load8(b + c), even);
      odd = _mm256_fmadd_ps(_mm256_loadu_ps(a + c + 8), load8(b + c + 8), odd);
    }
    const __m256 sum = _mm256_add_ps(even, odd);
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
#endif
  float acc = 0.f;
  for (int64_t c = 0; c < dim; ++c) acc += a[c] * static_cast<float>(b[c]);
  return acc;
}

// acc += weight * x for an fp32 or fp16 x.
template <typename T>
inline void add_scaled(float* acc, const T* x, float weight, int64_t dim) {
#ifdef SPARSEGEN_AVX2
  if (dim % 8 == 0) {
    const __m256 w = _mm256_set1_ps(weight);
    for (int64_t c = 0; c < dim; c += 8)
      _mm256_storeu_ps(acc + c, _mm256_fmadd_ps(w, load8(x + c), _mm256_loadu_ps(acc + c)));
    return;
  }
#endif
  for (int64_t c = 0; c < dim; ++c) acc[c] += weight * static_cast<float>(x[c]);
}

#ifdef SPARSEGEN_AVX2
// The eight lanes' sums of eight vectors, in their order.
inline __m256 sums_of_eight(const __m256* a) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 more = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(pairs, more, 0x20), _mm256_permute2f128_ps(pairs, more, 0x31));
}
#endif

// out[i] = scale * (q . rows[live[i]]) for i < count, rows of `dim` fp32 or fp16 numbers. Eight
// rows at a time, each row's sum kept in its own register and the eight summed across lanes once:
// one horizontal sum per eight rows instead of one per row.
template <typename T>
inline void scores_of_rows(float* out, const float* q, const T* rows, const int64_t* live, int64_t count,
                           int64_t dim, float scale) {
  int64_t i = 0;
#ifdef SPARSEGEN_AVX2
  if (dim % 8 == 0) {
    for (; i + 8 <= count; i += 8) {
      __m256 acc[8];
      const T* row[8];
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_setzero_ps(), row[k] = rows + live[i + k] * dim;
      for (int64_t c = 0; c < dim; c += 8) {
        const __m256 qc = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qc, load8(row[k] + c), acc[k]);
      }
      _mm256_storeu_ps(out + i, _mm256_mul_ps(sums_of_eight(acc), _mm256_set1_ps(scale)));
    }
  }
#endif
  for (; i < count; ++i) out[i] = dot(q, rows + live[i] * dim, dim) * scale;
}

// out += sum over i < count of weights[i] * rows[live[i]], rows of `dim` fp32 or fp16 numbers; the
// sums held in registers 64 channels at a time rather than stored and loaded again per row.
template <typename T>
inline void mix_rows(float* out, const T* rows, const int64_t* live, const float* weights, int64_t count,
                     int64_t dim) {
#ifdef SPARSEGEN_AVX2
  if (dim % 64 == 0) {
    for (int64_t c0 = 0; c0 < dim; c0 += 64) {
      __m256 acc[8];
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_loadu_ps(out + c0 + 8 * k);
      for (int64_t i = 0; i < count; ++i) {
        const T* row = rows + live[i] * dim + c0;
        const __m256 w = _mm256_set1_ps(weights[i]);
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(w, load8(row + 8 * k), acc[k]);
      }
      for (int k = 0; k < 8; ++k) _mm256_storeu_ps(out + c0 + 8 * k, acc[k]);
    }
    return;
  }
#endif
  for (int64_t i = 0; i < count; ++i) add_scaled(out, rows + live[i] * dim, weights[i], dim);
}

#ifdef SPARSEGEN_AVX2
// exp of eight arguments in [-87.3, 88]: a degree-6 polynomial on the reduced argument and the
// power of two put in the exponent bits (about 2 ulp), where a scalar exp per lane would cost as
// much as the work around it. Arguments outside the range must be clamped by the caller.
inline __m256 exp8(__m256 a) {
  const __m256 log2e = _mm256_set1_ps(1.44269504f);
  const __m256 ln2_hi = _mm256_set1_ps(0.693359375f), ln2_lo = _mm256_set1_ps(-2.12194440e-4f);
  const float coefficients[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                1.6666665459e-1f, 5.0000001201e-1f};
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(a, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, ln2_lo, _mm256_fnmadd_ps(n, ln2_hi, a));
  __m256 p = _mm256_set1_ps(coefficients[0]);
  for (int c = 1; c < 6; ++c) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(coefficients[c]));
  p = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.f));
  const __m256i power = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}
#endif

// x[i] = exp(x[i] - top) for i < count; returns their sum (`exp8`; the arguments are <= 0, so
// only the floor needs a clamp).
inline float exp_shifted(float* x, int64_t count, float top) {
  float total = 0.f;
  int64_t i = 0;
#ifdef SPARSEGEN_AVX2
  const __m256 shift = _mm256_set1_ps(top), floor = _mm256_set1_ps(-87.3f);
  __m256 sum = _mm256_setzero_ps();
  for (; i + 8 <= count; i += 8) {
    const __m256 e = exp8(_mm256_max_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift), floor));
    _mm256_storeu_ps(x + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  for (float lane : lanes) total += lane;
#endif
  for (; i < count; ++i) total += (x[i] = std::exp(x[i] - top));
  return total;
}

}  // namespace lanes

// Causal attention of a prompt read over its own keys, bf16 in and out (float_rows.cpp's extension).
//
// torch's CPU flash attention reaches at most a fifth of these CPUs' bf16 rate at the head sizes of small
// models (64 or 128 dims, spans of 48-512 tokens: docs/benchmarks.md, "Prompt reads"). Here the
// keys of each KV head are packed once per call into blocks of kKeys keys, dimension pair by pair
// ([blocks][dim / 2][kKeys][2]: the operand order of `vdpbf16ps`, as the few-row panels), and the
// values into key pairs ([keys / 2][dim][2]). A work item is kQueryBlock query rows of one head: its
// scores over the keys its last row sees (fp32 sums of exact bf16 products), each row's softmax in
// fp32 over the keys it sees (its later keys get probability 0), the probabilities rounded to bf16
// as torch's bf16 flash attention rounds them, their products with the values summed in fp32 and
// divided by the row's sum of probabilities. Query i sees keys [0, offset + i] (offset = keys -
// queries: the queries are the last of the keys). A row's result never depends on the other rows.
#pragma once

#include "float_lanes.h"

namespace span_attention {

constexpr int64_t kKeyVectors = 2;
constexpr int64_t kKeys = kLanes * kKeyVectors;
constexpr int64_t kQueryBlock = 32;
#if !defined(SPARSEGEN_PLAIN) && defined(__AVX512F__)
constexpr int kDimVectors = 4;  // the mix tile: 4 rows x 4 vectors of 16 dims = 16 sums
#else
constexpr int kDimVectors = 2;
#endif
constexpr int kMixRows = 4;

using bf16_rows::narrow;
using bf16_rows::widen;

// keys [count, dim] of one KV head -> [blocks][dim / 2][kKeys][2], zero padded.
inline void pack_keys(const uint16_t* keys, int64_t count, int64_t dim, uint16_t* to) {
  const int64_t pairs = dim / 2, blocks = (count + kKeys - 1) / kKeys;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < pairs; ++j)
      for (int64_t o = 0; o < kKeys; ++o)
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t key = b * kKeys + o;
          to[((b * pairs + j) * kKeys + o) * 2 + h] = key < count ? keys[key * dim + 2 * j + h] : 0;
        }
}

// values [count, dim] of one KV head -> [ceil(count / 2)][dim][2], the two values of a key pair side by side.
inline void pack_values(const uint16_t* values, int64_t count, int64_t dim, uint16_t* to) {
  for (int64_t p = 0; p < (count + 1) / 2; ++p)
    for (int64_t c = 0; c < dim; ++c)
      for (int64_t h = 0; h < 2; ++h) to[(p * dim + c) * 2 + h] = 2 * p + h < count ? values[(2 * p + h) * dim + c] : 0;
}

// scores[r][0, kKeys) = query row r . the block's keys, for kR rows of `pairs` bf16 pairs each.
template <int kR>
void score_tile(const uint32_t* query, int64_t pairs, const uint16_t* block, float* scores, int64_t stride) {
#ifdef SPARSEGEN_PLAIN
  for (int r = 0; r < kR; ++r)
    for (int64_t o = 0; o < kKeys; ++o) {
      float sum = 0.f;
      for (int64_t j = 0; j < pairs; ++j) {
        const uint32_t both = query[r * pairs + j];
        const uint16_t* pair = block + (j * kKeys + o) * 2;
        sum += widen(pair[0]) * widen(static_cast<uint16_t>(both)) +
               widen(pair[1]) * widen(static_cast<uint16_t>(both >> 16));
      }
      scores[r * stride + o] = sum;
    }
#else
  Vec acc[kR][kKeyVectors];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kKeyVectors; ++v) acc[r][v] = zero();
  for (int64_t j = 0; j < pairs; ++j) {
    bf16_rows::Bits keys[kKeyVectors];
    for (int v = 0; v < kKeyVectors; ++v) keys[v] = bf16_rows::load_bits(block + (j * kKeys + v * kLanes) * 2);
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r) {
      const bf16_rows::Bits q = bf16_rows::broadcast_bits(query[r * pairs + j]);
      for (int v = 0; v < kKeyVectors; ++v) acc[r][v] = bf16_rows::pair_product(acc[r][v], keys[v], q);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kKeyVectors; ++v) store(scores + r * stride + v * kLanes, acc[r][v]);
#endif
}

// out[r][0, kV * kLanes) = sum over key pairs p < `pairs` of the row's probability pair p times
// the values' dims [c0, c0 + kV * kLanes) of that pair; probabilities as bf16 pairs in 32-bit words.
template <int kR, int kV>
void mix_tile(const uint32_t* probs, int64_t stride, int64_t pairs, const uint16_t* values, int64_t dim, int64_t c0,
              float* out) {
  constexpr int64_t kWidthHere = kV * kLanes;
#ifdef SPARSEGEN_PLAIN
  for (int r = 0; r < kR; ++r)
    for (int64_t c = 0; c < kWidthHere; ++c) {
      float sum = 0.f;
      for (int64_t p = 0; p < pairs; ++p) {
        const uint32_t both = probs[r * stride + p];
        const uint16_t* pair = values + (p * dim + c0 + c) * 2;
        sum += widen(pair[0]) * widen(static_cast<uint16_t>(both)) +
               widen(pair[1]) * widen(static_cast<uint16_t>(both >> 16));
      }
      out[r * kWidthHere + c] = sum;
    }
#else
  Vec acc[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = zero();
  for (int64_t p = 0; p < pairs; ++p) {
    bf16_rows::Bits line[kV];
    for (int v = 0; v < kV; ++v) line[v] = bf16_rows::load_bits(values + (p * dim + c0 + v * kLanes) * 2);
    for (int r = 0; r < kR; ++r) {
      const bf16_rows::Bits weights = bf16_rows::broadcast_bits(probs[r * stride + p]);
      for (int v = 0; v < kV; ++v) acc[r][v] = bf16_rows::pair_product(acc[r][v], line[v], weights);
    }
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) store(out + r * kWidthHere + v * kLanes, acc[r][v]);
#endif
}

template <int kR>
void scores_of(int64_t count, const uint32_t* query, int64_t pairs, const uint16_t* block, float* scores,
               int64_t stride) {
  if constexpr (kR > 1) {
    if (count < kR) return scores_of<kR - 1>(count, query, pairs, block, scores, stride);
  }
  score_tile<kR>(query, pairs, block, scores, stride);
}

template <int kR>
void mix_of(int64_t count, const uint32_t* probs, int64_t stride, int64_t pairs, const uint16_t* values, int64_t dim,
            float* out) {
  if constexpr (kR > 1) {
    if (count < kR) return mix_of<kR - 1>(count, probs, stride, pairs, values, dim, out);
  }
  constexpr int64_t kChunk = kDimVectors * kLanes;
  int64_t c0 = 0;
  for (; c0 + kChunk <= dim; c0 += kChunk)
    mix_tile<kR, kDimVectors>(probs, stride, pairs, values, dim, c0, out + c0 * kR);
  for (; c0 < dim; c0 += kLanes) mix_tile<kR, 1>(probs, stride, pairs, values, dim, c0, out + c0 * kR);
}

// Softmax of one row's first `seen` scores (scaled) as bf16 probabilities in `probs` (pairs in
// 32-bit words, zero up to `width` pairs); returns the sum the mixed values are divided by.
inline float probabilities(float* scores, int64_t seen, float scaling, uint32_t* probs, int64_t width) {
  float top = -INFINITY;
  int64_t k = 0;
#if !defined(SPARSEGEN_PLAIN) && defined(__AVX512F__)
  const Vec scale = broadcast(scaling);
  Vec most = broadcast(-INFINITY);
  for (; k + kLanes <= seen; k += kLanes) {
    const Vec scaled = _mm512_mul_ps(load(scores + k), scale);
    store(scores + k, scaled);
    most = _mm512_max_ps(most, scaled);
  }
  top = _mm512_reduce_max_ps(most);
#endif
  for (; k < seen; ++k) top = std::max(top, scores[k] *= scaling);
  const float total = lanes::exp_shifted(scores, seen, top);
  uint16_t* halves = reinterpret_cast<uint16_t*>(probs);
  k = 0;
#if !defined(SPARSEGEN_PLAIN) && defined(__AVX512BF16__)
  for (; k + kLanes <= seen; k += kLanes)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves + k), (__m256i)_mm512_cvtneps_pbh(load(scores + k)));
#endif
  for (; k < seen; ++k) halves[k] = narrow(scores[k]);
  std::fill(halves + seen, halves + 2 * width, uint16_t{0});
  return total;
}

// One work item: rows [i0, i0 + count) of head `head` -> out rows (bf16 bits).
struct Span {
  const uint32_t* query;  // [heads][queries][dim / 2]
  const uint16_t* keys;   // packed, [kv heads][blocks][dim / 2][kKeys][2]
  const uint16_t* values;  // packed, [kv heads][pairs][dim][2]
  uint16_t* out;          // [heads][queries][dim]
  int64_t queries, offset, dim, group, key_blocks, key_pairs;
  float scaling;

  // Where mix_of left (row r, dim c) of `rows` rows: each chunk of dims holds its rows one after another.
  int64_t mixed_at(int64_t r, int64_t c, int64_t rows) const {
    constexpr int64_t kChunk = kDimVectors * kLanes;
    const int64_t width = c < dim / kChunk * kChunk ? kChunk : kLanes, start = c / width * width;
    return start * rows + r * width + (c - start);
  }

  void run(int64_t head, int64_t i0, int64_t count, std::vector<float>& scores, std::vector<uint32_t>& probs,
            std::vector<float>& mixed) const {
    const int64_t pairs = dim / 2, kv = head / group, seen_last = offset + i0 + count;
    const int64_t stride = (seen_last + kKeys - 1) / kKeys * kKeys, width = (seen_last + 1) / 2;
    scores.resize(kQueryBlock * stride);
    probs.resize(kQueryBlock * width);
    const uint32_t* q = query + (head * queries + i0) * pairs;
    const uint16_t* key_base = keys + kv * key_blocks * pairs * kKeys * 2;
    for (int64_t r0 = 0; r0 < count; r0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, count - r0), seen = offset + i0 + r0 + rows;
      for (int64_t b = 0; b * kKeys < seen; ++b)
        scores_of<kRows>(rows, q + r0 * pairs, pairs, key_base + b * pairs * kKeys * 2,
                         scores.data() + r0 * stride + b * kKeys, stride);
    }
    float totals[kQueryBlock];
    for (int64_t r = 0; r < count; ++r)
      totals[r] = probabilities(scores.data() + r * stride, offset + i0 + r + 1, scaling, probs.data() + r * width,
                                width);
    mixed.resize(kMixRows * dim);
    const uint16_t* value_base = values + kv * key_pairs * dim * 2;
    for (int64_t r0 = 0; r0 < count; r0 += kMixRows) {
      const int64_t rows = std::min<int64_t>(kMixRows, count - r0), seen = offset + i0 + r0 + rows;
      mix_of<kMixRows>(rows, probs.data() + r0 * width, width, (seen + 1) / 2, value_base, dim, mixed.data());
      for (int64_t r = 0; r < rows; ++r) {
        uint16_t* row = out + (head * queries + i0 + r0 + r) * dim;
        for (int64_t c = 0; c < dim; ++c) row[c] = narrow(mixed[mixed_at(r, c, rows)] / totals[r0 + r]);
      }
    }
  }
};

}  // namespace span_attention

// Causal attention of a prompt read over its own keys, bf16 or fp32 (float_rows.cpp's extension).
//
// torch's CPU flash attention reaches at most a fifth of these CPUs' bf16 rate at the head sizes of
// small models (64 or 128 dims, spans of 48-512 tokens: docs/benchmarks.md, "Prompt reads"). Here
// the keys of each KV head are packed once per call into blocks of kKeys keys, word by word along
// the head's dims ([blocks][dim / per word][kKeys] words), and the values word by word along the
// keys ([keys / per word][dim] words). A word is what a vector lane holds: a pair of bf16 values
// (the operand order of `vdpbf16ps`, as the few-row panels) or one fp32 value. A work item is
// kQueryBlock query rows of one head: its scores over the keys its last row sees (fp32 sums of
// exact products), each row's softmax in fp32 over the keys it sees (its later keys get
// probability 0), bf16 probabilities rounded as torch's bf16 flash attention rounds them, their
// products with the values summed in fp32 and divided by the row's sum of probabilities. Query i
// sees keys [0, offset + i] (offset = keys - queries: the queries are the last of the keys). A
// row's result never depends on the other rows.
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

// bf16 pairs in 32-bit words.
struct PairWords {
  using Element = uint16_t;
  using Word = uint32_t;
  static constexpr int64_t kPer = 2;
  static Word join(const Element* first, int64_t step, int64_t valid) {
    return (valid > 0 ? first[0] : 0u) | (valid > 1 ? static_cast<uint32_t>(first[step]) << 16 : 0u);
  }
  static float product(Word a, Word b) {
    return widen(static_cast<uint16_t>(a)) * widen(static_cast<uint16_t>(b)) +
           widen(static_cast<uint16_t>(a >> 16)) * widen(static_cast<uint16_t>(b >> 16));
  }
  static Element stored(float value) { return narrow(value); }
#ifndef SPARSEGEN_PLAIN
  static Vec step(Vec acc, const Word* line, Word x) {
    return bf16_rows::pair_product(acc, bf16_rows::load_bits(reinterpret_cast<const uint16_t*>(line)),
                                   bf16_rows::broadcast_bits(x));
  }
#endif
  // probabilities [seen] -> bf16 words, zero up to `width` words
  static void words_of(const float* probs, int64_t seen, Word* out, int64_t width) {
    uint16_t* halves = reinterpret_cast<uint16_t*>(out);
    int64_t k = 0;
#if !defined(SPARSEGEN_PLAIN) && defined(__AVX512BF16__)
    for (; k + kLanes <= seen; k += kLanes)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(halves + k), (__m256i)_mm512_cvtneps_pbh(load(probs + k)));
#endif
    for (; k < seen; ++k) halves[k] = narrow(probs[k]);
    std::fill(halves + seen, halves + 2 * width, uint16_t{0});
  }
};

// fp32 values, one a word.
struct FloatWords {
  using Element = float;
  using Word = float;
  static constexpr int64_t kPer = 1;
  static Word join(const Element* first, int64_t, int64_t valid) { return valid > 0 ? first[0] : 0.f; }
  static float product(Word a, Word b) { return a * b; }
  static Element stored(float value) { return value; }
#ifndef SPARSEGEN_PLAIN
  static Vec step(Vec acc, const Word* line, Word x) { return fma(load(line), broadcast(x), acc); }
#endif
  static void words_of(const float* probs, int64_t seen, Word* out, int64_t width) {
    std::copy(probs, probs + seen, out);
    std::fill(out + seen, out + width, 0.f);
  }
};

// keys [count, dim] of one KV head -> [blocks][dim / kPer][kKeys] words, zero padded.
template <typename W>
void pack_keys(const typename W::Element* keys, int64_t count, int64_t dim, typename W::Word* to) {
  const int64_t depth = dim / W::kPer, blocks = (count + kKeys - 1) / kKeys;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t j = 0; j < depth; ++j)
      for (int64_t o = 0; o < kKeys; ++o) {
        const int64_t key = b * kKeys + o;
        to[(b * depth + j) * kKeys + o] = W::join(keys + std::min(key, count - 1) * dim + j * W::kPer, 1,
                                                  key < count ? W::kPer : 0);
      }
}

// values [count, dim] of one KV head -> [ceil(count / kPer)][dim] words: a word holds kPer keys' value.
template <typename W>
void pack_values(const typename W::Element* values, int64_t count, int64_t dim, typename W::Word* to) {
  for (int64_t p = 0; p < (count + W::kPer - 1) / W::kPer; ++p)
    for (int64_t c = 0; c < dim; ++c)
      to[p * dim + c] = W::join(values + p * W::kPer * dim + c, dim, std::min(W::kPer, count - p * W::kPer));
}

// out[r][0, kV * kLanes) = sum over j < depth of x[r][j] times the lanes of line j (`pitch` words
// apart); kR rows of x, `stride` words apart. Both the scores (x: queries, lines: a key block) and
// the mix (x: probabilities, lines: the values' dims) are this product.
template <typename W, int kR, int kV>
void tile(const typename W::Word* x, int64_t stride, int64_t depth, const typename W::Word* lines, int64_t pitch,
          float* out, int64_t out_stride) {
#ifdef SPARSEGEN_PLAIN
  for (int r = 0; r < kR; ++r)
    for (int64_t o = 0; o < kV * kLanes; ++o) {
      float sum = 0.f;
      for (int64_t j = 0; j < depth; ++j) sum += W::product(lines[j * pitch + o], x[r * stride + j]);
      out[r * out_stride + o] = sum;
    }
#else
  Vec acc[kR][kV];
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) acc[r][v] = zero();
  for (int64_t j = 0; j < depth; ++j) {
    const typename W::Word* line = lines + j * pitch;
#pragma GCC unroll 8
    for (int r = 0; r < kR; ++r)
      for (int v = 0; v < kV; ++v) acc[r][v] = W::step(acc[r][v], line + v * kLanes, x[r * stride + j]);
  }
  for (int r = 0; r < kR; ++r)
    for (int v = 0; v < kV; ++v) store(out + r * out_stride + v * kLanes, acc[r][v]);
#endif
}

// tile<W, count rows, kV> for 1 <= count <= kR.
template <typename W, int kR, int kV>
void tile_of(int64_t count, const typename W::Word* x, int64_t stride, int64_t depth, const typename W::Word* lines,
             int64_t pitch, float* out, int64_t out_stride) {
  if constexpr (kR > 1) {
    if (count < kR) return tile_of<W, kR - 1, kV>(count, x, stride, depth, lines, pitch, out, out_stride);
  }
  tile<W, kR, kV>(x, stride, depth, lines, pitch, out, out_stride);
}

// Softmax of one row's first `seen` scores (scaled) in place; returns their sum.
inline float softmax(float* scores, int64_t seen, float scaling) {
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
  return lanes::exp_shifted(scores, seen, top);
}

// The work items' shared inputs: rows [i0, i0 + count) of head `head` -> out rows.
template <typename W>
struct Span {
  using Word = typename W::Word;
  const Word* query;          // [heads][queries][dim / kPer]
  const Word* keys;           // packed, [kv heads][blocks][dim / kPer][kKeys]
  const Word* values;         // packed, [kv heads][value words][dim]
  typename W::Element* out;  // [heads][queries][dim]
  int64_t queries, offset, dim, group, key_blocks, value_words;
  float scaling;

  void run(int64_t head, int64_t i0, int64_t count, std::vector<float>& scores, std::vector<Word>& probs,
           std::vector<float>& mixed) const {
    const int64_t depth = dim / W::kPer, kv = head / group, seen_last = offset + i0 + count;
    const int64_t stride = (seen_last + kKeys - 1) / kKeys * kKeys, width = (seen_last + W::kPer - 1) / W::kPer;
    scores.resize(kQueryBlock * stride);
    probs.resize(kQueryBlock * width);
    const Word* q = query + (head * queries + i0) * depth;
    const Word* key_base = keys + kv * key_blocks * depth * kKeys;
    for (int64_t r0 = 0; r0 < count; r0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, count - r0), seen = offset + i0 + r0 + rows;
      for (int64_t b = 0; b * kKeys < seen; ++b)
        tile_of<W, kRows, kKeyVectors>(rows, q + r0 * depth, depth, depth, key_base + b * depth * kKeys, kKeys,
                                       scores.data() + r0 * stride + b * kKeys, stride);
    }
    float totals[kQueryBlock];
    for (int64_t r = 0; r < count; ++r) {
      const int64_t seen = offset + i0 + r + 1;
      totals[r] = softmax(scores.data() + r * stride, seen, scaling);
      W::words_of(scores.data() + r * stride, seen, probs.data() + r * width, width);
    }
    mixed.resize(kMixRows * dim);
    for (int64_t r0 = 0; r0 < count; r0 += kMixRows) {
      const int64_t rows = std::min<int64_t>(kMixRows, count - r0), seen = offset + i0 + r0 + rows;
      mix(rows, probs.data() + r0 * width, width, (seen + W::kPer - 1) / W::kPer, kv, mixed.data());
      for (int64_t r = 0; r < rows; ++r) {
        typename W::Element* row = out + (head * queries + i0 + r0 + r) * dim;
        for (int64_t c = 0; c < dim; ++c) row[c] = W::stored(mixed[r * dim + c] / totals[r0 + r]);
      }
    }
  }

  // mixed[r][0, dim) = the probabilities of row r (`words` of them) times the values of KV head `kv`.
  void mix(int64_t rows, const Word* probs, int64_t width, int64_t words, int64_t kv, float* mixed) const {
    constexpr int64_t kChunk = kDimVectors * kLanes;
    const Word* base = values + kv * value_words * dim;
    int64_t c0 = 0;
    for (; c0 + kChunk <= dim; c0 += kChunk)
      tile_of<W, kMixRows, kDimVectors>(rows, probs, width, words, base + c0, dim, mixed + c0, dim);
    for (; c0 < dim; c0 += kLanes) tile_of<W, kMixRows, 1>(rows, probs, width, words, base + c0, dim, mixed + c0, dim);
  }
};

}  // namespace span_attention

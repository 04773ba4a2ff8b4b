// The fp32 product of a decode step's few rows with a linear layer's weight, streamed once.
//
// With 2 to 16 rows, MKL's sgemm (either way round) reads the weight at a third of the memory
// bus's speed on these CPUs (docs/benchmarks.md, "the server's batched step"). Here the weight is
// packed once into panels of kWidth output features, input by input ([panels][in][kWidth]), so
// each thread streams its panels front to back. For a tile of up to kRows input rows, every input
// value is broadcast and multiplied into the panel's kWidth sums of each row: the weight is read
// from memory once for all the rows, and no sum is split across vector lanes, so a row's result
// never depends on the other rows in the call. Sums run in blocks of kBlock inputs, added into the
// output between blocks (a bounded rounding error, as a blocked sum).
//
//   float_rows_pack(weight [out, in]) -> packed [ceil(out / kWidth), in, kWidth] (zero padded)
//   float_rows_linear(x [rows, in], packed, out) -> [rows, out]
// A bf16 weight packs into bf16 panels of input pairs and multiplies bf16 rows (float_rows_bf16.h).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
using Vec = __m512;
constexpr int64_t kLanes = 16;
constexpr int kVectors = 3;  // 8 rows x 3 vectors = 24 sums, 3 weight vectors and a broadcast: 28 of 32 registers
constexpr int kRows = 8;
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec broadcast(float v) { return _mm512_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
using Vec = __m256;
constexpr int64_t kLanes = 8;
constexpr int kVectors = 3;  // 4 rows x 3 vectors = 12 sums of 16 registers
constexpr int kRows = 4;
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec broadcast(float v) { return _mm256_set1_ps(v); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
#else
#define SPARSEGEN_PLAIN 1
constexpr int64_t kLanes = 8;
constexpr int kVectors = 1;
constexpr int kRows = 4;
#endif

namespace {

constexpr int64_t kWidth = kLanes * kVectors;
constexpr int64_t kBlock = 64;
constexpr int64_t kPrefetch = 32 * kWidth;  // floats ahead, for one or two rows (more rows hide the latency)

// sums[r][0, kWidth) = x[r0 + r, :] . panel for rows [r0, r0 + kR).
template <int kR>
void tile(const float* x, const float* panel, int64_t in, int64_t r0, bool prefetch, float* sums) {
#ifdef SPARSEGEN_PLAIN
  std::fill(sums, sums + kR * kWidth, 0.f);
  for (int64_t b = 0; b < in; b += kBlock) {
    float part[kR][kWidth] = {};
    for (int64_t j = b; j < std::min(in, b + kBlock); ++j)
      for (int r = 0; r < kR; ++r)
        for (int64_t o = 0; o < kWidth; ++o) part[r][o] += x[(r0 + r) * in + j] * panel[j * kWidth + o];
    for (int r = 0; r < kR; ++r)
      for (int64_t o = 0; o < kWidth; ++o) sums[r * kWidth + o] += part[r][o];
  }
#else
  for (int64_t b = 0; b < in; b += kBlock) {
    Vec acc[kR][kVectors];
    for (int r = 0; r < kR; ++r)
      for (int v = 0; v < kVectors; ++v) acc[r][v] = zero();
    for (int64_t j = b; j < std::min(in, b + kBlock); ++j) {
      const float* w = panel + j * kWidth;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetch), _MM_HINT_T0);
      Vec wv[kVectors];
#pragma GCC unroll 4
      for (int v = 0; v < kVectors; ++v) wv[v] = load(w + v * kLanes);
#pragma GCC unroll 8
      for (int r = 0; r < kR; ++r) {
        const Vec xv = broadcast(x[(r0 + r) * in + j]);
#pragma GCC unroll 4
        for (int v = 0; v < kVectors; ++v) acc[r][v] = fma(wv[v], xv, acc[r][v]);
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int v = 0; v < kVectors; ++v) {
        float* s = sums + r * kWidth + v * kLanes;
        store(s, b == 0 ? acc[r][v] : add(load(s), acc[r][v]));
      }
  }
#endif
}

// Tile::run<R>(args...) for a tile of 1 <= count <= kRows rows: each size its own code.
template <typename Tile, typename... Args>
void by_tile(int64_t count, Args... args) {
  switch (count) {
    case 1: return Tile::template run<1>(args...);
    case 2: return Tile::template run<2>(args...);
    case 3: return Tile::template run<3>(args...);
#if !defined(SPARSEGEN_PLAIN) && defined(__AVX512F__)
    case 4: return Tile::template run<4>(args...);
    case 5: return Tile::template run<5>(args...);
    case 6: return Tile::template run<6>(args...);
    case 7: return Tile::template run<7>(args...);
#endif
    default: return Tile::template run<kRows>(args...);
  }
}

struct FloatTile {
  template <int kR>
  static void run(const float* x, const float* panel, int64_t in, int64_t r0, bool prefetch, float* sums) {
    tile<kR>(x, panel, in, r0, prefetch, sums);
  }
  static float store(float sum) { return sum; }
};

// out[:, o0, o0 + width) for every row, from one panel (`depth` inputs, or input pairs, a line),
// each sum stored through Tile::store (as it is, or rounded to bf16).
template <typename Tile, typename In, typename Weight, typename Out>
void panel_rows(const In* x, const Weight* panel, int64_t rows, int64_t depth, int64_t out_features, int64_t o0,
                Out* out) {
  float sums[kRows * kWidth];
  const int64_t width = std::min(kWidth, out_features - o0);
  const bool prefetch = rows <= 2;
  for (int64_t r0 = 0; r0 < rows; r0 += kRows) {
    const int64_t count = std::min<int64_t>(kRows, rows - r0);
    by_tile<Tile>(count, x, panel, depth, r0, prefetch, sums);
    for (int64_t r = 0; r < count; ++r)
      for (int64_t o = 0; o < width; ++o) out[(r0 + r) * out_features + o0 + o] = Tile::store(sums[r * kWidth + o]);
  }
}

}  // namespace

#include "float_rows_bf16.h"
#include "span_attention.h"

torch::Tensor float_rows_pack(torch::Tensor weight) {
  TORCH_CHECK((weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16) && weight.dim() == 2,
              "float_rows_pack: weight must be fp32 or bf16 [out, in]");
  const auto source = weight.contiguous();
  const int64_t out_features = source.size(0), in = source.size(1);
  const int64_t panels = (out_features + kWidth - 1) / kWidth;
  if (source.scalar_type() == torch::kBFloat16) {
    auto packed = torch::empty({panels, (in + 1) / 2, kWidth, 2}, source.options());
    bf16_rows::pack(reinterpret_cast<const uint16_t*>(source.data_ptr<at::BFloat16>()), out_features, in,
                    reinterpret_cast<uint16_t*>(packed.data_ptr<at::BFloat16>()));
    return packed;
  }
  auto packed = torch::empty({panels, in, kWidth}, source.options());
  const float* from = source.data_ptr<float>();
  float* to = packed.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      for (int64_t j = 0; j < in; ++j) {  // the panel's line for input j, from its rows' column j
        float* line = to + (p * in + j) * kWidth;
        for (int64_t o = 0; o < kWidth; ++o) {
          const int64_t row = p * kWidth + o;
          line[o] = row < out_features ? from[row * in + j] : 0.f;
        }
      }
  });
  return packed;
}

// The bf16 product: x [rows, in] bf16 over bf16 panels [panels, in / 2, kWidth, 2] -> [rows, out] bf16.
torch::Tensor bf16_rows_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "float_rows_linear: x must be bf16 [rows, in], contiguous, over bf16 panels");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) == (x.size(1) + 1) / 2 &&
                  packed.size(2) == kWidth && packed.size(3) == 2 &&
                  packed.size(0) == (out_features + kWidth - 1) / kWidth,
              "float_rows_linear: packed must be float_rows_pack's panels of a weight with x's in and out_features");
  const int64_t rows = x.size(0), pairs = packed.size(1), panels = packed.size(0);
  const auto inputs = bf16_rows::input_pairs(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), rows,
                                             x.size(1));
  auto out = torch::empty({rows, out_features}, x.options());
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      panel_rows<bf16_rows::PairTile>(inputs.data(), wp + p * pairs * kWidth * 2, rows, pairs, out_features,
                                      p * kWidth, op);
  });
  return out;
}

// Rows up to which torch's GEMM past the panels goes weight first (`weight @ x.T`, then laid out as
// rows): on an Intel Xeon with AMX, the default model's 210 bf16 products, cold, 14.3 ms against
// `at::linear`'s 18.4 at 8 rows, 15.5 against 18.6 at 16, 18.8 against 19.5 at 20, 20.9 against 19.8 at
// 24 (scripts/few_rows_time.py --bf16; docs/benchmarks.md).
constexpr int64_t kWeightFirstRows = 20;

// torch's weight-first product [out, rows] laid out as rows [rows, out]: a plain loop over columns in
// blocks of 16 (torch's strided copy takes 11 us for 1,536 x 8 bf16 values, a tenth of the product).
torch::Tensor weight_first_rows(const torch::Tensor& x, const torch::Tensor& weight) {
  const auto product = at::mm(weight, x.t());
  const int64_t outs = product.size(0), rows = product.size(1);
  auto out = torch::empty({rows, outs}, x.options());
  const int64_t size = x.element_size();
  TORCH_CHECK(size == 2 || size == 4, "float_rows_linear: x must be bf16 or fp32");
  const auto move = [&](auto* to, const auto* from) {
    for (int64_t o0 = 0; o0 < outs; o0 += 16) {
      const int64_t o1 = std::min<int64_t>(o0 + 16, outs);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t o = o0; o < o1; ++o) to[r * outs + o] = from[o * rows + r];
    }
  };
  if (size == 2) move(reinterpret_cast<uint16_t*>(out.data_ptr()), reinterpret_cast<const uint16_t*>(product.data_ptr()));
  else move(reinterpret_cast<uint32_t*>(out.data_ptr()), reinterpret_cast<const uint32_t*>(product.data_ptr()));
  return out;
}

// With `weight` (the layer's own, unpacked) and more than `gemm_above_rows` rows, the product is
// torch's GEMM instead (oneDNN's, AMX tiles where the CPU has them), weight first up to
// kWeightFirstRows rows: a compiled step of any row count decides at run time, with no guard on the row count.
torch::Tensor float_rows_linear(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                const std::optional<torch::Tensor>& weight, int64_t gemm_above_rows) {
  if (weight.has_value() && gemm_above_rows >= 0 && x.size(0) > gemm_above_rows) {
    TORCH_CHECK(weight->dim() == 2 && weight->size(0) == out_features && weight->size(1) == x.size(1),
                "float_rows_linear: weight must be [out_features, in] of x's in");
    if (x.size(0) <= kWeightFirstRows) return weight_first_rows(x, *weight);
    return at::linear(x, *weight);
  }
  if (packed.scalar_type() == torch::kBFloat16) return bf16_rows_linear(x, packed, out_features);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous(),
              "float_rows_linear: x must be fp32 [rows, in], contiguous");
  TORCH_CHECK(packed.scalar_type() == torch::kFloat && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(1) == x.size(1) && packed.size(2) == kWidth &&
                  packed.size(0) == (out_features + kWidth - 1) / kWidth,
              "float_rows_linear: packed must be float_rows_pack's panels of a weight with x's in and out_features");
  const int64_t rows = x.size(0), in = x.size(1), panels = packed.size(0);
  auto out = torch::empty({rows, out_features}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = packed.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p)
      panel_rows<FloatTile>(xp, wp + p * in * kWidth, rows, in, out_features, p * kWidth, op);
  });
  return out;
}

// The shapes alone, for tracing: a compiled step keeps the op as one opaque call, for any row count.
torch::Tensor float_rows_linear_meta(torch::Tensor x, torch::Tensor packed, int64_t out_features,
                                     const std::optional<torch::Tensor>& weight, int64_t gemm_above_rows) {
  return at::empty_symint({x.sym_size(0), c10::SymInt(out_features)}, x.options());
}

namespace span_attention {

template <typename W>
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, float scaling) {
  using Element = typename W::Element;
  using Word = typename W::Word;
  const int64_t heads = q.size(0), queries = q.size(1), dim = q.size(2), kv_heads = k.size(0), count = k.size(1);
  const int64_t blocks = (count + kKeys - 1) / kKeys, value_words = (count + W::kPer - 1) / W::kPer;
  std::vector<Word> keys(kv_heads * blocks * kKeys * dim / W::kPer), values(kv_heads * value_words * dim);
  const auto elements = [](const torch::Tensor& t) { return reinterpret_cast<Element*>(t.data_ptr()); };
  at::parallel_for(0, 2 * kv_heads, 1, [&](int64_t first, int64_t last) {
    for (int64_t i = first; i < last; ++i) {
      const int64_t h = i / 2;
      if (i % 2 == 0)
        pack_keys<W>(elements(k) + h * count * dim, count, dim, keys.data() + h * blocks * kKeys * dim / W::kPer);
      else
        pack_values<W>(elements(v) + h * count * dim, count, dim, values.data() + h * value_words * dim);
    }
  });
  auto out = torch::empty({heads, queries, dim}, q.options());
  const Span<W> span{reinterpret_cast<const Word*>(q.data_ptr()), keys.data(), values.data(), elements(out), queries,
                     count - queries, dim, heads / kv_heads, blocks, value_words, scaling};
  const int64_t query_blocks = (queries + kQueryBlock - 1) / kQueryBlock;
  // items in the order first block, last block, second, second to last...: each thread's even share
  // of them holds as many keys to read as the other's
  at::parallel_for(0, heads * query_blocks, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores, mixed;
    std::vector<Word> probs;
    for (int64_t item = first; item < last; ++item) {
      const int64_t turn = item / heads, head = item % heads;
      const int64_t block = turn % 2 == 0 ? turn / 2 : query_blocks - 1 - turn / 2;
      const int64_t i0 = block * kQueryBlock;
      span.run(head, i0, std::min(kQueryBlock, queries - i0), scores, probs, mixed);
    }
  });
  return out;
}

}  // namespace span_attention

// Causal attention of a prompt read: query [heads, queries, dim], key and value [kv heads, keys,
// dim], all bf16 or all fp32, keys >= queries (the queries are the last keys) -> [heads, queries, dim].
torch::Tensor span_attention_op(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scaling) {
  const auto type = query.scalar_type();
  const bool same = key.scalar_type() == type && value.scalar_type() == type;
  TORCH_CHECK(same && (type == torch::kBFloat16 || type == torch::kFloat) && query.dim() == 3 && key.dim() == 3 &&
                  value.sizes() == key.sizes(),
              "span_attention: query [heads, queries, dim], key and value [kv heads, keys, dim], all bf16 or all fp32");
  const int64_t dim = query.size(2);
  TORCH_CHECK(key.size(2) == dim && dim % 16 == 0 && query.size(0) % key.size(0) == 0 && key.size(1) >= query.size(1),
              "span_attention: dims must match (a multiple of 16), heads a multiple of kv heads, keys >= queries");
  const auto q = query.contiguous(), k = key.contiguous(), v = value.contiguous();
  const float scale = static_cast<float>(scaling);
  if (type == torch::kBFloat16) return span_attention::attend<span_attention::PairWords>(q, k, v, scale);
  return span_attention::attend<span_attention::FloatWords>(q, k, v, scale);
}

torch::Tensor span_attention_meta(torch::Tensor query, torch::Tensor key, torch::Tensor value, double scaling) {
  return at::empty_symint(query.sym_sizes(), query.options());
}

// Registered with the dispatcher from C++, so a call costs no Python.
TORCH_LIBRARY_FRAGMENT(sparsegen, m) {
  m.def("float_rows_pack(Tensor weight) -> Tensor");
  m.def("float_rows_linear(Tensor x, Tensor packed, int out_features, Tensor? weight=None, int gemm_above_rows=-1) -> Tensor");
  m.def("span_attention(Tensor query, Tensor key, Tensor value, float scaling) -> Tensor");
}
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("float_rows_pack", &float_rows_pack);
  m.impl("float_rows_linear", &float_rows_linear);
  m.impl("span_attention", &span_attention_op);
}
TORCH_LIBRARY_IMPL(sparsegen, Meta, m) {
  m.impl("float_rows_linear", &float_rows_linear_meta);
  m.impl("span_attention", &span_attention_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

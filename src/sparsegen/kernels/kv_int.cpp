// Attention products over the held KV without a float copy of the cache: over keys and values held
// as byte rows (kv_scores, kv_mix), and over full-precision keys at rolling positions (rolled_scores);
// and a decode step's whole attention over fp32 or fp16 slots in one call (slot_attention).
//
// Byte rows (sparsegen/kv/quantized.py): each row is D codes (one byte each at 8 bits, two a byte at 4, low
// nibble first) followed by, per group of `group` channels, an fp16 scale and an fp16 minimum. A slot whose
// token is among its row's first `sinks` or newest RESIDUAL is read from the full-precision ring instead
// (slots 0..sinks-1 hold the first tokens, the rest the newest by position mod RESIDUAL), and a free slot
// (position < 0) is skipped. Each row is decoded into a buffer that stays in L1 and used at once for every
// query of its head, so a step reads the bytes and never a float copy of the cache.
//
// The decoded buffer is in "code order": at 4 bits the low nibbles' channels (0, 2, 4, ...) then
// the high nibbles' (1, 3, 5, ...), which one shift and mask give without shuffles; the queries
// are permuted into that order once per task and the mixed values permuted back at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include "float_lanes.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxDim = 512;

struct Rows {  // one [b, h, n, width] byte tensor, its ring [b, h, sinks + R, d] fp32 and slot positions [b, h, n]
  const uint8_t* bytes;
  int64_t s0, s1, s2;
  const float* ring;
  int64_t ring_size, sinks;
  const int64_t* positions;
  const int64_t* seen;
  int64_t h, n, dim, bits, group;

  // The ring row to read for slot t of (bi, hi), nullptr to decode the bytes; *skip for a free slot.
  const float* ring_row(int64_t bi, int64_t hi, int64_t t, bool* skip) const {
    const int64_t pos = positions[(bi * h + hi) * n + t];
    *skip = pos < 0;
    if (pos < 0) return nullptr;
    const float* base = ring + (bi * h + hi) * ring_size * dim;
    if (pos < sinks) return base + pos * dim;
    const int64_t residual = ring_size - sinks;
    if (pos < seen[bi] - residual) return nullptr;
    return base + (sinks + pos % residual) * dim;
  }
  const uint8_t* row(int64_t bi, int64_t hi, int64_t t) const { return bytes + bi * s0 + hi * s1 + t * s2; }
};

// Channel c's index in code order.
inline int64_t code_index(int64_t c, int64_t dim, int64_t bits) {
  return bits == 8 ? c : (c % 2) * (dim / 2) + c / 2;
}

inline float half_at(const uint8_t* p) { return static_cast<float>(*reinterpret_cast<const c10::Half*>(p)); }

// One stored row -> dim floats in code order.
inline void decode_row(const uint8_t* row, const Rows& r, float* out) {
  const int64_t dim = r.dim, code_bytes = dim * r.bits / 8;
  const uint8_t* params = row + code_bytes;
#ifdef SPARSEGEN_AVX2
  if (r.group == 32 && dim % 32 == 0) {
    const __m128i low_nibbles = _mm_set1_epi8(15);
    for (int64_t g = 0; g < dim / 32; ++g) {
      const __m256 scale = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(params + 4 * g)));
      const __m256 low = _mm256_set1_ps(_cvtsh_ss(*reinterpret_cast<const uint16_t*>(params + 4 * g + 2)));
      auto put = [&](__m128i eight_codes, float* to) {
        const __m256 codes = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight_codes));
        _mm256_storeu_ps(to, _mm256_fmadd_ps(codes, scale, low));
      };
      if (r.bits == 8) {
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g));
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 32 * g + 16));
        put(a, out + 32 * g), put(_mm_srli_si128(a, 8), out + 32 * g + 8);
        put(b, out + 32 * g + 16), put(_mm_srli_si128(b, 8), out + 32 * g + 24);
      } else {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 16 * g));
        const __m128i lo = _mm_and_si128(raw, low_nibbles), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), low_nibbles);
        put(lo, out + 16 * g), put(_mm_srli_si128(lo, 8), out + 16 * g + 8);
        put(hi, out + dim / 2 + 16 * g), put(_mm_srli_si128(hi, 8), out + dim / 2 + 16 * g + 8);
      }
    }
    return;
  }
#endif
  for (int64_t c = 0; c < dim; ++c) {
    const int64_t code = r.bits == 8 ? row[c] : (c % 2 ? row[c / 2] >> 4 : row[c / 2] & 15);
    const int64_t g = c / r.group;
    out[code_index(c, dim, r.bits)] = code * half_at(params + 4 * g) + half_at(params + 4 * g + 2);
  }
}

using lanes::add_scaled;
using lanes::dot;
using lanes::exp_shifted;

Rows rows_of(const torch::Tensor& bytes, const torch::Tensor& ring, const torch::Tensor& positions,
             const torch::Tensor& seen, int64_t dim, int64_t bits, int64_t group, int64_t sinks, const char* what) {
  TORCH_CHECK(bytes.scalar_type() == torch::kUInt8 && bytes.dim() == 4 && bytes.stride(3) == 1, what,
              ": byte rows [b, h, n, width] with contiguous rows expected");
  TORCH_CHECK(ring.scalar_type() == torch::kFloat && ring.is_contiguous() && ring.size(3) == dim, what,
              ": a contiguous fp32 ring [b, h, R, d] expected");
  TORCH_CHECK(sinks >= 0 && ring.size(2) > sinks, what, ": a ring of ", ring.size(2), " slots cannot hold ", sinks,
              " first tokens and the newest");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() && seen.is_contiguous(), what,
              ": contiguous int64 positions and seen expected");
  TORCH_CHECK(dim <= kMaxDim && dim % group == 0 && (bits == 8 || (bits == 4 && dim % 2 == 0)), what,
              ": head dim ", dim, " with groups of ", group, " at ", bits, " bits is not supported");
  return Rows{bytes.data_ptr<uint8_t>(), bytes.stride(0), bytes.stride(1), bytes.stride(2),
              ring.data_ptr<float>(), ring.size(2), sinks, positions.data_ptr<int64_t>(), seen.data_ptr<int64_t>(),
              bytes.size(1), bytes.size(2), dim, bits, group};
}

}  // namespace

// query [b, h, g, d] fp32 . every held key -> [b, h, g, n] (0 at free slots). A key read from its
// bytes gets shift [b, h, g] added: rows rounded less their row's centre c are multiplied as they are,
// and q.c, the same for every such slot of a head, is added here rather than by a pass over the scores.
torch::Tensor kv_scores(torch::Tensor query, torch::Tensor keys, torch::Tensor ring, torch::Tensor positions,
                        torch::Tensor seen, torch::Tensor shift, int64_t bits, int64_t group, int64_t sinks) {
  const int64_t b = query.size(0), h = query.size(1), g = query.size(2), d = query.size(3);
  TORCH_CHECK(query.scalar_type() == torch::kFloat && query.is_contiguous(), "kv_scores: contiguous fp32 query");
  TORCH_CHECK(shift.scalar_type() == torch::kFloat && shift.is_contiguous() && shift.numel() == b * h * g,
              "kv_scores: a contiguous fp32 shift [b, h, g]");
  const float* added = shift.data_ptr<float>();
  const Rows r = rows_of(keys, ring, positions, seen, d, bits, group, sinks, "kv_scores");
  auto out = torch::zeros({b, h, g, r.n}, query.options());
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t blocks = (r.n + 255) / 256;
  at::parallel_for(0, b * h * blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float row[kMaxDim];
    std::vector<float> coded(g * d);  // the queries in code order
    int64_t coded_for = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, block = task % blocks, bi = bh / h, hi = bh % h;
      const float* qs = q + bh * g * d;
      if (coded_for != bh) {
        for (int64_t k = 0; k < g; ++k)
          for (int64_t c = 0; c < d; ++c) coded[k * d + code_index(c, d, bits)] = qs[k * d + c];
        coded_for = bh;
      }
      for (int64_t t = block * 256; t < std::min(r.n, (block + 1) * 256); ++t) {
        bool skip;
        const float* recent = r.ring_row(bi, hi, t, &skip);
        if (skip) continue;
        if (recent == nullptr) decode_row(r.row(bi, hi, t), r, row);
        for (int64_t k = 0; k < g; ++k)
          o[(bh * g + k) * r.n + t] =
              recent ? dot(qs + k * d, recent, d) : dot(coded.data() + k * d, row, d) + added[bh * g + k];
      }
    }
  });
  return out;
}

// probs [b, h, g, n] fp32 x every held value -> [b, h, g, d] (free slots skipped).
torch::Tensor kv_mix(torch::Tensor probs, torch::Tensor values, torch::Tensor ring, torch::Tensor positions,
                     torch::Tensor seen, int64_t bits, int64_t group, int64_t sinks) {
  const int64_t b = probs.size(0), h = probs.size(1), g = probs.size(2), d = ring.size(3);
  TORCH_CHECK(probs.scalar_type() == torch::kFloat && probs.is_contiguous(), "kv_mix: contiguous fp32 probs");
  const Rows r = rows_of(values, ring, positions, seen, d, bits, group, sinks, "kv_mix");
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(8, r.n / 512));
  // Per task: g accumulators in code order (decoded rows), then g in channel order (ring rows).
  auto partial = torch::zeros({b * h, blocks, 2, g, d}, probs.options());
  const float* p = probs.data_ptr<float>();
  float* acc = partial.data_ptr<float>();
  const int64_t per_block = (r.n + blocks - 1) / blocks;
  at::parallel_for(0, b * h * blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float row[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, block = task % blocks, bi = bh / h, hi = bh % h;
      float* coded = acc + task * 2 * g * d;
      float* plain = coded + g * d;
      for (int64_t t = block * per_block; t < std::min(r.n, (block + 1) * per_block); ++t) {
        bool skip;
        const float* recent = r.ring_row(bi, hi, t, &skip);
        if (skip) continue;
        if (recent == nullptr) decode_row(r.row(bi, hi, t), r, row);
        for (int64_t k = 0; k < g; ++k) {
          const float weight = p[(bh * g + k) * r.n + t];
          if (weight != 0.f) add_scaled((recent ? plain : coded) + k * d, recent ? recent : row, weight, d);
        }
      }
      for (int64_t k = 0; k < g; ++k) {  // back to channel order, into the plain accumulator
        float* from = coded + k * d;
        for (int64_t c = 0; c < d; ++c) plain[k * d + c] += from[code_index(c, d, bits)];
      }
    }
  });
  return partial.select(2, 1).sum(1).view({b, h, g, d});
}

// query [b, h, g, d] fp32 . every key [b, h, n, d] fp32 rotated by its slot's delta [b, h, n] (rolling
// positions, sparsegen/kv/rope.py) -> [b, h, g, n]. `table` [2 * reach + 1, 2 * rot] holds the cos then
// the sin of every delta -reach..reach (half-split RoPE: channel c and c + rot / 2 share an angle);
// channels from `rot` on are not rotated. Each key is rotated into a buffer in L1 and used at once for
// every query of its head, so a step reads the keys once and writes no rotated copy.
torch::Tensor rolled_scores(torch::Tensor query, torch::Tensor keys, torch::Tensor delta, torch::Tensor table,
                            int64_t reach) {
  const int64_t b = query.size(0), h = query.size(1), g = query.size(2), d = query.size(3), n = keys.size(2);
  const int64_t rot = table.size(1) / 2, half = rot / 2;
  TORCH_CHECK(query.scalar_type() == torch::kFloat && query.is_contiguous(), "rolled_scores: contiguous fp32 query");
  TORCH_CHECK(keys.scalar_type() == torch::kFloat && keys.stride(3) == 1 && keys.size(3) == d && d <= kMaxDim,
              "rolled_scores: fp32 keys [b, h, n, d] with contiguous rows expected");
  TORCH_CHECK(delta.scalar_type() == torch::kLong && delta.is_contiguous() && table.is_contiguous() && rot <= d,
              "rolled_scores: contiguous int64 deltas and an fp32 table expected");
  auto out = torch::empty({b, h, g, n}, query.options());
  const float *q = query.data_ptr<float>(), *k = keys.data_ptr<float>(), *tab = table.data_ptr<float>();
  const int64_t* dl = delta.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t s0 = keys.stride(0), s1 = keys.stride(1), s2 = keys.stride(2), blocks = (n + 255) / 256;
  at::parallel_for(0, b * h * blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float row[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, block = task % blocks, bi = bh / h, hi = bh % h;
      for (int64_t t = block * 256; t < std::min(n, (block + 1) * 256); ++t) {
        const float* key = k + bi * s0 + hi * s1 + t * s2;
        const int64_t shift = dl[bh * n + t];
        const float* from = key;
        if (shift != 0) {
          TORCH_CHECK(shift >= -reach && shift <= reach, "rolled_scores: a delta beyond the table");
          const float* cos = tab + (shift + reach) * 2 * rot;
          const float* sin = cos + rot;
#pragma omp simd
          for (int64_t c = 0; c < half; ++c) {
            row[c] = key[c] * cos[c] - key[c + half] * sin[c];
            row[c + half] = key[c + half] * cos[c + half] + key[c] * sin[c + half];
          }
          for (int64_t c = rot; c < d; ++c) row[c] = key[c];
          from = row;
        }
        for (int64_t j = 0; j < g; ++j) o[(bh * g + j) * n + t] = dot(q + (bh * g + j) * d, from, d);
      }
    }
  });
  return out;
}

constexpr int64_t kSlotBlock = 32;  // slots whose keys (values) stay in L1 while every query of their head reads them
constexpr int64_t kSlotPart = 256;  // slots a part: fixed, so a row's sums do not depend on the rows beside it

// The rows of a block of live slots as every query of their head reads them: fp32 rows where they
// are held; fp16 rows widened once into `buffer` (in L1), in block order, where each query widening
// them again cost as much as its products (the slots of 32 rows: 2.5x the bus's time).
struct BlockRows {
  const float* rows;
  const int64_t* index;
};

inline BlockRows block_rows(const float* held, const int64_t* live, int64_t, int64_t, float*, const int64_t*) {
  return {held, live};
}

inline BlockRows block_rows(const c10::Half* held, const int64_t* live, int64_t m, int64_t d, float* buffer,
                            const int64_t* in_order) {
  for (int64_t i = 0; i < m; ++i) lanes::widen(buffer + i * d, held + live[i] * d, d);
  return {buffer, in_order};
}

// The slots part of one decode step's attention: for each (row, KV head, part of the slots) item,
// the scores of the live slots (kept in L1 and used at once), their maximum, the sum of their
// exponentials and the exponential-weighted sum of their values.
template <typename T>
void attend_parts(const float* q_all, const T* k_all, const T* v_all, const int64_t* p_all, float scaling,
                  int64_t g, int64_t d, int64_t n, int64_t parts, int64_t items, float* maxima, float* sums,
                  float* mixed) {
  const int64_t span = kSlotPart;
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(g * span), buffer(std::is_same_v<T, float> ? 0 : kSlotBlock * d);
    std::vector<int64_t> live(span), in_order(kSlotBlock);
    std::iota(in_order.begin(), in_order.end(), 0);
    for (int64_t w = begin; w < end; ++w) {
      const int64_t bh = w / parts, first = (w % parts) * span, last = std::min(n, first + span);
      const float* q = q_all + bh * g * d;
      const T *k = k_all + bh * n * d, *v = v_all + bh * n * d;
      int64_t count = 0;
      for (int64_t t = first; t < last; ++t)
        if (p_all[bh * n + t] >= 0) live[count++] = t;
      for (int64_t t = 0; t < count; t += kSlotBlock) {  // each block of keys from memory once, then L1
        const int64_t m = std::min(kSlotBlock, count - t);
        const BlockRows keys = block_rows(k, live.data() + t, m, d, buffer.data(), in_order.data());
        for (int64_t j = 0; j < g; ++j)
          lanes::scores_of_rows(scores.data() + j * span + t, q + j * d, keys.rows, keys.index, m, d, scaling);
      }
      for (int64_t j = 0; j < g && count; ++j) {
        float* s = scores.data() + j * span;
        maxima[w * g + j] = *std::max_element(s, s + count);
        sums[w * g + j] = exp_shifted(s, count, maxima[w * g + j]);
      }
      for (int64_t t = 0; t < count; t += kSlotBlock) {  // values likewise, into every query's sums
        const int64_t m = std::min(kSlotBlock, count - t);
        const BlockRows rows = block_rows(v, live.data() + t, m, d, buffer.data(), in_order.data());
        for (int64_t j = 0; j < g; ++j)
          lanes::mix_rows(mixed + (w * g + j) * d, rows.rows, rows.index, scores.data() + j * span + t, m, d);
      }
      if (!count) std::fill(maxima + w * g, maxima + (w + 1) * g, -INFINITY);
    }
  });
}

// One decode step's attention over fp32 or fp16 slots: softmax(scaling * q . k) . v over each row's
// live slots (position >= 0; free and dead slots are never read), for an fp32 query [b, h, g, d],
// keys and values [b, h, n, d], positions [b, h, n] -> fp32 [b, h, g, d]. One pass per (row, KV
// head, kSlotPart slots: a long row's parts spread over the cores), merged by their maxima and sums
// in slot order: a row's result is the same whatever the rows and slot count of the call.
torch::Tensor slot_attention(torch::Tensor query, torch::Tensor keys, torch::Tensor values, torch::Tensor positions,
                             double scaling) {
  const int64_t b = query.size(0), h = query.size(1), g = query.size(2), d = query.size(3), n = keys.size(2);
  const auto held = keys.scalar_type();
  TORCH_CHECK(query.scalar_type() == torch::kFloat && (held == torch::kFloat || held == torch::kHalf) &&
                  values.scalar_type() == held,
              "slot_attention: an fp32 query, and keys and values both fp32 or both fp16 expected");
  for (const auto& t : {query, keys, values})
    TORCH_CHECK(t.is_contiguous() && t.dim() == 4 && t.size(3) == d,
                "slot_attention: contiguous query [b, h, g, d], keys and values [b, h, n, d] expected");
  TORCH_CHECK(keys.sizes() == values.sizes() && keys.size(0) == b && keys.size(1) == h,
              "slot_attention: keys and values [b, h, n, d] for query [b, h, g, d] expected");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.is_contiguous() && positions.dim() == 3 &&
                  positions.size(0) == b && positions.size(1) == h && positions.size(2) == n,
              "slot_attention: contiguous int64 positions [b, h, n] expected");
  const int64_t parts = std::max<int64_t>(1, (n + kSlotPart - 1) / kSlotPart);
  const int64_t items = b * h * parts;
  std::vector<float> maxima(items * g), sums(items * g), mixed(items * g * d, 0.f);
  const float* q = query.data_ptr<float>();
  const int64_t* p = positions.data_ptr<int64_t>();
  if (held == torch::kHalf)
    attend_parts(q, keys.data_ptr<c10::Half>(), values.data_ptr<c10::Half>(), p, scaling, g, d, n, parts, items,
                 maxima.data(), sums.data(), mixed.data());
  else
    attend_parts(q, keys.data_ptr<float>(), values.data_ptr<float>(), p, scaling, g, d, n, parts, items,
                 maxima.data(), sums.data(), mixed.data());
  auto out = torch::zeros_like(query);
  float* o = out.data_ptr<float>();
  for (int64_t bh = 0; bh < b * h; ++bh)
    for (int64_t j = 0; j < g; ++j) {
      float top = -INFINITY, total = 0.f;
      for (int64_t part = 0; part < parts; ++part) top = std::max(top, maxima[(bh * parts + part) * g + j]);
      if (top == -INFINITY) continue;  // no live slot: zeros
      for (int64_t part = 0; part < parts; ++part) {
        const int64_t at = (bh * parts + part) * g + j;
        if (maxima[at] == -INFINITY) continue;
        const float weight = std::exp(maxima[at] - top);
        total += weight * sums[at];
        add_scaled(o + (bh * g + j) * d, &mixed[at * d], weight, d);
      }
      for (int64_t c = 0; c < d; ++c) o[(bh * g + j) * d + c] /= total;
    }
  return out;
}

// Shapes alone, for tracing: a compiled step keeps each op as one opaque call. Symbolic sizes, so a
// graph traced for any row count or slot count stays one graph.
torch::Tensor kv_scores_meta(torch::Tensor query, torch::Tensor keys, torch::Tensor ring, torch::Tensor positions,
                             torch::Tensor seen, torch::Tensor shift, int64_t bits, int64_t group, int64_t sinks) {
  return at::empty_symint({query.sym_size(0), query.sym_size(1), query.sym_size(2), keys.sym_size(2)}, query.options());
}

torch::Tensor rolled_scores_meta(torch::Tensor query, torch::Tensor keys, torch::Tensor delta, torch::Tensor table,
                                 int64_t reach) {
  return at::empty_symint({query.sym_size(0), query.sym_size(1), query.sym_size(2), keys.sym_size(2)}, query.options());
}

torch::Tensor slot_attention_meta(torch::Tensor query, torch::Tensor keys, torch::Tensor values,
                                  torch::Tensor positions, double scaling) {
  return at::empty_symint(query.sym_sizes(), query.options());
}

torch::Tensor kv_mix_meta(torch::Tensor probs, torch::Tensor values, torch::Tensor ring, torch::Tensor positions,
                          torch::Tensor seen, int64_t bits, int64_t group, int64_t sinks) {
  return at::empty_symint({probs.sym_size(0), probs.sym_size(1), probs.sym_size(2), ring.sym_size(3)}, probs.options());
}

// Registered with the dispatcher from C++, so a call costs no Python.
TORCH_LIBRARY_FRAGMENT(sparsegen, m) {
  m.def(
      "kv_scores(Tensor query, Tensor keys, Tensor ring, Tensor positions, Tensor seen, Tensor shift, int bits, int group, "
      "int sinks) -> Tensor");
  m.def("kv_mix(Tensor probs, Tensor values, Tensor ring, Tensor positions, Tensor seen, int bits, int group, int sinks) -> Tensor");
  m.def("rolled_scores(Tensor query, Tensor keys, Tensor delta, Tensor table, int reach) -> Tensor");
  m.def("slot_attention(Tensor query, Tensor keys, Tensor values, Tensor positions, float scaling) -> Tensor");
}
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("kv_scores", &kv_scores);
  m.impl("kv_mix", &kv_mix);
  m.impl("rolled_scores", &rolled_scores);
  m.impl("slot_attention", &slot_attention);
}
TORCH_LIBRARY_IMPL(sparsegen, Meta, m) {
  m.impl("kv_scores", &kv_scores_meta);
  m.impl("kv_mix", &kv_mix_meta);
  m.impl("rolled_scores", &rolled_scores_meta);
  m.impl("slot_attention", &slot_attention_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

// A gated MLP over only the kept neurons, fused: down(act(gate . x) * (up . x)) summed over the kept
// neurons, reading each kept neuron's weights as one stream (Deja Vu's neuron-major storage).
//
// The weights are repacked once (sparsegen/contextual/fused.py) into one record per neuron, holding
// its gate row, up row and down column side by side, each over the hidden size padded to `hp`, a
// multiple of 32:
//
//   kFloat32 [neurons, 3, hp] fp32          gate, up, down
//   kBfloat16 [neurons, 3, hp] bf16         the same, widened to fp32 as read
//   kInt8 [neurons, 3 hp / 8 + 3 hp] uint8  fp32 scales of gate, up, down per block of 32, then their
//                                           int8 codes (w = q * scale, int_dot.cpp's int8 format)
//   kInt4 [neurons, 3 hp / 4 + 3 hp / 2]    fp32 scale and min of gate, up, down per block, then their
//                                           nibbles (w = u * scale - min, int_dot.cpp's int4 layout)
//
// The integer formats round each input row to int8 per block of 32 (one fp32 step a block) and sum
// gate . x and up . x as integer dots (int_dot.cpp's vpmaddubsw, or vpdpbusd with AVX-512 VNNI); the
// down column is widened and multiplied by the neuron's activation in fp32. Every output accumulates
// in fp32. The rows of a call (a batch of 1-4 decode rows, any count works) share the kept list, and
// each neuron's weights are read once for all of them. Threads take equal slices of the list, each
// summing into its own [rows, hp] partial; the partials are added at the end (so results depend on
// the thread count only by fp32 rounding). The selection is a boolean mask over all the neurons,
// which the kernel scans into its list (8,960 bytes for the 1.5B model's MLP: nothing beside the
// weights): every shape of a call is then fixed by the model, whatever the selector kept, so a
// compiled decode step traces this op once. `gate_act` [rows, neurons], when given, is
// act(gate . x) already computed for every neuron (a selector that reads the whole gate): the
// gate rows are then not read.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "sparse_mlp_simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Format : int64_t { kFloat32 = 0, kBfloat16 = 1, kInt8 = 2, kInt4 = 3 };
enum Act : int64_t { kSilu = 0, kGeluTanh = 1, kGelu = 2, kRelu = 3 };
constexpr int kTile = 4;  // rows whose sums stay in registers at once

inline float activate(float g, int64_t act) {
  switch (act) {
    case kSilu: return g / (1.f + std::exp(-g));
    case kGeluTanh: return 0.5f * g * (1.f + std::tanh(0.7978845608f * (g + 0.044715f * g * g * g)));
    case kGelu: return 0.5f * g * (1.f + std::erf(g * 0.70710678f));
    default: return g > 0.f ? g : 0.f;
  }
}

struct Rounded {  // the input rows in int8 per block of 32: codes, the step, step * sum of codes
  std::vector<int8_t> codes;
  std::vector<float> step, step_sum;
};

Rounded round_rows(const float* x, int64_t count) {
  const int64_t blocks = count / kBlock;
  Rounded r{std::vector<int8_t>(count), std::vector<float>(blocks), std::vector<float>(blocks)};
  for (int64_t b = 0; b < blocks; ++b) {
    const float* from = x + b * kBlock;
    float largest = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) largest = std::max(largest, std::fabs(from[j]));
    const float inverse = largest > 0.f ? 127.f / largest : 0.f;
    int32_t sum = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      r.codes[b * kBlock + j] = static_cast<int8_t>(std::nearbyint(from[j] * inverse));
      sum += r.codes[b * kBlock + j];
    }
    r.step[b] = largest / 127.f;
    r.step_sum[b] = r.step[b] * static_cast<float>(sum);
  }
  return r;
}

// What every neuron of one call shares: the padded rows (and their int8 rounding), the list, the
// known gate activations, and this thread's partial output [rows, hp].
struct Call {
  const float* x;
  const Rounded* rounded;
  int64_t rows, hp, neurons;
  const float* gate_act;
  int64_t act;
  float* out;
};

// Neuron n's activations h[r] from its gate and up sums (or the known gate).
template <int R>
inline void activations(const Call& c, int64_t r0, int64_t n, const float* g, const float* u, float* h) {
  for (int r = 0; r < R; ++r)
    h[r] = (c.gate_act ? c.gate_act[(r0 + r) * c.neurons + n] : activate(g[r], c.act)) * u[r];
}

// out[r] += h[r] * column for the tile's rows, the column in float (fp32 or bf16).
template <typename W, int R>
inline void add_column(const Call& c, int64_t r0, const W* down, const W* next, const float* h) {
  Vec hv[R];
  for (int r = 0; r < R; ++r) hv[r] = broadcast(h[r]);
  for (int64_t i = 0; i < c.hp; i += kLanes) {
    if (next && i % 16 == 0) prefetch(next + i);
    const Vec w = load(down + i);
    for (int r = 0; r < R; ++r) {
      float* o = c.out + (r0 + r) * c.hp + i;
      store(o, fma(w, hv[r], load(o)));
    }
  }
}

// One neuron of a float record (gate, up, down rows of hp), for rows [r0, r0 + R).
template <typename W, int R>
void float_neuron(const Call& c, int64_t r0, int64_t n, const W* rec, const W* next) {
  const W *gate = rec, *up = rec + c.hp, *down = rec + 2 * c.hp;
  const bool with_gate = c.gate_act == nullptr;
  Vec g[R], u[R];
  for (int r = 0; r < R; ++r) g[r] = u[r] = zero();
  for (int64_t k = 0; k < c.hp; k += kLanes) {
    if (next && k % 16 == 0) {
      if (with_gate) prefetch(next + k);
      prefetch(next + c.hp + k);
    }
    const Vec wu = load(up + k), wg = with_gate ? load(gate + k) : zero();
    for (int r = 0; r < R; ++r) {
      const Vec xv = load(c.x + (r0 + r) * c.hp + k);
      u[r] = fma(wu, xv, u[r]);
      if (with_gate) g[r] = fma(wg, xv, g[r]);
    }
  }
  float gs[R], us[R], h[R];
  for (int r = 0; r < R; ++r) gs[r] = sum_of(g[r]), us[r] = sum_of(u[r]);
  activations<R>(c, r0, n, gs, us, h);
  add_column<W, R>(c, r0, down, next ? next + 2 * c.hp : nullptr, h);
}

// ---- the integer records ---------------------------------------------------------------------

// The layout of one integer record: per projection (gate, up, down) `meta` floats a block (int8:
// scale; int4: scales then mins), then each projection's codes.
struct IntRecord {
  const float *gate_meta, *up_meta, *down_meta;
  const uint8_t *gate, *up, *down;
};

template <bool kInt4>
inline IntRecord int_record(const uint8_t* rec, int64_t hp) {
  const int64_t blocks = hp / kBlock, meta = (kInt4 ? 2 : 1) * blocks, bytes = kInt4 ? hp / 2 : hp;
  const float* f = reinterpret_cast<const float*>(rec);
  const uint8_t* codes = rec + 3 * meta * sizeof(float);
  return {f, f + meta, f + 2 * meta, codes, codes + bytes, codes + 2 * bytes};
}

// out[r] += h[r] * the dequantized down column.
template <bool kInt4, int R>
inline void add_int_column(const Call& c, int64_t r0, const IntRecord& w, const uint8_t* next, const float* h) {
  const int64_t blocks = c.hp / kBlock, block_bytes = kInt4 ? kBlock / 2 : kBlock;
  for (int64_t b = 0; b < blocks; ++b) {
    if (next) prefetch(next + b * block_bytes);
    const float scale = w.down_meta[b], low = kInt4 ? -w.down_meta[blocks + b] : 0.f;
    Vec factor[R];
    for (int r = 0; r < R; ++r) factor[r] = broadcast(kInt4 ? h[r] : h[r] * scale);
    for (int64_t s = 0; s < kBlock; s += kLanes) {
      const uint8_t* p = w.down + b * block_bytes + (kInt4 ? s % 16 : s);
      Vec v = widen<kInt4>(p, kInt4 && s >= 16 ? 4 : 0);
      if (kInt4) v = fma(v, broadcast(scale), broadcast(low));  // u * scale - min
      for (int r = 0; r < R; ++r) {
        float* o = c.out + (r0 + r) * c.hp + b * kBlock + s;
        store(o, fma(v, factor[r], load(o)));
      }
    }
  }
}

// One neuron of an integer record, for rows [r0, r0 + R).
template <bool kInt4, int R>
void int_neuron(const Call& c, int64_t r0, int64_t n, const uint8_t* rec, const uint8_t* next) {
  const IntRecord w = int_record<kInt4>(rec, c.hp);
  const IntRecord ahead = int_record<kInt4>(next ? next : rec, c.hp);
  const int64_t blocks = c.hp / kBlock, block_bytes = kInt4 ? kBlock / 2 : kBlock;
  const bool with_gate = c.gate_act == nullptr;
  IVec g[R], u[R];
  for (int r = 0; r < R; ++r) g[r] = u[r] = izero();
  for (int64_t b = 0; b < blocks; ++b) {
    if (next && b % 2 == 0) {  // the next record's codes, a line ahead of where this one is read
      prefetch(ahead.up + b * block_bytes);
      if (with_gate) prefetch(ahead.gate + b * block_bytes);
    }
    if (next && b * 16 < 3 * blocks * (kInt4 ? 2 : 1)) prefetch(ahead.gate_meta + b * 16);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = (r0 + r) * blocks + b;
      const int8_t* a = c.rounded->codes.data() + rb * kBlock;
      const float step = c.rounded->step[rb];
      u[r] = block_dot<kInt4>(w.up + b * block_bytes, a, w.up_meta[b] * step, u[r]);
      if (with_gate) g[r] = block_dot<kInt4>(w.gate + b * block_bytes, a, w.gate_meta[b] * step, g[r]);
    }
  }
  float gs[R], us[R], h[R];
  for (int r = 0; r < R; ++r) {
    gs[r] = isum(g[r]), us[r] = isum(u[r]);
    if (!kInt4) continue;
    const float* step_sum = c.rounded->step_sum.data() + (r0 + r) * blocks;
    float up_min = 0.f, gate_min = 0.f;  // the minimums' share: min * step * sum of codes, per block
#pragma omp simd reduction(+ : up_min, gate_min)
    for (int64_t b = 0; b < blocks; ++b) {
      up_min += w.up_meta[blocks + b] * step_sum[b];
      gate_min += w.gate_meta[blocks + b] * step_sum[b];
    }
    us[r] -= up_min, gs[r] -= gate_min;
  }
  activations<R>(c, r0, n, gs, us, h);
  add_int_column<kInt4, R>(c, r0, w, next ? ahead.down : nullptr, h);
}

// ---- the call --------------------------------------------------------------------------------

template <int R>
void neuron(const Call& c, int64_t format, int64_t r0, int64_t n, const uint8_t* rec, const uint8_t* next) {
  using Bf16 = uint16_t;
  switch (format) {
    case kFloat32: return float_neuron<float, R>(c, r0, n, (const float*)rec, (const float*)next);
    case kBfloat16: return float_neuron<Bf16, R>(c, r0, n, (const Bf16*)rec, (const Bf16*)next);
    case kInt8: return int_neuron<false, R>(c, r0, n, rec, next);
    default: return int_neuron<true, R>(c, r0, n, rec, next);
  }
}

// The neurons kept[first, last) into c.out, every row, `record` bytes a neuron.
void neuron_range(const Call& c, int64_t format, const uint8_t* base, int64_t record, const int64_t* kept,
                  int64_t first, int64_t last) {
  for (int64_t i = first; i < last; ++i) {
    const uint8_t* rec = base + kept[i] * record;
    const uint8_t* next = i + 1 < last ? base + kept[i + 1] * record : nullptr;
    for (int64_t r0 = 0; r0 < c.rows; r0 += kTile) {
      switch (std::min<int64_t>(kTile, c.rows - r0)) {
        case 1: neuron<1>(c, format, r0, kept[i], rec, next); break;
        case 2: neuron<2>(c, format, r0, kept[i], rec, next); break;
        case 3: neuron<3>(c, format, r0, kept[i], rec, next); break;
        default: neuron<4>(c, format, r0, kept[i], rec, next); break;
      }
    }
  }
}

int64_t record_bytes(int64_t format, int64_t hp) {
  switch (format) {
    case kFloat32: return 3 * hp * 4;
    case kBfloat16: return 3 * hp * 2;
    case kInt8: return 3 * hp / kBlock * 4 + 3 * hp;
    default: return 3 * hp / kBlock * 8 + 3 * hp / 2;
  }
}

// The neurons set in `keep` (bool [neurons]), in order.
std::vector<int64_t> kept_list(const torch::Tensor& keep, int64_t neurons) {
  TORCH_CHECK(keep.scalar_type() == torch::kBool && keep.dim() == 1 && keep.size(0) == neurons && keep.is_contiguous(),
              "sparse_mlp: keep must be a contiguous bool mask over the ", neurons, " neurons");
  const bool* p = keep.data_ptr<bool>();
  std::vector<int64_t> kept;
  kept.reserve(neurons);
  for (int64_t n = 0; n < neurons; ++n)
    if (p[n]) kept.push_back(n);
  return kept;
}

void check_packed(const torch::Tensor& packed, int64_t format, int64_t hp) {
  TORCH_CHECK(format >= kFloat32 && format <= kInt4, "sparse_mlp: no format ", format);
  const auto dtype = format == kFloat32 ? torch::kFloat : format == kBfloat16 ? torch::kBFloat16 : torch::kByte;
  TORCH_CHECK(packed.scalar_type() == dtype && packed.is_contiguous() && packed.dim() >= 2,
              "sparse_mlp: packed is not this format's neuron records (see contextual/fused.py)");
  TORCH_CHECK(hp % kBlock == 0 && packed.numel() * packed.element_size() == packed.size(0) * record_bytes(format, hp),
              "sparse_mlp: packed records do not match the padded hidden size ", hp);
}

}  // namespace

// x [rows, hidden] fp32 -> [rows, hidden] fp32: the MLP over the neurons of `packed` set in `keep`.
torch::Tensor sparse_mlp(torch::Tensor x, torch::Tensor packed, torch::Tensor keep, c10::optional<torch::Tensor> gate_act,
                         int64_t format, int64_t act, int64_t hp) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.size(1) <= hp, "sparse_mlp: x must be fp32 [rows, hidden]");
  check_packed(packed, format, hp);
  const int64_t rows = x.size(0), hidden = x.size(1), neurons = packed.size(0);
  const std::vector<int64_t> kept = kept_list(keep, neurons);
  const int64_t count = static_cast<int64_t>(kept.size());
  auto padded = hidden == hp ? x.contiguous() : torch::constant_pad_nd(x, {0, hp - hidden}).contiguous();
  const float* gate = nullptr;
  torch::Tensor gate_rows;
  if (gate_act.has_value()) {
    gate_rows = gate_act->to(torch::kFloat).contiguous();
    TORCH_CHECK(gate_rows.dim() == 2 && gate_rows.size(0) == rows && gate_rows.size(1) == neurons,
                "sparse_mlp: gate_act must be [rows, neurons]");
    gate = gate_rows.data_ptr<float>();
  }
  const Rounded rounded = format >= kInt8 ? round_rows(padded.data_ptr<float>(), rows * hp) : Rounded{};
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), count / 16));
  auto partial = torch::zeros({threads, rows, hp}, x.options());
  const auto* base = static_cast<const uint8_t*>(packed.data_ptr());
  const int64_t record = record_bytes(format, hp);
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const Call c{padded.data_ptr<float>(), &rounded, rows, hp, neurons, gate, act, partial.data_ptr<float>() + t * rows * hp};
      neuron_range(c, format, base, record, kept.data(), t * count / threads, (t + 1) * count / threads);
    }
  });
  auto out = threads == 1 ? partial[0] : partial.sum(0);
  return hidden == hp ? out : out.narrow(1, 0, hidden).contiguous();
}

// The shape alone, for tracing: a compiled step keeps the op as one opaque call.
torch::Tensor sparse_mlp_meta(torch::Tensor x, torch::Tensor packed, torch::Tensor keep,
                              c10::optional<torch::Tensor> gate_act, int64_t format, int64_t act, int64_t hp) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

// Registered with the dispatcher from C++, so a call costs no Python.
TORCH_LIBRARY_FRAGMENT(sparsegen, m) {
  m.def("sparse_mlp(Tensor x, Tensor packed, Tensor keep, Tensor? gate_act, int format, int act, int hp) -> Tensor");
}
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) { m.impl("sparse_mlp", &sparse_mlp); }
TORCH_LIBRARY_IMPL(sparsegen, Meta, m) { m.impl("sparse_mlp", &sparse_mlp_meta); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

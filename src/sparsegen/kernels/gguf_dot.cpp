// A linear layer over a GGUF tensor's own blocks, its products integer dots as llama.cpp's CPU does:
// the block formats, the rounding of the input and each block's product are gguf_blocks.h's.
//
// Rows of the input go through in tiles of up to four against one output row at a time (its
// blocks read once from L1 for the tile), inputs in groups sized for L2, outputs split over threads.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include "gguf_blocks.h"
#include "gguf_decode.h"
#include "gguf_panels.h"

#include <algorithm>

namespace {

constexpr int kTile = 4;           // input rows against one output row at a time
constexpr int64_t kGroupBytes = 1 << 18;  // input codes held in L2 while every output passes over them

#ifdef SPARSEGEN_AVX2
// One output row times input rows [row0, row0 + kRows). The 32-blocks alternate between two sets
// of accumulators, so that one block's sums need not wait on the last's (one row is otherwise
// bound by the latency of its one chain of multiply-adds).
template <int64_t F, int kRows>
void output_row(const uint8_t* w, int64_t blocks, int64_t block_bytes, const Rounded& r, int64_t row0, float* result) {
  constexpr bool kK = F == kQ4_K || F == kQ5_K || F == kQ6_K;
  __m256 acc[kRows], other[kRows], offset_vec[kRows];
  float offset[kRows], other_offset[kRows];
  int64_t at[kRows];
  for (int k = 0; k < kRows; ++k) {
    acc[k] = other[k] = offset_vec[k] = _mm256_setzero_ps(), offset[k] = other_offset[k] = 0.f;
    at[k] = (row0 + k) * blocks;
  }
  int64_t b = 0;
  if (!kK) {
    for (; b + 1 < blocks; b += 2) {
      block32<F, kRows>(w + b * block_bytes, r, at, acc, offset);
      for (int k = 0; k < kRows; ++k) ++at[k];
      block32<F, kRows>(w + (b + 1) * block_bytes, r, at, other, other_offset);
      for (int k = 0; k < kRows; ++k) ++at[k];
    }
  }
  for (; b < blocks; ++b) {
    if (kK)
      block256<F, kRows>(w + b * block_bytes, r, at, acc, offset_vec);
    else
      block32<F, kRows>(w + b * block_bytes, r, at, acc, offset);
    for (int k = 0; k < kRows; ++k) ++at[k];
  }
  for (int k = 0; k < kRows; ++k) {
    const __m256 sums = _mm256_sub_ps(_mm256_add_ps(acc[k], other[k]), offset_vec[k]);
    result[k] = sum_of(sums) + (offset[k] + other_offset[k]);
  }
}

template <int64_t F>
void output_tile(const uint8_t* w, int64_t blocks, int64_t block_bytes, const Rounded& r, int64_t row0, int count,
                 float* result) {
  switch (count) {
    case 1: output_row<F, 1>(w, blocks, block_bytes, r, row0, result); break;
    case 2: output_row<F, 2>(w, blocks, block_bytes, r, row0, result); break;
    case 3: output_row<F, 3>(w, blocks, block_bytes, r, row0, result); break;
    default: output_row<F, 4>(w, blocks, block_bytes, r, row0, result); break;
  }
}
#endif

// Input rows [row0, row0 + count) times one output row, count <= kTile.
void tile(int64_t format, const uint8_t* w, int64_t blocks, const Rounded& r, int64_t row0, int count, float* result) {
  const int64_t block_bytes = info_of(format).block_bytes;
#ifdef SPARSEGEN_AVX2
  switch (format) {
    case kQ4_0: return output_tile<kQ4_0>(w, blocks, block_bytes, r, row0, count, result);
    case kQ4_1: return output_tile<kQ4_1>(w, blocks, block_bytes, r, row0, count, result);
    case kQ5_0: return output_tile<kQ5_0>(w, blocks, block_bytes, r, row0, count, result);
    case kQ5_1: return output_tile<kQ5_1>(w, blocks, block_bytes, r, row0, count, result);
    case kQ8_0: return output_tile<kQ8_0>(w, blocks, block_bytes, r, row0, count, result);
    case kQ4_K: return output_tile<kQ4_K>(w, blocks, block_bytes, r, row0, count, result);
    case kQ5_K: return output_tile<kQ5_K>(w, blocks, block_bytes, r, row0, count, result);
    default: return output_tile<kQ6_K>(w, blocks, block_bytes, r, row0, count, result);
  }
#else
  for (int k = 0; k < count; ++k) {
    result[k] = 0.f;
    for (int64_t b = 0; b < blocks; ++b) result[k] += plain_block_product(format, w + b * block_bytes, r, row0 + k, b);
  }
#endif
}

}  // namespace

// The checks both products make: x fp32 [rows, in], blocks uint8 [out, row bytes]; returns blocks a row.
int64_t checked_blocks(const torch::Tensor& x, const torch::Tensor& blocks, const FormatInfo& f, int64_t in) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) == in,
              "gguf_linear: x must be fp32 [rows, ", in, "], contiguous");
  TORCH_CHECK(in % f.per_block == 0, "gguf_linear: ", in, " inputs are not whole blocks of ", f.per_block);
  const int64_t per_row = in / f.per_block;
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == per_row * f.block_bytes,
              "gguf_linear: blocks must be uint8 [out, ", per_row * f.block_bytes, "], contiguous");
  return per_row;
}

// Input rows in groups whose codes stay in L2, each group against every output unit (an output
// row, or a panel of kPanel) split over threads, in tiles of up to kTile rows: body(unit, row0, count).
template <typename Body>
void over_tiles(int64_t rows, int64_t in, int64_t units, int64_t grain, const Body& body) {
  const int64_t group = std::max<int64_t>(kTile, kGroupBytes / in / kTile * kTile);
  for (int64_t first_row = 0; first_row < rows; first_row += group) {
    const int64_t last_row = std::min(rows, first_row + group);
    at::parallel_for(0, units, grain, [&](int64_t first, int64_t last) {
      for (int64_t unit = first; unit < last; ++unit)
        for (int64_t row0 = first_row; row0 < last_row; row0 += kTile)
          body(unit, row0, static_cast<int>(std::min<int64_t>(kTile, last_row - row0)));
    });
  }
}

// x [rows, in] fp32 times the GGUF tensor `blocks` [out, row_bytes] of ggml type `format` -> [rows, out] fp32.
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor blocks, int64_t format, int64_t in) {
  const FormatInfo f = info_of(format);
  const int64_t per_row = checked_blocks(x, blocks, f, in), rows = x.size(0), out_features = blocks.size(0);
  const Rounded r = round_rows(x.data_ptr<float>(), rows, in, f.k_quant);
  auto out = torch::empty({rows, out_features}, x.options());
  float* o = out.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  over_tiles(rows, in, out_features, 8, [&](int64_t n, int64_t row0, int count) {
    float result[kTile];
    tile(format, w + n * per_row * f.block_bytes, per_row, r, row0, count, result);
    for (int k = 0; k < count; ++k) o[(row0 + k) * out_features + n] = result[k];
  });
  return out;
}

// The same product over `panels`, the tensor as `gguf_panels` repacked it (Q4_0, Q4_1, Q4_K, Q6_K; gguf_panels.h).
torch::Tensor gguf_panel_linear(torch::Tensor x, torch::Tensor panels, int64_t format, int64_t in) {
  TORCH_CHECK(panel_format(format), "gguf_panel_linear: panels are Q4_0, Q4_1, Q4_K or Q6_K, not ggml type ", format);
  const FormatInfo f = info_of(format);
  const int64_t per_row = checked_blocks(x, panels, f, in), rows = x.size(0), out_features = panels.size(0);
  TORCH_CHECK(out_features % kPanel == 0, "gguf_panel_linear: ", out_features, " outputs are not whole panels");
  const Rounded r = round_rows(x.data_ptr<float>(), rows, in, f.k_quant);
  auto out = torch::empty({rows, out_features}, x.options());
  float* o = out.data_ptr<float>();
  const uint8_t* w = panels.data_ptr<uint8_t>();
  const int64_t panel_bytes = per_row * kPanel * f.block_bytes;
  over_tiles(rows, in, out_features / kPanel, 2, [&](int64_t p, int64_t row0, int count) {
    float result[kTile * kPanel];
    panel_tile_any(format, w + p * panel_bytes, per_row, r, row0, count, result);
    for (int k = 0; k < count; ++k)
      std::copy_n(result + kPanel * k, kPanel, o + (row0 + k) * out_features + p * kPanel);
  });
  return out;
}

// A Q4_0 / Q4_1 / Q4_K / Q6_K tensor's file rows as panels, or (`inverse`) panels back to the file's rows.
torch::Tensor gguf_panels(torch::Tensor blocks, int64_t format, int64_t in, bool inverse) {
  TORCH_CHECK(panel_format(format), "gguf_panels: panels are Q4_0, Q4_1, Q4_K or Q6_K, not ggml type ", format);
  const FormatInfo f = info_of(format);
  const int64_t per_row = in / f.per_block;
  TORCH_CHECK(in % f.per_block == 0 && blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 &&
                  blocks.is_contiguous() && blocks.size(1) == per_row * f.block_bytes && blocks.size(0) % kPanel == 0,
              "gguf_panels: blocks must be uint8 [a multiple of ", kPanel, ", ", per_row * f.block_bytes, "]");
  auto out = torch::empty_like(blocks);
  permute_panels(blocks.data_ptr<uint8_t>(), out.data_ptr<uint8_t>(), format, blocks.size(0), per_row, inverse);
  return out;
}

// The shape alone, for tracing: a compiled step keeps the op as one opaque call.
torch::Tensor gguf_linear_meta(torch::Tensor x, torch::Tensor blocks, int64_t format, int64_t in) {
  return at::empty_symint({x.sym_size(0), blocks.sym_size(0)}, x.options());
}

// The input rows as the kernel rounds them, decoded back to floats (for tests and comparisons).
torch::Tensor gguf_rounded_input(torch::Tensor x, int64_t format) {
  const FormatInfo f = info_of(format);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2 && x.is_contiguous() && x.size(1) % f.per_block == 0,
              "gguf_rounded_input: fp32 [rows, whole blocks]");
  const Rounded r = round_rows(x.data_ptr<float>(), x.size(0), x.size(1), f.k_quant);
  auto out = torch::empty_like(x);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) o[i] = r.codes[i] * r.step[i / f.per_block];
  return out;
}

// The weight the blocks hold [out, in], decoded as the products read it (plain_decode) into fp32 or
// bf16: a prompt's many rows multiply it in one float GEMM where the CPU computes bf16 natively.
template <typename T>
void decode_rows(const uint8_t* w, int64_t format, int64_t in, int64_t out_features, T* o) {
  const FormatInfo f = info_of(format);
  const int64_t per_row = in / f.per_block;
  at::parallel_for(0, out_features, 16, [&](int64_t first, int64_t last) {
    for (int64_t n = first; n < last; ++n)
      for (int64_t b = 0; b < per_row; ++b)
        decode_block(format, w + (n * per_row + b) * f.block_bytes, o + n * in + b * f.per_block);
  });
}

// The weight [out, in] in fp32 or bf16 from the file's blocks or (`paneled`) from gguf_panels' panels.
torch::Tensor decoded_weight(torch::Tensor blocks, int64_t format, int64_t in, at::ScalarType dtype, bool paneled) {
  const FormatInfo f = info_of(format);
  TORCH_CHECK(in % f.per_block == 0, "gguf_weight: ", in, " inputs are not whole blocks of ", f.per_block);
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.dim() == 2 && blocks.is_contiguous() &&
                  blocks.size(1) == in / f.per_block * f.block_bytes,
              "gguf_weight: blocks must be uint8 [out, ", in / f.per_block * f.block_bytes, "], contiguous");
  TORCH_CHECK(dtype == torch::kFloat || dtype == torch::kBFloat16, "gguf_weight: fp32 or bf16");
  TORCH_CHECK(!paneled || (panel_format(format) && blocks.size(0) % kPanel == 0),
              "gguf_panel_weight: Q4_0, Q4_1, Q4_K or Q6_K panels");
  auto out = torch::empty({blocks.size(0), in}, blocks.options().dtype(dtype));
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  if (dtype == torch::kFloat)
    paneled ? decode_panels(w, format, in, blocks.size(0), out.data_ptr<float>())
            : decode_rows(w, format, in, blocks.size(0), out.data_ptr<float>());
  else
    paneled ? decode_panels(w, format, in, blocks.size(0), out.data_ptr<at::BFloat16>())
            : decode_rows(w, format, in, blocks.size(0), out.data_ptr<at::BFloat16>());
  return out;
}

torch::Tensor gguf_weight(torch::Tensor blocks, int64_t format, int64_t in, at::ScalarType dtype) {
  return decoded_weight(blocks, format, in, dtype, false);
}

torch::Tensor gguf_panel_weight(torch::Tensor panels, int64_t format, int64_t in, at::ScalarType dtype) {
  return decoded_weight(panels, format, in, dtype, true);
}

torch::Tensor gguf_weight_meta(torch::Tensor blocks, int64_t format, int64_t in, at::ScalarType dtype) {
  return at::empty_symint({blocks.sym_size(0), c10::SymInt(in)}, blocks.options().dtype(dtype));
}

TORCH_LIBRARY_FRAGMENT(sparsegen, m) {
  m.def("gguf_linear(Tensor x, Tensor blocks, int format, int in_features) -> Tensor");
  m.def("gguf_panel_linear(Tensor x, Tensor panels, int format, int in_features) -> Tensor");
  m.def("gguf_panels(Tensor blocks, int format, int in_features, bool inverse) -> Tensor");
  m.def("gguf_rounded_input(Tensor x, int format) -> Tensor");
  m.def("gguf_weight(Tensor blocks, int format, int in_features, ScalarType dtype) -> Tensor");
  m.def("gguf_panel_weight(Tensor panels, int format, int in_features, ScalarType dtype) -> Tensor");
}
TORCH_LIBRARY_IMPL(sparsegen, CPU, m) {
  m.impl("gguf_linear", &gguf_linear);
  m.impl("gguf_panel_linear", &gguf_panel_linear);
  m.impl("gguf_panels", &gguf_panels);
  m.impl("gguf_rounded_input", &gguf_rounded_input);
  m.impl("gguf_weight", &gguf_weight);
  m.impl("gguf_panel_weight", &gguf_panel_weight);
}
TORCH_LIBRARY_IMPL(sparsegen, Meta, m) {
  m.impl("gguf_linear", &gguf_linear_meta);
  m.impl("gguf_panel_linear", &gguf_linear_meta);
  m.impl("gguf_weight", &gguf_weight_meta);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}

// Attention products over keys and values held as byte rows (sparsegen/kv/quantized.py): each row
// is D codes (one byte each at 8 bits, two a byte at 4, low nibble first) followed by, per group
// of `group` channels, an fp16 scale and an fp16 minimum. A row is decoded into a small buffer
// that stays in L1 and used at once, so a step reads the bytes and never a float copy of the cache.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <vector>

namespace {

constexpr int kMaxDim = 512;

inline void decode_row(const uint8_t* row, int64_t dim, int64_t bits, int64_t group, float* out) {
  const int64_t code_bytes = dim * bits / 8;
  const c10::Half* params = reinterpret_cast<const c10::Half*>(row + code_bytes);
  if (bits == 8) {
    for (int64_t c = 0; c < dim; ++c) out[c] = static_cast<float>(row[c]);
  } else {
    for (int64_t j = 0; j < code_bytes; ++j) {
      out[2 * j] = static_cast<float>(row[j] & 15);
      out[2 * j + 1] = static_cast<float>(row[j] >> 4);
    }
  }
  for (int64_t g = 0; g < dim / group; ++g) {
    const float scale = static_cast<float>(params[2 * g]);
    const float low = static_cast<float>(params[2 * g + 1]);
    float* part = out + g * group;
    for (int64_t c = 0; c < group; ++c) part[c] = part[c] * scale + low;
  }
}

void check(const torch::Tensor& rows, const torch::Tensor& floats, int64_t dim, const char* what) {
  TORCH_CHECK(rows.scalar_type() == torch::kUInt8 && rows.dim() == 4 && rows.stride(3) == 1, what,
              ": byte rows [b, h, n, width] with contiguous rows expected");
  TORCH_CHECK(floats.scalar_type() == torch::kFloat && floats.is_contiguous(), what, ": contiguous fp32 expected");
  TORCH_CHECK(dim <= kMaxDim, what, ": head dim over ", kMaxDim);
}

}  // namespace

// query [b, h, g, d] fp32, keys [b, h, n, width] bytes -> [b, h, g, n]: each query . each decoded key.
torch::Tensor kv_scores(torch::Tensor query, torch::Tensor keys, int64_t bits, int64_t group) {
  const int64_t b = query.size(0), h = query.size(1), g = query.size(2), d = query.size(3), n = keys.size(2);
  check(keys, query, d, "kv_scores");
  auto out = torch::empty({b, h, g, n}, query.options());
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const uint8_t* base = keys.data_ptr<uint8_t>();
  const int64_t s0 = keys.stride(0), s1 = keys.stride(1), s2 = keys.stride(2);
  const int64_t blocks = (n + 255) / 256;
  at::parallel_for(0, b * h * blocks, 1, [&](int64_t begin, int64_t end) {
    float row[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, block = task % blocks;
      const int64_t bi = bh / h, hi = bh % h;
      const float* qs = q + bh * g * d;
      for (int64_t t = block * 256; t < std::min(n, (block + 1) * 256); ++t) {
        decode_row(base + bi * s0 + hi * s1 + t * s2, d, bits, group, row);
        for (int64_t k = 0; k < g; ++k) {
          const float* qk = qs + k * d;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t c = 0; c < d; ++c) acc += qk[c] * row[c];
          o[(bh * g + k) * n + t] = acc;
        }
      }
    }
  });
  return out;
}

// probs [b, h, g, n] fp32, values [b, h, n, width] bytes -> [b, h, g, d]: probabilities times decoded values.
torch::Tensor kv_mix(torch::Tensor probs, torch::Tensor values, int64_t bits, int64_t group, int64_t dim) {
  const int64_t b = probs.size(0), h = probs.size(1), g = probs.size(2), n = probs.size(3);
  check(values, probs, dim, "kv_mix");
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(8, n / 512));
  auto partial = torch::zeros({b * h, blocks, g, dim}, probs.options());
  const float* p = probs.data_ptr<float>();
  float* acc = partial.data_ptr<float>();
  const uint8_t* base = values.data_ptr<uint8_t>();
  const int64_t s0 = values.stride(0), s1 = values.stride(1), s2 = values.stride(2);
  const int64_t per_block = (n + blocks - 1) / blocks;
  at::parallel_for(0, b * h * blocks, 1, [&](int64_t begin, int64_t end) {
    float row[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, block = task % blocks;
      const int64_t bi = bh / h, hi = bh % h;
      float* out = acc + task * g * dim;
      for (int64_t t = block * per_block; t < std::min(n, (block + 1) * per_block); ++t) {
        decode_row(base + bi * s0 + hi * s1 + t * s2, dim, bits, group, row);
        for (int64_t k = 0; k < g; ++k) {
          const float weight = p[(bh * g + k) * n + t];
          if (weight == 0.f) continue;
          float* ok = out + k * dim;
#pragma omp simd
          for (int64_t c = 0; c < dim; ++c) ok[c] += weight * row[c];
        }
      }
    }
  });
  return partial.sum(1).view({b, h, g, dim});
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kv_scores", &kv_scores, "query . decoded keys");
  m.def("kv_mix", &kv_mix, "probabilities x decoded values");
}

#include <torch/extension.h>
#include <immintrin.h>
#include <cmath>
#include <vector>
// A probe, not a kernel of the package (scripts/decode_attention_probe.py): one decode step's
// attention for one row, fp32, AVX-512, head dim 64, at most 4 queries per KV head. Work items are
// (KV head, part of the live slots), so 2 cores share 3 heads evenly; parts merge by log-sum-exp.
// q [hq, 64], k and v [hkv, slots, 64] contiguous; the first n slots are live.
torch::Tensor decode_attn(torch::Tensor q, torch::Tensor k, torch::Tensor v, int64_t n, double scale, int64_t parts) {
  int64_t hq = q.size(0), d = q.size(1), hkv = k.size(0), S = k.size(1), g = hq / hkv;
  TORCH_CHECK(d == 64 && g <= 4 && n >= parts, "the probe handles head dim 64, <= 4 queries per KV head");
  auto out = torch::empty_like(q);
  const float* Q = q.data_ptr<float>(); const float* K = k.data_ptr<float>(); const float* V = v.data_ptr<float>();
  float* O = out.data_ptr<float>();
  int64_t per = (n + parts - 1) / parts;
  std::vector<float> pmax(hkv * parts * g), psum(hkv * parts * g), pacc(hkv * parts * g * d);
  #pragma omp parallel for schedule(static)
  for (int64_t w = 0; w < hkv * parts; ++w) {
    int64_t h = w / parts, p = w % parts, t0 = p * per, t1 = std::min(n, t0 + per), m_ = t1 - t0;
    std::vector<float> s(g * std::max<int64_t>(m_, 1));
    const float* Kh = K + h * S * d; const float* Vh = V + h * S * d;
    for (int64_t t = 0; t < m_; ++t) {
      const float* kt = Kh + (t0 + t) * d;
      __m512 k0 = _mm512_loadu_ps(kt), k1 = _mm512_loadu_ps(kt + 16), k2 = _mm512_loadu_ps(kt + 32), k3 = _mm512_loadu_ps(kt + 48);
      for (int64_t j = 0; j < g; ++j) {
        const float* qj = Q + (h * g + j) * d;
        __m512 a = _mm512_mul_ps(_mm512_loadu_ps(qj), k0);
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 16), k1, a);
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 32), k2, a);
        a = _mm512_fmadd_ps(_mm512_loadu_ps(qj + 48), k3, a);
        s[j * m_ + t] = _mm512_reduce_add_ps(a) * scale;
      }
    }
    for (int64_t j = 0; j < g; ++j) {
      float m = -INFINITY; for (int64_t t = 0; t < m_; ++t) m = std::max(m, s[j*m_+t]);
      float z = 0; for (int64_t t = 0; t < m_; ++t) { s[j*m_+t] = std::exp(s[j*m_+t]-m); z += s[j*m_+t]; }
      pmax[w*g+j] = m; psum[w*g+j] = z;
    }
    __m512 acc[4][4];
    for (int64_t j = 0; j < g; ++j) for (int64_t c = 0; c < 4; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < m_; ++t) {
      const float* vt = Vh + (t0 + t) * d;
      __m512 v0 = _mm512_loadu_ps(vt), v1 = _mm512_loadu_ps(vt + 16), v2 = _mm512_loadu_ps(vt + 32), v3 = _mm512_loadu_ps(vt + 48);
      for (int64_t j = 0; j < g; ++j) {
        __m512 w_ = _mm512_set1_ps(s[j*m_+t]);
        acc[j][0] = _mm512_fmadd_ps(w_, v0, acc[j][0]); acc[j][1] = _mm512_fmadd_ps(w_, v1, acc[j][1]);
        acc[j][2] = _mm512_fmadd_ps(w_, v2, acc[j][2]); acc[j][3] = _mm512_fmadd_ps(w_, v3, acc[j][3]);
      }
    }
    for (int64_t j = 0; j < g; ++j) for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(&pacc[(w*g+j)*d + c*16], acc[j][c]);
  }
  for (int64_t h = 0; h < hkv; ++h) for (int64_t j = 0; j < g; ++j) {
    float m = -INFINITY; for (int64_t p = 0; p < parts; ++p) m = std::max(m, pmax[(h*parts+p)*g+j]);
    float z = 0; std::vector<float> o(d, 0.f);
    for (int64_t p = 0; p < parts; ++p) { int64_t w = h*parts+p; float f = std::exp(pmax[w*g+j]-m); z += f*psum[w*g+j];
      for (int64_t c = 0; c < d; ++c) o[c] += f*pacc[(w*g+j)*d+c]; }
    for (int64_t c = 0; c < d; ++c) O[(h*g+j)*d+c] = o[c]/z;
  }
  return out;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("decode_attn", &decode_attn); }

// A row-invariant fp32 linear for CPUs with AVX2 and FMA (eagle_serve.cpu_matmul loads it).
//
// out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]): every output element is computed by the same
// instruction sequence, whatever the number of rows, the tile it falls in or the thread that
// runs it: eight lanes of fused multiply-adds along k in order, then one fixed lane reduction.
// So a verify row gets exactly the bits its one-token decode step gets. Tiles of 3 rows x 4
// output features keep 12 accumulators in registers and read each weight vector once per 3 rows;
// threads split the output features (torch's intra-op pool, at::parallel_for).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {

inline float lane_sum(__m256 v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// RB rows of x [.., K] against NB weight rows w [.., K] -> out[r * N + n]
template <int RB, int NB>
inline void tile(const float* x, const float* w, int64_t K, float* out, int64_t N) {
  __m256 acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = _mm256_loadu_ps(w + n * K + k);
    for (int r = 0; r < RB; ++r) {
      __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int n = 0; n < NB; ++n) acc[r][n] = _mm256_fmadd_ps(xv, wv[n], acc[r][n]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) out[r * N + n] = lane_sum(acc[r][n]);
}

// all R rows against NB weight rows starting at output feature n
template <int NB>
void columns(const float* x, int64_t R, int64_t K, const float* w, int64_t n, float* out, int64_t N) {
  int64_t r = 0;
  for (; r + 3 <= R; r += 3) tile<3, NB>(x + r * K, w + n * K, K, out + r * N + n, N);
  for (; r + 2 <= R; r += 2) tile<2, NB>(x + r * K, w + n * K, K, out + r * N + n, N);
  for (; r < R; ++r) tile<1, NB>(x + r * K, w + n * K, K, out + r * N + n, N);
}

}  // namespace

// x [..., K] fp32, weight [N, K] fp32 contiguous, K a multiple of 8, bias [N] or None -> [..., N]
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "row_linear: fp32 tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(-1) &&
              x.size(-1) % 8 == 0, "row_linear: weight [N, K] contiguous, K = x's last dim, K % 8 == 0");
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t R = rows.size(0), K = rows.size(1), N = weight.size(0);
  auto out = torch::empty({R, N}, x.options());
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  constexpr int NB = 4;
  at::parallel_for(0, N / NB, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) columns<NB>(xp, R, K, wp, b * NB, op, N);
  });
  for (int64_t n = N / NB * NB; n < N; ++n) columns<1>(xp, R, K, wp, n, op, N);
  if (bias.has_value()) out.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear, "row-invariant fp32 linear (AVX2 + FMA)");
}

// Row-invariant CPU kernels for AVX2 + FMA (kernels/cpu.py compiles and loads them): a verify
// row gets exactly the bits its one-token decode step gets, because every output element is
// computed by the same instruction sequence whatever the other rows, the tile it falls in or the
// thread that runs it (threads split independent outputs: torch's pool, at::parallel_for).
//
// linear: out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]), fp32: eight lanes of fused
//   multiply-adds along k in order, then one fixed lane reduction. Tiles of 3 rows x 4 output
//   features keep 12 accumulators in registers and read each weight vector once per 3 rows.
// attend: each (query, q head) attends over its own list of key slots in order: scores by the
//   same dot product, a softmax in one pass order, the weighted sum of values along the list.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

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

// 8 floats from fp32 or bf16 memory
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  return lane_sum(acc);
}

template <typename T>
void attend_all(const float* q, const T* keys, const T* values, const int64_t* slots,
                const int64_t* starts, float* out, int64_t num_queries, int64_t Hq, int64_t Hkv,
                int64_t D, int64_t window, float softcap) {
  const int64_t group = Hq / Hkv;
  at::parallel_for(0, num_queries * Hq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    std::vector<float> acc(D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / Hq, h = i % Hq, g = h / group;
      int64_t first = starts[t];
      const int64_t last = starts[t + 1];
      if (window > 0 && last - first > window) first = last - window;
      const float* qv = q + i * D;
      float* o = out + i * D;
      if (last <= first) {
        std::fill(o, o + D, 0.0f);
        continue;
      }
      p.resize(last - first);
      float top = -INFINITY;
      for (int64_t j = first; j < last; ++j) {
        float s = dot(qv, keys + (slots[j] * Hkv + g) * D, D);
        if (softcap > 0) s = std::tanh(s / softcap) * softcap;
        p[j - first] = s;
        top = std::max(top, s);
      }
      float total = 0.0f;
      for (auto& s : p) total += (s = std::exp(s - top));
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = first; j < last; ++j) {
        const __m256 w = _mm256_set1_ps(p[j - first]);
        const T* v = values + (slots[j] * Hkv + g) * D;
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(&acc[d], _mm256_fmadd_ps(w, load8(v + d), _mm256_loadu_ps(&acc[d])));
      }
      for (int64_t d = 0; d < D; ++d) o[d] = acc[d] / total;
    }
  });
}

}  // namespace

// q [T, Hq, D] fp32 (scaled); keys, values [num_slots, Hkv, D] fp32 or bf16, contiguous;
// slots [S] int64; starts [T + 1] int64: query t reads slots[starts[t] .. starts[t + 1]) in
// order (with window > 0 only the last `window` of them); softcap > 0: scores become
// softcap * tanh(score / softcap) -> [T, Hq, D] fp32 (zeros for a query with no keys)
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& slots, const torch::Tensor& starts, int64_t window,
                     double softcap) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && q.dim() == 3 && q.is_contiguous(),
              "attend: q [T, Hq, D] fp32 contiguous");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.is_contiguous() &&
              values.is_contiguous() && keys.scalar_type() == values.scalar_type(),
              "attend: keys, values [slots, Hkv, D] alike, contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = keys.size(1);
  TORCH_CHECK(keys.size(2) == D && D % 8 == 0 && Hq % Hkv == 0, "attend: D % 8 == 0, Hq % Hkv == 0");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && starts.scalar_type() == torch::kInt64 &&
              slots.is_contiguous() && starts.is_contiguous() && starts.numel() == T + 1,
              "attend: slots, starts int64 contiguous, starts [T + 1]");
  auto out = torch::empty_like(q);
  if (keys.scalar_type() == torch::kFloat32) {
    attend_all(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
               slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(), T, Hq,
               Hkv, D, window, static_cast<float>(softcap));
  } else {
    TORCH_CHECK(keys.scalar_type() == torch::kBFloat16, "attend: fp32 or bf16 caches");
    attend_all(q.data_ptr<float>(), keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(),
               slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(), T, Hq,
               Hkv, D, window, static_cast<float>(softcap));
  }
  return out;
}

// x [..., K] fp32, weight [N, K] fp32 contiguous, K a multiple of 8, bias [N] or None -> [..., N]
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && weight.scalar_type() == torch::kFloat32,
              "linear: fp32 tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(-1) &&
              x.size(-1) % 8 == 0, "linear: weight [N, K] contiguous, K = x's last dim, K % 8 == 0");
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
  m.def("attend", &attend, "row-invariant attention of each query over its own key slots");
}

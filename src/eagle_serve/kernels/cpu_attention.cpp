// Row-invariant attention on CPU (eagle_serve/kernels/cpu.py builds it with cpu.cpp).
// attend: each (query, q head) attends over its own list of key slots in order: scores by the
//   same dot product, a softmax in one pass order, the weighted sum of values along the list;
//   the q heads that share a kv head (up to 4 at a time) share the key and value loads.
#include "cpu.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

// a vector of floats from fp32 or bf16 memory: kLanes of them, or (`half`, AVX-512 only: a
// head's last 8 where D % 16 == 8) 8 and zeros above; and its store
#ifdef EAGLE_AVX512
inline vec vload(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
inline vec vload_half(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_zextps256_ps512(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
}
inline void vstore(float* p, vec v, bool half) {
  if (half) _mm512_mask_storeu_ps(p, 0xFF, v);
  else _mm512_storeu_ps(p, v);
}
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
#else
inline vec vload(const at::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline vec vload_half(const at::BFloat16* p) { return vload(p); }  // never called: D % 8 == 0
inline void vstore(float* p, vec v, bool) { _mm256_storeu_ps(p, v); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
#endif
template <typename T>
inline vec vload_part(const T* p, bool half) { return half ? vload_half(p) : vload(p); }

// p[j] = e^(p[j] - top) for j < L (vexp, kLanes at a time, the last ones masked) -> their sum
// (kLanes-lane partial sums in key order, then the fixed lane reduction)
inline float exp_shifted(float* p, int64_t L, float top) {
  vec sum = vzero();
  const vec shift = vset1(top);
  for (int64_t j = 0; j < L; j += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, L - j);
#ifdef EAGLE_AVX512
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    const vec e = vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p + j), shift));
    _mm512_mask_storeu_ps(p + j, m, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
#else
    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const vec e = _mm256_and_ps(_mm256_castsi256_ps(m), vexp(_mm256_sub_ps(_mm256_maskload_ps(p + j, m), shift)));
    _mm256_maskstore_ps(p + j, m, e);
    sum = _mm256_add_ps(sum, e);
#endif
  }
  return vsum(sum);
}

// C consecutive q heads of one query (q [C, D]) over the keys at slots[0 .. L) of one kv head:
// out [C, D]. Each head's score for a key is the same kLanes-lane FMA sequence along D and lane
// sum, its softmax's exponentials by vexp (summed kLanes keys at a time, in key order), its output
// the weighted sum of values in key order
// (kLanes-lane FMAs, accumulated in registers over kChunk vectors of D at a time), whichever
// heads share the call (they share the key and value loads).
template <int C, typename T>
void heads_over_keys(const float* q, const T* keys, const T* values, const int64_t* slots,
                     int64_t L, int64_t Hkv, int64_t g, int64_t D, float softcap, float* out,
                     std::vector<float>& p) {
  constexpr int kChunk = kLanes == 16 ? 4 : 2;  // vectors of D a pass over the values (registers)
  p.resize(C * L);
  float top[C], total[C];
  for (int c = 0; c < C; ++c) top[c] = -INFINITY;
  for (int64_t j0 = 0; j0 < L; j0 += 2) {  // two keys at a time: 2 C independent sums
    const int64_t nk = std::min<int64_t>(2, L - j0);
    const T* k[2] = {keys + (slots[j0] * Hkv + g) * D, keys + (slots[j0 + nk - 1] * Hkv + g) * D};
    vec a[2][C];
    for (int i = 0; i < 2; ++i)
      for (int c = 0; c < C; ++c) a[i][c] = vzero();
    for (int64_t d = 0; d < D; d += kLanes) {
      const bool half = d + kLanes > D;
      const vec kv[2] = {vload_part(k[0] + d, half), vload_part(k[1] + d, half)};
      for (int c = 0; c < C; ++c) {
        const vec qv = vload_part(q + c * D + d, half);
        for (int i = 0; i < 2; ++i) a[i][c] = vfma(qv, kv[i], a[i][c]);
      }
    }
    for (int i = 0; i < nk; ++i)
      for (int c = 0; c < C; ++c) {
        float s = vsum(a[i][c]);
        if (softcap > 0) s = std::tanh(s / softcap) * softcap;
        p[c * L + j0 + i] = s;
        top[c] = std::max(top[c], s);
      }
  }
  for (int c = 0; c < C; ++c) total[c] = exp_shifted(p.data() + c * L, L, top[c]);
  for (int64_t d0 = 0; d0 < D; d0 += kChunk * kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kChunk, (D - d0 + kLanes - 1) / kLanes));
    vec acc[C][kChunk];
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < kChunk; ++u) acc[c][u] = vzero();
    for (int64_t j = 0; j < L; ++j) {
      const T* v = values + (slots[j] * Hkv + g) * D + d0;
      vec vv[kChunk];
      for (int u = 0; u < kChunk; ++u)
        vv[u] = u < n ? vload_part(v + u * kLanes, d0 + (u + 1) * kLanes > D) : vzero();
      for (int c = 0; c < C; ++c) {
        const vec w = vset1(p[c * L + j]);
        for (int u = 0; u < kChunk; ++u) acc[c][u] = vfma(w, vv[u], acc[c][u]);
      }
    }
    for (int c = 0; c < C; ++c)
      for (int u = 0; u < n; ++u)
        vstore(out + c * D + d0 + u * kLanes, vdiv(acc[c][u], vset1(total[c])),
               d0 + (u + 1) * kLanes > D);
  }
}

template <typename T>
void attend_all(const float* q, const T* keys, const T* values, const int64_t* slots,
                const int64_t* starts, float* out, int64_t num_queries, int64_t Hq, int64_t Hkv,
                int64_t D, int64_t window, float softcap) {
  const int64_t group = Hq / Hkv;
  at::parallel_for(0, num_queries * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> p;
    for (int64_t i = begin; i < end; ++i) {  // kv head g (its keys stay in cache), query t
      const int64_t g = i / num_queries, t = i % num_queries;  // q heads g * group ..
      int64_t first = starts[t];
      const int64_t last = starts[t + 1];
      if (window > 0 && last - first > window) first = last - window;
      for (int64_t h = g * group; h < (g + 1) * group; h += 4) {  // up to 4 heads a call
        const float* qh = q + (t * Hq + h) * D;
        float* o = out + (t * Hq + h) * D;
        const int64_t n = std::min<int64_t>(4, (g + 1) * group - h), L = last - first;
        if (L <= 0) {
          std::fill(o, o + n * D, 0.0f);
          continue;
        }
        const int64_t* sl = slots + first;
        switch (n) {
          case 1: heads_over_keys<1>(qh, keys, values, sl, L, Hkv, g, D, softcap, o, p); break;
          case 2: heads_over_keys<2>(qh, keys, values, sl, L, Hkv, g, D, softcap, o, p); break;
          case 3: heads_over_keys<3>(qh, keys, values, sl, L, Hkv, g, D, softcap, o, p); break;
          default: heads_over_keys<4>(qh, keys, values, sl, L, Hkv, g, D, softcap, o, p);
        }
      }
    }
  });
}

}  // namespace

// q [T, Hq, D] fp32 (scaled); keys, values [num_slots, Hkv, D] fp32 or bf16, contiguous;
// slots [S] int64; starts [T + 1] int64: query t reads slots[starts[t] .. starts[t + 1]) in
// order (with window > 0 only the last `window` of them); softcap > 0: scores become
// softcap * tanh(score / softcap) -> [T, Hq, D] fp32 (zeros for a query with no keys)
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& slots, const at::Tensor& starts, int64_t window,
                  double softcap) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous(),
              "attend: q [T, Hq, D] fp32 contiguous");
  TORCH_CHECK(keys.dim() == 3 && keys.sizes() == values.sizes() && keys.is_contiguous() &&
              values.is_contiguous() && keys.scalar_type() == values.scalar_type(),
              "attend: keys, values [slots, Hkv, D] alike, contiguous");
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = keys.size(1);
  TORCH_CHECK(keys.size(2) == D && D % 8 == 0 && Hq % Hkv == 0, "attend: D % 8 == 0, Hq % Hkv == 0");
  TORCH_CHECK(slots.scalar_type() == at::kLong && starts.scalar_type() == at::kLong &&
              slots.is_contiguous() && starts.is_contiguous() && starts.numel() == T + 1,
              "attend: slots, starts int64 contiguous, starts [T + 1]");
  auto out = q.new_empty(q.sizes());
  if (keys.scalar_type() == at::kFloat) {
    attend_all(q.data_ptr<float>(), keys.data_ptr<float>(), values.data_ptr<float>(),
               slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(), T, Hq,
               Hkv, D, window, static_cast<float>(softcap));
  } else {
    TORCH_CHECK(keys.scalar_type() == at::kBFloat16, "attend: fp32 or bf16 caches");
    attend_all(q.data_ptr<float>(), keys.data_ptr<at::BFloat16>(), values.data_ptr<at::BFloat16>(),
               slots.data_ptr<int64_t>(), starts.data_ptr<int64_t>(), out.data_ptr<float>(), T, Hq,
               Hkv, D, window, static_cast<float>(softcap));
  }
  return out;
}

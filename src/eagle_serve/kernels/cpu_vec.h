// The vector helpers of cpu.cpp and cpu_attention.cpp: the vector the linears and the attention
// sum along (16 lanes where the build has AVX-512, else 8) and its fixed lane reduction.
#pragma once
#include <immintrin.h>

#include "cpu.h"

namespace {

inline float lane_sum(__m256 v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// The vector the linears sum along k: 16 lanes where the build has AVX-512 (eagle_serve/kernels/cpu.py builds
// it so on CPUs with AVX512F/DQ: half the FMAs of a verify row), else 8. The lane reduction is
// fixed either way, so every row of a build gets one instruction sequence (the bits differ between
// the two builds, as between any two float kernels).
#ifdef EAGLE_AVX512
using vec = __m512;
constexpr int64_t kLanes = 16;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset1(float f) { return _mm512_set1_ps(f); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_half(const float* p) { return _mm512_maskz_loadu_ps(0xFF, p); }  // 8, zeros above
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec v) {  // lanes i + (i + 8) first, then lane_sum
  return lane_sum(_mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)));
}
#else
using vec = __m256;
constexpr int64_t kLanes = 8;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset1(float f) { return _mm256_set1_ps(f); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload_half(const float* p) { return _mm256_loadu_ps(p); }  // never called: K % 8 == 0
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec v) { return lane_sum(v); }
#endif

// e^x lane by lane for x <= 0 (a softmax's shifted scores): Cephes' expf (n = round(x log2 e),
// r = x - n ln 2 in two steps, a degree-6 polynomial in r, times 2^n), within ~2 ulp of the exact
// value and 0 below e^-87; one sequence per lane, so every lane of every call computes alike.
inline vec vexp(vec x) {
  const auto c = [](float f) { return vset1(f); };
#ifdef EAGLE_AVX512
  x = _mm512_max_ps(x, c(-88.0f));
  const vec n = _mm512_roundscale_ps(_mm512_mul_ps(x, c(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vec tiny = _mm256_cmp_ps(x, c(-87.0f), _CMP_LT_OQ);
  x = _mm256_max_ps(x, c(-87.0f));
  const vec n = _mm256_round_ps(_mm256_mul_ps(x, c(1.44269504088896341f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  vec r = vfma(n, c(-0.693359375f), x);
  r = vfma(n, c(2.12194440e-4f), r);
  vec p = c(1.9875691500e-4f);
  for (float k : {1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f})
    p = vfma(p, r, c(k));
#ifdef EAGLE_AVX512
  p = _mm512_add_ps(vfma(p, _mm512_mul_ps(r, r), r), c(1.0f));
  return _mm512_scalef_ps(p, n);
#else
  p = _mm256_add_ps(vfma(p, _mm256_mul_ps(r, r), r), c(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
#endif
}

}  // namespace

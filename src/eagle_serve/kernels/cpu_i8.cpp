// linear_i8: a Q4_1 / Q8_0 linear with its activations rounded to 8 bits (llama.cpp's
// arithmetic), on AVX512-VNNI or AVX2: each row's activations, block by block of 32 along
// k, become qa = round(x / da) with da = max |x| / 127, and every output sums, block by block in
// order, d * da * sum(q * qa) + m * da * sum(qa), the integer sums exact (vpdpbusd: 64
// multiply-adds an instruction against 16 fp32 FMAs; Q4_1 nibbles unpack by 3 instructions per
// 128 weights against 4 per 16). Not the dense fp32 linear's bits (cpu.cpp's kernels keep
// those): the default target's forward on it is 1.5-1.9x faster (docs/performance.md), another
// arithmetic. Row-invariant alike: a row's quantization and every output's sum depend on that
// row alone, whatever the tile or thread.
//
// Packed layout (eagle_serve.cpu.quant.BlockWeight.int8_activations): weight rows in groups of
// 16 (one zmm lane each; AVX2 runs a group as two halves of 8), per group and block `C` chunks of
// 64 bytes, byte 4 * lane + j of chunk c holding the weight of row lane at k = 4c + j: Q4_1 as
// nibbles (C = 4, uint8: the low nibble k = 4c + j, the high one k = 16 + 4c + j); Q8_0 (C = 8)
// with VNNI as the unsigned byte q + 128 (and m = -128 d), on AVX2 as q itself (int8; vpmaddubsw
// multiplies |q| by the activation carrying q's sign); scales [G, K/32, 2, 16] (d, m of each lane).
#include "cpu.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

#define EAGLE_I8 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")))

namespace {

constexpr int64_t kGroup = 16;
constexpr int kRowTile = 6;  // rows a tile takes at most; more run in balanced tiles (the LM head of
                               // the default target here: 7 rows as one tile 1.6 ms, as 4 + 3 1.0)

// x [R, K] -> qa [R, K] int8, da [R, K/32] (the scale), sa [R, K/32] (da * sum of the block's qa)
// and, where asked, amaxes [R, K/32] (the block's max |x|)
EAGLE_I8 void quantize_rows(const float* x, int64_t R, int64_t K, int8_t* qa, float* da, float* sa,
                            float* amaxes = nullptr) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* p = x + r * K + b * 32;
      const __m512 v0 = _mm512_loadu_ps(p), v1 = _mm512_loadu_ps(p + 16);
      const __m512 a = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
      const float amax = _mm512_reduce_max_ps(a);
      if (amaxes) amaxes[r * (K / 32) + b] = amax;
      const __m512 inv = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // round to nearest even
      const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + r * K + b * 32), _mm512_cvtsepi32_epi8(i0));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + r * K + b * 32 + 16), _mm512_cvtsepi32_epi8(i1));
      const float d = amax / 127.0f;
      da[r * (K / 32) + b] = d;
      sa[r * (K / 32) + b] = d * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
    }
}

// A screen's error bound beside the outputs (screen_i8): per block the 16 outputs' coefficients
// of the block's max |x| ([B, 16] of a group) and the rows' maxes [R, B]; out then gets
// output + bound, low output - bound.
struct Bound {
  const float* coef;
  const float* amax;
  float* low;
};

// RB rows against one group of 16 weight rows: out[r, lane] (with a Bound: see there)
template <int RB, int C, bool Bounded = false>
EAGLE_I8 inline void tile(const uint8_t* w, const float* scales, int64_t K, const int8_t* qa,
                          const float* da, const float* sa, float* out, int64_t N, Bound bound = {}) {
  const int64_t B = K / 32;
  __m512 acc[RB], err[RB];
  for (int r = 0; r < RB; ++r) acc[r] = err[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < B; ++b) {
    __m512i wv[8];
    const uint8_t* wb = w + b * C * 64;
    if constexpr (C == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i v = _mm512_loadu_si512(wb + c * 64);
        wv[c] = _mm512_and_si512(v, low);
        wv[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      }
    } else {
      for (int c = 0; c < 8; ++c) wv[c] = _mm512_loadu_si512(wb + c * 64);
    }
    const __m512 d = _mm512_loadu_ps(scales + b * 32), m = _mm512_loadu_ps(scales + b * 32 + 16);
    for (int r = 0; r < RB; ++r) {
      const int32_t* a = reinterpret_cast<const int32_t*>(qa + r * K + b * 32);
      __m512i s = _mm512_setzero_si512();
      for (int c = 0; c < 8; ++c) s = _mm512_dpbusd_epi32(s, wv[c], _mm512_set1_epi32(a[c]));
      const __m512 t = _mm512_mul_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(da[r * B + b]));
      acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
      acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(sa[r * B + b]), acc[r]);
      if constexpr (Bounded)
        err[r] = _mm512_fmadd_ps(_mm512_loadu_ps(bound.coef + b * 16), _mm512_set1_ps(bound.amax[r * B + b]), err[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    if constexpr (Bounded) {
      _mm512_storeu_ps(out + r * N, _mm512_add_ps(acc[r], err[r]));
      _mm512_storeu_ps(bound.low + r * N, _mm512_sub_ps(acc[r], err[r]));
    } else {
      _mm512_storeu_ps(out + r * N, acc[r]);
    }
  }
}

template <int C, bool Bounded>
EAGLE_I8 void rows_tile(int RB, const uint8_t* w, const float* scales, int64_t K, const int8_t* qa,
                        const float* da, const float* sa, float* out, int64_t N, Bound bound) {
  switch (RB) {
    case 1: tile<1, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 2: tile<2, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 3: tile<3, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 4: tile<4, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 5: tile<5, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 6: tile<6, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 7: tile<7, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
    case 8: tile<8, C, Bounded>(w, scales, K, qa, da, sa, out, N, bound); break;
  }
}

// bound: (Bounded) coef [G, B, 16], amax [R, B], low [R, N]
template <int C, bool Bounded = false>
EAGLE_I8 void matmul(const int8_t* qa, const float* da, const float* sa, int64_t R, int64_t K,
                     const uint8_t* w, const float* scales, int64_t N, float* out, Bound bound = {}) {
  const int64_t G = N / kGroup, B = K / 32;
  at::parallel_for(0, G, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t r = 0, rb; r < R; r += rb) {
        const int64_t tiles = (R - r + kRowTile - 1) / kRowTile;
        rb = (R - r + tiles - 1) / tiles;
        const Bound at = Bounded ? Bound{bound.coef + g * B * 16, bound.amax + r * B, bound.low + r * N + g * kGroup}
                                 : Bound{};
        rows_tile<C, Bounded>(static_cast<int>(rb), w + g * B * C * 64, scales + g * B * 32, K, qa + r * K,
                              da + r * B, sa + r * B, out + r * N + g * kGroup, N, at);
      }
  });
}

// The AVX2 path (no VNNI): vpmaddubsw + vpmaddwd sum 4 products a lane (|q| <= 128 and
// |qa| <= 127 keep the pairs below int16's limit), a group's two halves of 8 rows in turn.
void quantize_rows_avx2(const float* x, int64_t R, int64_t K, int8_t* qa, float* da, float* sa,
                        float* amaxes = nullptr) {
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < K / 32; ++b) {
      const float* p = x + r * K + b * 32;
      float amax = 0.0f;
      for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(p[i]));
      if (amaxes) amaxes[r * (K / 32) + b] = amax;
      const float inv = amax > 0 ? 127.0f / amax : 0.0f;
      int sum = 0;
      for (int i = 0; i < 32; ++i) {
        const int q = static_cast<int>(std::nearbyint(p[i] * inv));  // round to nearest even
        qa[r * K + b * 32 + i] = static_cast<int8_t>(q);
        sum += q;
      }
      const float d = amax / 127.0f;
      da[r * (K / 32) + b] = d;
      sa[r * (K / 32) + b] = d * static_cast<float>(sum);
    }
}

constexpr int kRowTileAvx2 = 4;

template <int RB, bool Q4, bool Bounded = false>
inline void tile_avx2(const uint8_t* w, int half, const float* scales, int64_t K, const int8_t* qa,
                      const float* da, const float* sa, float* out, int64_t N, Bound bound = {}) {
  constexpr int C = Q4 ? 4 : 8;
  const int64_t B = K / 32;
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  __m256 acc[RB], err[RB];
  for (int r = 0; r < RB; ++r) acc[r] = err[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* wb = w + b * C * 64 + half * 32;
    __m256i s[RB];
    for (int r = 0; r < RB; ++r) s[r] = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + (Q4 ? c & 3 : c) * 64));
      const __m256i wv = !Q4 ? _mm256_sign_epi8(v, v)
                              : c < 4 ? _mm256_and_si256(v, low) : _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      for (int r = 0; r < RB; ++r) {
        __m256i a = _mm256_set1_epi32(reinterpret_cast<const int32_t*>(qa + r * K + b * 32)[c]);
        if constexpr (!Q4) a = _mm256_sign_epi8(a, v);
        s[r] = _mm256_add_epi32(s[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wv, a), ones));
      }
    }
    const __m256 d = _mm256_loadu_ps(scales + b * 32 + half * 8);
    const __m256 m = _mm256_loadu_ps(scales + b * 32 + 16 + half * 8);
    for (int r = 0; r < RB; ++r) {
      const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(s[r]), _mm256_set1_ps(da[r * B + b]));
      acc[r] = _mm256_fmadd_ps(t, d, acc[r]);
      if constexpr (Q4) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sa[r * B + b]), acc[r]);
      if constexpr (Bounded)
        err[r] = _mm256_fmadd_ps(_mm256_loadu_ps(bound.coef + b * 16 + half * 8),
                                 _mm256_set1_ps(bound.amax[r * B + b]), err[r]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    if constexpr (Bounded) {
      _mm256_storeu_ps(out + r * N + half * 8, _mm256_add_ps(acc[r], err[r]));
      _mm256_storeu_ps(bound.low + r * N + half * 8, _mm256_sub_ps(acc[r], err[r]));
    } else {
      _mm256_storeu_ps(out + r * N + half * 8, acc[r]);
    }
  }
}

// bound: (Bounded) as matmul's
template <bool Q4, bool Bounded = false>
void matmul_avx2(const int8_t* qa, const float* da, const float* sa, int64_t R, int64_t K,
                 const uint8_t* w, const float* scales, int64_t N, float* out, Bound bound = {}) {
  constexpr int C = Q4 ? 4 : 8;
  const int64_t G = N / kGroup, B = K / 32;
  at::parallel_for(0, G, 4, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int half = 0; half < 2; ++half)
        for (int64_t r = 0; r < R; r += kRowTileAvx2) {
          const uint8_t* wg = w + g * B * C * 64;
          const float* sg = scales + g * B * 32;
          float* o = out + r * N + g * kGroup;
          const int8_t* q = qa + r * K;
          const Bound at = Bounded ? Bound{bound.coef + g * B * 16, bound.amax + r * B, bound.low + r * N + g * kGroup}
                                   : Bound{};
          switch (std::min<int64_t>(kRowTileAvx2, R - r)) {
            case 1: tile_avx2<1, Q4, Bounded>(wg, half, sg, K, q, da + r * B, sa + r * B, o, N, at); break;
            case 2: tile_avx2<2, Q4, Bounded>(wg, half, sg, K, q, da + r * B, sa + r * B, o, N, at); break;
            case 3: tile_avx2<3, Q4, Bounded>(wg, half, sg, K, q, da + r * B, sa + r * B, o, N, at); break;
            case 4: tile_avx2<4, Q4, Bounded>(wg, half, sg, K, q, da + r * B, sa + r * B, o, N, at); break;
          }
        }
  });
}

bool cpu_has_vnni() {
#ifdef EAGLE_AVX512
  return __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

}  // namespace

const bool kI8Vnni = cpu_has_vnni();

// x [..., K] fp32; q [N/16, K/32, C, 64] (C = 4: Q4_1, uint8; 8: Q8_0, uint8 with VNNI (kI8Vnni),
// int8 without), scales [N/16, K/32, 2, 16] fp32 (BlockWeight.int8_activations); bias [N] or
// None -> [..., N]
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = q.size(0) * kGroup, C = q.size(2);
  const auto q_type = C == 8 && !kI8Vnni ? at::kChar : at::kByte;
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == q_type &&
              scales.scalar_type() == at::kFloat && q.is_contiguous() && scales.is_contiguous() &&
              q.dim() == 4 && K % 32 == 0 && q.size(1) == K / 32 && (C == 4 || C == 8) &&
              q.size(3) == 64 && scales.numel() == N / kGroup * (K / 32) * 32,
              "linear_i8: x [..., K] fp32, q [N/16, K/32, 4 or 8, 64] uint8 (Q8_0 without VNNI: "
              "int8), scales [N/16, K/32, 2, 16]");
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t R = rows.size(0);
  auto qa = x.new_empty({R, K}, at::kChar);
  auto ds = x.new_empty({2, R, K / 32});
  auto out = x.new_empty({R, N});
  const auto w = static_cast<const uint8_t*>(q.data_ptr());
  float *da = ds[0].data_ptr<float>(), *sa = ds[1].data_ptr<float>(), *o = out.data_ptr<float>();
  if (kI8Vnni) {
    quantize_rows(rows.data_ptr<float>(), R, K, qa.data_ptr<int8_t>(), da, sa);
    (C == 4 ? matmul<4> : matmul<8>)(qa.data_ptr<int8_t>(), da, sa, R, K, w, scales.data_ptr<float>(), N, o, Bound{});
  } else {
    quantize_rows_avx2(rows.data_ptr<float>(), R, K, qa.data_ptr<int8_t>(), da, sa);
    (C == 4 ? matmul_avx2<true> : matmul_avx2<false>)(qa.data_ptr<int8_t>(), da, sa, R, K, w,
                                                      scales.data_ptr<float>(), N, o, Bound{});
  }
  if (bias.has_value()) out.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

namespace {

// The kept tokens from the outputs' upper (high) and lower (low) bounds [R, N] (finite): those
// whose upper bound reaches their row's largest lower bound in some row, ascending; empty past
// max_kept (AVX2 code, which AVX-512 CPUs run too).
std::vector<int64_t> kept_tokens(const float* high, const float* low, int64_t R, int64_t N,
                                 int64_t max_kept) {
  std::vector<__m256> floor(R);  // N: a multiple of 16
  for (int64_t r = 0; r < R; ++r) {
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t v = 0; v < N; v += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(low + r * N + v));
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    floor[r] = _mm256_set1_ps(*std::max_element(lanes, lanes + 8));
  }
  std::vector<int64_t> kept;
  for (int64_t v = 0; v < N; v += 8) {
    int any = 0;
    for (int64_t r = 0; r < R; ++r)
      any |= _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(high + r * N + v), floor[r], _CMP_GE_OQ));
    for (; any; any &= any - 1) kept.push_back(v + __builtin_ctz(any));
    if (static_cast<int64_t>(kept.size()) > max_kept) return {};
  }
  return kept;
}

}  // namespace

// x [R, K] fp32 (finite); q, scales: linear_i8's; bound [N/16, K/32, 16] fp32: per output and
// block the coefficient of the block's max |x| in the output's error bound
// (eagle_serve.cpu.argmax.ScreenedArgmax) -> the outputs whose value may be their row's largest
// in some row (approx + bound >= the row's max of approx - bound), ascending; empty where more
// than max_kept (or none) are. Each bound is summed beside its 8-bit output, in the same pass
// over the weights (AVX512-VNNI or AVX2, as linear_i8).
at::Tensor screen_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const at::Tensor& bound, int64_t max_kept) {
  const int64_t K = x.size(-1), N = q.size(0) * kGroup, C = q.size(2), B = K / 32;
  const auto q_type = C == 8 && !kI8Vnni ? at::kChar : at::kByte;
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && q.scalar_type() == q_type &&
              q.dim() == 4 && q.size(1) == B && K % 32 == 0 && (C == 4 || C == 8) && q.is_contiguous() &&
              scales.is_contiguous() && scales.numel() == N / kGroup * B * 32 &&
              bound.scalar_type() == at::kFloat && bound.is_contiguous() && bound.numel() == N * B,
              "screen_i8: x [R, K] fp32, q [N/16, K/32, 4 or 8, 64] uint8 (Q8_0 without VNNI: int8), "
              "scales [N/16, K/32, 2, 16], bound [N/16, K/32, 16]");
  const auto rows = x.contiguous();
  const int64_t R = rows.size(0);
  const float* xp = rows.data_ptr<float>();
  if (!std::all_of(xp, xp + R * K, [](float f) { return std::isfinite(f); }))
    return x.new_empty({0}, at::kLong);
  auto qa = x.new_empty({R, K}, at::kChar);
  auto small = x.new_empty({3, R, B});  // da, sa, amax
  auto high = x.new_empty({R, N}), low = x.new_empty({R, N});
  float *da = small[0].data_ptr<float>(), *sa = small[1].data_ptr<float>(), *amax = small[2].data_ptr<float>();
  const auto w = static_cast<const uint8_t*>(q.data_ptr());
  const Bound b{bound.data_ptr<float>(), amax, low.data_ptr<float>()};
  float *h = high.data_ptr<float>(), *l = low.data_ptr<float>();
  if (kI8Vnni) {
    quantize_rows(xp, R, K, qa.data_ptr<int8_t>(), da, sa, amax);
    (C == 4 ? matmul<4, true> : matmul<8, true>)(qa.data_ptr<int8_t>(), da, sa, R, K, w, scales.data_ptr<float>(), N, h, b);
  } else {
    quantize_rows_avx2(xp, R, K, qa.data_ptr<int8_t>(), da, sa, amax);
    (C == 4 ? matmul_avx2<true, true> : matmul_avx2<false, true>)(qa.data_ptr<int8_t>(), da, sa, R, K, w,
                                                                  scales.data_ptr<float>(), N, h, b);
  }
  const auto kept = kept_tokens(h, l, R, N, max_kept);
  auto out = x.new_empty({static_cast<int64_t>(kept.size())}, at::kLong);
  std::copy(kept.begin(), kept.end(), out.data_ptr<int64_t>());
  return out;
}

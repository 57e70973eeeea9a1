// Row-invariant CPU kernels for AVX2 + FMA, and for AVX-512 where the CPU has it (eagle_serve/kernels/cpu.py
// compiles and loads them): a verify row gets exactly the bits its one-token decode step gets,
// because every output element is computed by the same instruction sequence whatever the other
// rows, the tile it falls in or the thread that runs it (threads split independent outputs:
// torch's pool, at::parallel_for).
//
// linear: out[r, n] = sum_k x[r, k] * w[n, k] (+ bias[n]), fp32: eight lanes (sixteen where built
//   for AVX-512) of fused multiply-adds along k in order, then one fixed lane reduction. Tiles of
//   up to 4 rows x 3 output features keep 12 accumulators in registers and read each weight
//   vector once per 4 rows (a single row: 1 x 4); how rows and features are tiled never changes
//   an element's sum.
// linear_q4_1, linear_q8_0: `linear` of a weight held block-quantized (GGUF's layouts) whose
//   blocks rebuild the dense fp32 weight exactly: the same bits, from a fifth of the bytes.
// rms_norm: each row's sum of squares by the same eight-lane sequence, then scale * (x * inv).
// rope_write_kv: HF's rotation of q and k, and the KV cache write, in one call.
// (attend: cpu_attention.cpp; the vector helpers both use: cpu_vec.h)
#include "cpu.h"
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>

namespace {

// RB rows of x [.., K] against NB weight rows w [.., K] -> out[r * N + n]; pf: NB weight rows
// to prefetch meanwhile (or null). K % 8 == 0: a last 8 (16-lane build, K % 16 == 8) loads zeros
// above them, which add nothing.
template <int RB, int NB>
inline void tile(const float* x, const float* w, int64_t K, float* out, int64_t N, const float* pf) {
  vec acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = vzero();
  auto step = [&](int64_t k, auto load) {
    vec wv[NB];
    for (int n = 0; n < NB; ++n) wv[n] = load(w + n * K + k);
    for (int r = 0; r < RB; ++r) {
      const vec xv = load(x + r * K + k);
      for (int n = 0; n < NB; ++n) acc[r][n] = vfma(xv, wv[n], acc[r][n]);
    }
  };
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (pf && k % 16 == 0)  // a 64-byte line of each row every 16 floats
      for (int n = 0; n < NB; ++n) _mm_prefetch(reinterpret_cast<const char*>(pf + n * K + k), _MM_HINT_T0);
    step(k, [](const float* p) { return vload(p); });
  }
  if (k < K) step(k, [](const float* p) { return vload_half(p); });
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) out[r * N + n] = vsum(acc[r][n]);
}

// all R rows against NB weight rows starting at output feature n, in tiles of up to RB rows (x
// stays in cache; the weight rows are read from memory by the first tile, which prefetches the
// rows at pf meanwhile, so the other tiles' arithmetic overlaps the weight stream)
template <int NB, int RB>
void columns(const float* x, int64_t R, int64_t K, const float* w, int64_t n, float* out, int64_t N,
             const float* pf) {
  for (int64_t r = 0; r < R; pf = nullptr) {
    const int64_t rows = std::min<int64_t>(R - r, RB);
    float* o = out + r * N + n;
    if (rows == RB) tile<RB, NB>(x + r * K, w + n * K, K, o, N, pf);
    else if (rows == 3) tile<3, NB>(x + r * K, w + n * K, K, o, N, pf);
    else if (rows == 2) tile<2, NB>(x + r * K, w + n * K, K, o, N, pf);
    else tile<1, NB>(x + r * K, w + n * K, K, o, N, pf);
    r += rows;
  }
}

// out [R, N] = x [R, K] w [N, K]^T, threads splitting the output features in blocks of NB
template <int NB, int RB>
void matmul(const float* x, int64_t R, int64_t K, const float* w, int64_t N, float* out) {
  constexpr int64_t ahead = 4;  // blocks prefetched ahead (a thread's own next ones)
  at::parallel_for(0, N / NB, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      columns<NB, RB>(x, R, K, w, b * NB, out, N, R > 1 && b + ahead < end ? w + (b + ahead) * NB * K : nullptr);
  });
  for (int64_t n = N / NB * NB; n < N; ++n) columns<1, RB>(x, R, K, w, n, out, N, nullptr);
}

// ---- block-quantized weights (GGUF's Q4_1 and Q8_0 layouts, one block = 32 weights along k) ----
// Each block's weights are rebuilt in fp32 exactly as the dense copy holds them (Q4_1: d * q + m
// by one FMA, where d * q is exact, so it rounds like the dequantizer's multiply-then-add; Q8_0:
// d * q, exact), then enter the same eight-lane FMA sequence as `tile` above: a quantized linear
// gives the dense fp32 linear's bits, reading 0.75 (Q4_1) or 1.125 (Q8_0) bytes per weight
// instead of 4.

struct Q4_1 {  // q [N, K / 2]: byte j of a block holds weight j (low nibble) and j + 16 (high)
  static constexpr int wide_rows = 5;  // on AVX2, up to this many rows tile 2 weight rows wide
  const uint8_t* q; const float* dm; int64_t K;  // dm [N, K / 32, 2]: scale d, offset m
  // the kLanes weights k0 + kLanes s .. of row n (k0 a block start, s < 32 / kLanes)
  inline vec group(int64_t n, int64_t k0, int s) const {
    const uint8_t* b = q + n * (K / 2) + k0 / 2;
    const float* p = dm + (n * (K / 32) + k0 / 32) * 2;
#ifdef EAGLE_AVX512
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    v = s == 0 ? _mm512_and_si512(v, _mm512_set1_epi32(15)) : _mm512_srli_epi32(v, 4);
    return _mm512_fmadd_ps(vset1(p[0]), _mm512_cvtepi32_ps(v), vset1(p[1]));
#else
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b + (s & 1) * 8)));
    v = s < 2 ? _mm256_and_si256(v, _mm256_set1_epi32(15)) : _mm256_srli_epi32(v, 4);
    return _mm256_fmadd_ps(vset1(p[0]), _mm256_cvtepi32_ps(v), vset1(p[1]));
#endif
  }
};

#ifdef EAGLE_AVX512
// Q4_1 for 2+ rows: a block's 16 possible weights d * j + m (j = 0..15) built by one FMA, each
// weight then picked by its nibble (one permute) instead of converted and rebuilt (two FP ops):
// the same FMA per value, so the same bits. The conversions are what a verify row adds beside a
// decode row (each rebuilt vector feeds one FMA per row): SmolLM2-135M's Q4_1 layer linears on
// a 2-core AMD EPYC with AVX-512, interleaved, 2 / 4 / 8 rows 0.90-0.92x / 0.95x / 0.95-0.96x
// the time of `Q4_1`'s; 1 row alike (the permutes then bind), so a decode step keeps `Q4_1`.
struct Q4_1Table : Q4_1 {
  inline vec group(int64_t n, int64_t k0, int s) const {
    const uint8_t* b = q + n * (K / 2) + k0 / 2;
    const float* p = dm + (n * (K / 32) + k0 / 32) * 2;
    const __m512 j = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 table = _mm512_fmadd_ps(vset1(p[0]), j, vset1(p[1]));
    __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    if (s) v = _mm512_srli_epi32(v, 4);  // s == 0: the permute reads each lane's low 4 bits alone
    return _mm512_permutexvar_ps(v, table);
  }
};
#endif

struct Q8_0 {  // q [N, K] int8, d [N, K / 32]
  static constexpr int wide_rows = 0;  // on AVX2 every row count tiles 1 wide
  const int8_t* q; const float* d; int64_t K;
  inline vec group(int64_t n, int64_t k0, int s) const {
    const int8_t* b = q + n * K + k0 + s * kLanes;
#ifdef EAGLE_AVX512
    const __m512i v = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    return _mm512_mul_ps(vset1(d[n * (K / 32) + k0 / 32]), _mm512_cvtepi32_ps(v));
#else
    const __m256i v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
    return _mm256_mul_ps(vset1(d[n * (K / 32) + k0 / 32]), _mm256_cvtepi32_ps(v));
#endif
  }
};

// `tile` for RB rows of x against NB rows n.. of a quantized weight W (K a multiple of 32)
template <int RB, int NB, typename W>
inline void qtile(const float* x, const W& w, int64_t n0, int64_t K, float* out, int64_t N) {
  vec acc[RB][NB];
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) acc[r][n] = vzero();
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    for (int s = 0; s < 32 / kLanes; ++s) {
      vec wv[NB];
      for (int n = 0; n < NB; ++n) wv[n] = w.group(n0 + n, k0, s);
      for (int r = 0; r < RB; ++r) {
        const vec xv = vload(x + r * K + k0 + s * kLanes);
        for (int n = 0; n < NB; ++n) acc[r][n] = vfma(xv, wv[n], acc[r][n]);
      }
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int n = 0; n < NB; ++n) out[r * N + n] = vsum(acc[r][n]);
}

// R = RB rows (1 .. kTileRows) against all N weight rows, threads splitting them in blocks of NB
template <int RB, int NB, typename W>
void qmatmul(const float* x, int64_t K, const W& w, int64_t N, float* out) {
  at::parallel_for(0, N / NB, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) qtile<RB, NB>(x, w, b * NB, K, out + b * NB, N);
  });
  for (int64_t n = N / NB * NB; n < N; ++n) qtile<RB, 1>(x, w, n, K, out + n, N);
}

// Rebuilding a weight costs more than the FMAs that use it, so every row shares each rebuilt
// weight vector in registers: one tile of all rows, on AVX2 2 weight rows wide up to
// W::wide_rows rows, else 1 (measured on an AVX2 CPU, an AMD EPYC: SmolLM2-135M's Q4_1 layer
// linears at 4 rows 25% faster 2 wide than 1 wide, at 5 rows 14%, at 6 rows 7% slower; on a
// 2-core AMD EPYC with AVX2 only (Zen 3), its Q8_0 LM head (49152 x 576) 1 wide at every row
// count, 1 / 2 / 3 / 4 rows 2.3 / 2.6 / 2.7 / 2.8 ms against 4.4 / 4.1-4.5 / 4.4 / 4.0 2 wide,
// interleaved medians). A tile holds up to 7 rows on AVX2 (16 registers: 7 accumulators, the
// weight vector and its rebuild; 8 rows spill, 1.2-1.4x the time of two passes) and 12 on
// AVX-512 (32 registers, 2 wide throughout). More rows than that run in chunks: on AVX-512 a
// pass over the weight per chunk, each rebuilding the weight again (on a Xeon with AVX-512
// faster than one pass of all rows over a copy rebuilt into L1, tried); on AVX2 in one pass
// (qmatmul_chunks).
constexpr int64_t kTileRows = kLanes == 16 ? 12 : 7;

template <typename W>
void qmatmul_rows(const float* x, int64_t R, int64_t K, const W& w, int64_t N, float* out) {
  constexpr int wide = kLanes == 16 ? 12 : W::wide_rows;  // up to this many rows, tiles 2 wide
  switch (R) {
    case 1: qmatmul<1, wide >= 1 ? 2 : 1>(x, K, w, N, out); break;
    case 2: qmatmul<2, wide >= 2 ? 2 : 1>(x, K, w, N, out); break;
    case 3: qmatmul<3, wide >= 3 ? 2 : 1>(x, K, w, N, out); break;
    case 4: qmatmul<4, wide >= 4 ? 2 : 1>(x, K, w, N, out); break;
    case 5: qmatmul<5, wide >= 5 ? 2 : 1>(x, K, w, N, out); break;
    case 6: qmatmul<6, wide >= 6 ? 2 : 1>(x, K, w, N, out); break;
    case 7: qmatmul<7, wide >= 7 ? 2 : 1>(x, K, w, N, out); break;
#ifdef EAGLE_AVX512
    case 8: qmatmul<8, 2>(x, K, w, N, out); break;
    case 9: qmatmul<9, 2>(x, K, w, N, out); break;
    case 10: qmatmul<10, 2>(x, K, w, N, out); break;
    case 11: qmatmul<11, 2>(x, K, w, N, out); break;
    case 12: qmatmul<12, 2>(x, K, w, N, out); break;
#endif
  }
}

#ifndef EAGLE_AVX512
// AVX2, more rows than a tile holds: one pass over the weight, each weight row taking every chunk
// of rows in turn (as few chunks as tiles allow, as even as they divide, 1 wide), so a chunk past
// the first rebuilds the row from L1 instead of streaming the whole weight from memory again (the
// default target's linears on a 2-core AMD EPYC, against a pass per chunk, interleaved: 8 / 10 /
// 12 rows 0.81x / 0.78x / 0.85x the time; 2 wide chunks of up to 5 rows 0.93-0.97x at 8-11)
template <typename W>
void qmatmul_chunks(const float* x, int64_t R, int64_t K, const W& w, int64_t N, float* out) {
  const int64_t chunks = (R + kTileRows - 1) / kTileRows;
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t c = 0, r = 0; c < chunks; ++c) {
        const int64_t rows = (R - r) / (chunks - c);
        const float* xc = x + r * K;
        float* oc = out + r * N + n;
        switch (rows) {
          case 1: qtile<1, 1>(xc, w, n, K, oc, N); break;
          case 2: qtile<2, 1>(xc, w, n, K, oc, N); break;
          case 3: qtile<3, 1>(xc, w, n, K, oc, N); break;
          case 4: qtile<4, 1>(xc, w, n, K, oc, N); break;
          case 5: qtile<5, 1>(xc, w, n, K, oc, N); break;
          case 6: qtile<6, 1>(xc, w, n, K, oc, N); break;
          case 7: qtile<7, 1>(xc, w, n, K, oc, N); break;
        }
        r += rows;
      }
  });
}
#endif

template <typename W>
at::Tensor qlinear(const at::Tensor& x, const W& w, int64_t N,
                   const c10::optional<at::Tensor>& bias) {
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t R = rows.size(0), K = rows.size(1);
  auto out = x.new_empty({R, N});
  const float* xp = rows.data_ptr<float>();
  float* op = out.data_ptr<float>();
#ifdef EAGLE_AVX512  // a pass over the weight per 12 rows (the one-pass chunks are unmeasured there)
  for (int64_t r = 0; r < R; r += kTileRows)
    qmatmul_rows(xp + r * K, std::min(kTileRows, R - r), K, w, N, op + r * N);
#else
  if (R <= kTileRows) qmatmul_rows(xp, R, K, w, N, op);
  else qmatmul_chunks(xp, R, K, w, N, op);
#endif
  if (bias.has_value()) out.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

}  // namespace

// x [..., K] fp32, weight [N, K] fp32 contiguous, K a multiple of 8, bias [N] or None -> [..., N]
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat,
              "linear: fp32 tensors only");
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && weight.size(1) == x.size(-1) &&
              x.size(-1) % 8 == 0, "linear: weight [N, K] contiguous, K = x's last dim, K % 8 == 0");
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t R = rows.size(0), K = rows.size(1), N = weight.size(0);
  auto out = x.new_empty({R, N});
  const float* xp = rows.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (R == 1) matmul<4, 1>(xp, R, K, wp, N, op);  // a decode step: four weight streams
  else matmul<3, 4>(xp, R, K, wp, N, op);        // 12 accumulators, 3 + 1 registers of operands
  if (bias.has_value()) out.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

// x [..., K] fp32; q [N, K / 2] uint8, dm [N, K / 32, 2] fp32 (Q4_1 above); bias
// [N] or None -> [..., N]
at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = q.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kByte &&
              dm.scalar_type() == at::kFloat && q.is_contiguous() && dm.is_contiguous() &&
              K % 32 == 0 && q.size(1) == K / 2 && dm.numel() == N * (K / 32) * 2,
              "linear_q4_1: x [..., K] fp32, q [N, K/2] uint8, dm [N, K/32, 2] fp32, K % 32 == 0");
  const Q4_1 w{q.data_ptr<uint8_t>(), dm.data_ptr<float>(), K};
#ifdef EAGLE_AVX512
  if (x.numel() > K) return qlinear(x, Q4_1Table{w}, N, bias);  // 2+ rows
#endif
  return qlinear(x, w, N, bias);
}

// x [..., K] fp32; q [N, K] int8, d [N, K / 32] fp32 (Q8_0 above); bias [N] or
// None -> [..., N]
at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias) {
  const int64_t K = x.size(-1), N = q.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kChar &&
              d.scalar_type() == at::kFloat && q.is_contiguous() && d.is_contiguous() &&
              K % 32 == 0 && q.size(1) == K && d.numel() == N * (K / 32),
              "linear_q8_0: x [..., K] fp32, q [N, K] int8, d [N, K/32] fp32, K % 32 == 0");
  return qlinear(x, Q8_0{q.data_ptr<int8_t>(), d.data_ptr<float>(), K}, N, bias);
}

// x [..., H] fp32, scale [H] fp32, H a multiple of 8 -> scale * (x / sqrt(mean(x^2) + eps)), each
// row on its own (HF's RMSNorm arithmetic up to float rounding; Gemma's passes 1 + weight)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat &&
              scale.dim() == 1 && scale.is_contiguous() && scale.size(0) == x.size(-1) &&
              x.size(-1) % 8 == 0, "rms_norm: fp32 x [..., H], scale [H], H % 8 == 0");
  const auto rows = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t R = rows.size(0), H = rows.size(1);
  auto out = rows.new_empty(rows.sizes());
  const float* w = scale.data_ptr<float>();
  for (int64_t r = 0; r < R; ++r) {
    const float* xr = rows.data_ptr<float>() + r * H;
    float* o = out.data_ptr<float>() + r * H;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t h = 0; h < H; h += 8) {
      const __m256 v = _mm256_loadu_ps(xr + h);
      acc = _mm256_fmadd_ps(v, v, acc);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(lane_sum(acc) / H + static_cast<float>(eps)));
    for (int64_t h = 0; h < H; h += 8)
      _mm256_storeu_ps(o + h, _mm256_mul_ps(_mm256_loadu_ps(w + h), _mm256_mul_ps(_mm256_loadu_ps(xr + h), inv)));
  }
  return out.view(x.sizes());
}

// q [T, Hq, D], k, v [T, Hkv, D] fp32; cos, sin [T, R] fp32 (R even, R <= D: the first R dims
// of a head rotate, as HF's rotate_half, the rest pass); caches [num_slots, Hkv, D] fp32
// contiguous; slot_mapping [T] int64 (-1: not written). Rotates q and k with HF's arithmetic
// (x * cos + rotate_half(x) * sin, each product rounded: the file builds without FP
// contraction), writes the rotated k and v to their slots -> the rotated q [T, Hq, D]
at::Tensor rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping) {
  const int64_t T = q.size(0), Hq = q.size(1), Hkv = k.size(1), D = q.size(2), R = cos.size(1);
  for (const auto* t : {&q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "rope_write_kv: fp32 tensors only");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == T && k.size(2) == D && R % 2 == 0 && R <= D &&
              cos.sizes() == sin.sizes() && cos.size(0) == T && slot_mapping.numel() == T &&
              slot_mapping.scalar_type() == at::kLong && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && k_cache.dim() == 3 && k_cache.size(1) == Hkv &&
              k_cache.size(2) == D && k_cache.sizes() == v_cache.sizes(), "rope_write_kv: shapes");
  // q, k, v are read in place where each row's heads lie densely (views of one fused q/k/v
  // projection of several rows are not contiguous): no copies
  auto rows = [](const at::Tensor& x) {
    return x.stride(2) == 1 && x.stride(1) == x.size(2) ? x : x.contiguous();
  };
  const auto qc = rows(q), kc = rows(k), vc = rows(v);
  const int64_t q_row = qc.stride(0), k_row = kc.stride(0), v_row = vc.stride(0);
  const auto cc = cos.contiguous(), sc = sin.contiguous(), slots = slot_mapping.contiguous();
  auto q_out = q.new_empty({T, Hq, D});
  const int64_t half = R / 2, num_slots = k_cache.size(0);
  auto rotate = [&](const float* x, float* o, const float* c, const float* s) {
    for (int64_t i = 0; i < half; ++i) o[i] = x[i] * c[i] + (-x[i + half]) * s[i];
    for (int64_t i = half; i < R; ++i) o[i] = x[i] * c[i] + x[i - half] * s[i];
    for (int64_t i = R; i < D; ++i) o[i] = x[i];
  };
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cc.data_ptr<float>() + t * R;
    const float* s = sc.data_ptr<float>() + t * R;
    for (int64_t h = 0; h < Hq; ++h)
      rotate(qc.data_ptr<float>() + t * q_row + h * D, q_out.data_ptr<float>() + (t * Hq + h) * D, c, s);
    const int64_t slot = slots.data_ptr<int64_t>()[t];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "rope_write_kv: slot ", slot, " outside the cache");
    float* k_slot = k_cache.data_ptr<float>() + slot * Hkv * D;  // rotated straight into the cache
    for (int64_t h = 0; h < Hkv; ++h)
      rotate(kc.data_ptr<float>() + t * k_row + h * D, k_slot + h * D, c, s);
    const float* vt = vc.data_ptr<float>() + t * v_row;
    std::copy(vt, vt + Hkv * D, v_cache.data_ptr<float>() + slot * Hkv * D);
  }
  return q_out;
}

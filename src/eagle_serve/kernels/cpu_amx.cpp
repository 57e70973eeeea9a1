// linear_q4_1_amx: a Q4_1 linear in fp32 on AMX tiles (Intel Xeons from Sapphire Rapids: AMX-TILE
// and AMX-BF16): up to 5 rows cost about one row, each further 5 about half as much again, where
// cpu.cpp's FMAs grow by about an eighth of a one-row pass a row (the default target's layer
// linears on a 2-core Xeon: 1 / 5 / 10 / 15 rows 7.0 / 8.2 / 12.6 / 18.6 ms, the FMA kernels
// 6.9 at 1 row, 13.1 at 8). Every product is exact and the sums are fp32's, so it is fp32 with
// another summation order (as cpu.cpp's AVX2 and AVX-512 builds are to each other), not a
// lower precision:
//   - each fp32 activation splits exactly into three bf16 limbs, x = x1 + x2 + x3 (the top 8,
//     next 8 and last 8 bits of its 24-bit significand);
//   - a Q4_1 weight is d * q + m with q an integer 0..15, exact in bf16, so a tile product of a
//     limb and q is exact in fp32, and AMX sums the 32 products of a block in fp32;
//   - per output and block, S = (S3 + S2) + S1 (each limb's block sum), then out += d * S and
//     out += m * (the row's fp32 sum of the block), block after block in order.
// Row-invariant like cpu.cpp's kernels: a row's limbs, block sums and every output's sequence
// depend on that row alone, whatever the other rows, the tile it falls in or the thread.
//
// Tiles: up to 15 rows, a row's three limbs are three rows of one A tile, so a tile takes 5
// activation rows (15 of its 16 rows) and one TDPBF16PS per block and 16 outputs serves all of
// them (each such chunk then costs its tile store and the scaling of its rows, per block: what a
// further 5 rows add). 16 rows take a tile a limb (three TDPBF16PS serve 16 rows), so a pass
// takes 16 rows (8 requests verifying 2 tokens each, or 4 verifying 4) where three chunks took 15
// and a 16th row cost a second pass over the weights (the default target's layer linears, 16
// rows: 15.0-16.9 ms against 20.4-24.2 ms in passes of 15); more rows run in passes of 16. A
// row's limb sum is one TDPBF16PS from zero over the same 32 products either way, so its bits do
// not depend on the tile it falls in (tested). B is a block's q for 16 outputs in
// AMX's pair-interleaved layout, built from the repacked nibbles by one permute per 32 weights;
// the loop over output groups is software-pipelined (B of the next group built, and C of the
// previous one read back, while this group's product runs), since a tile load waits for the
// stores before it and a vector load for the tile store before it. (Limbs summed by AMX itself,
// three TDPBF16PS chained into one C, store a third of C but wait on the chain: 1 row 1.27x
// slower; and their bits would differ from the chunks'.)
//
// Packed layout (eagle_serve.cpu.quant.BlockWeight.amx): q [K/32, N/16, 256] uint8: for block b
// and output group g, byte 32 c + i holds (low nibble) the weight of output 16 g + i / 2 at
// k = 32 b + 2 c + i % 2 and (high nibble) the one at k = 32 b + 16 + 2 c + i % 2, c = 0..7: so
// the low nibbles of 32 bytes are B's row c and the high ones its row c + 8; scales [K/32, N/16,
// 2, 16] (d, m). Block-major, as the loop runs: a thread streams its groups of each block in
// order (group-major, the same loop read the weights ~1.3x slower from memory).
#include "cpu.h"

#include <ATen/Parallel.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#define EAGLE_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512dq")))

namespace {

constexpr int kChunk = 5;    // activation rows a tile takes, its limbs side by side (15 tile rows)
constexpr int kRows = 16;    // activation rows a pass takes (tiles: 3 A, 2 B, 3 C)
constexpr int kChunked = 15; // a pass of at most this many rows runs in chunks, 16 a tile a limb
constexpr int64_t kGroup = 16;

bool amx_usable() {  // the CPU has AMX-TILE, AMX-BF16 and AVX512-BW, and Linux lets us use it
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool cpu = (d >> 24 & 1) && (d >> 22 & 1) && (b >> 30 & 1) && (b >> 16 & 1) && (b >> 17 & 1);
  constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl: ask for the tile state
  return cpu && syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0, 1, 2: A (rows[t] rows each); 3, 7: B (ping, pong); 4, 5, 6: C of A 0, 1, 2
EAGLE_AMX void configure(const int* rows, int n) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  cfg.rows[3] = cfg.rows[7] = 16;
  for (int t = 0; t < 3; ++t) cfg.rows[t] = cfg.rows[4 + t] = t < n ? rows[t] : 3;
  asm volatile("" : : "r"(&cfg) : "memory");  // gcc drops the stores to cfg otherwise
  _tile_loadconfig(&cfg);
}

EAGLE_AMX void release() { _tile_release(); }

// B [16 rows of 32 bf16] of one group and block from its 256 packed bytes
EAGLE_AMX inline void unpack(const uint8_t* src, uint16_t* b, __m512i bf16_of) {
  for (int c = 0; c < 8; ++c) {
    const __m512i t = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * c)));
    _mm512_store_si512(b + 32 * c, _mm512_permutexvar_epi16(t, bf16_of));  // reads the low 5 bits
    _mm512_store_si512(b + 32 * (c + 8), _mm512_permutexvar_epi16(_mm512_srli_epi16(t, 4), bf16_of));
  }
}

// C of each A tile t = A x B from zero, stored to c + 256 t
template <int P>
EAGLE_AMX inline void products(const uint16_t* b, float* c, int n) {
  if constexpr (P == 0) {
    _tile_loadd(3, b, 64);
    _tile_zero(4); _tile_dpbf16ps(4, 0, 3); _tile_stored(4, c, 64);
    if (n > 1) { _tile_zero(5); _tile_dpbf16ps(5, 1, 3); _tile_stored(5, c + 256, 64); }
    if (n > 2) { _tile_zero(6); _tile_dpbf16ps(6, 2, 3); _tile_stored(6, c + 512, 64); }
  } else {
    _tile_loadd(7, b, 64);
    _tile_zero(4); _tile_dpbf16ps(4, 0, 7); _tile_stored(4, c, 64);
    if (n > 1) { _tile_zero(5); _tile_dpbf16ps(5, 1, 7); _tile_stored(5, c + 256, 64); }
    if (n > 2) { _tile_zero(6); _tile_dpbf16ps(6, 2, 7); _tile_stored(6, c + 512, 64); }
  }
}

// One pass of m rows. At most kChunked rows run in chunks of 5: chunk i's tile holds its rows'
// limbs 1, 2, 3 one after another (3 m_i tile rows), one TDPBF16PS a block and group for 5 rows.
// More rows (up to 16) take a tile a limb: three TDPBF16PS for 16 rows. Either way a row's limb
// sum is one TDPBF16PS from zero over the same 32 products, so its bits do not depend on the mode.
struct Pass {
  const uint16_t* a[3];  // A tile t: rows[t] tile rows [rows[t], K] bf16 from a[t]
  int rows[3], n;        // n A tiles
  int m;                 // activation rows (chunk i's from i * kChunk)
  const float* sums;     // [m, K / 32]: each row's fp32 block sums
  int64_t K;
};

// rows x [m, K] -> limbs [3 m, K] bf16 (limb-major) and their fp32 block sums [m, K / 32]
EAGLE_AMX void split(const float* x, int m, int64_t K, uint16_t* limbs, float* sums) {
  const __m512i top = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  for (int r = 0; r < m; ++r)
    for (int64_t k = 0; k < K; k += 16) {
      const __m512 v = _mm512_loadu_ps(x + r * K + k);
      const __m512 x1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), top));
      const __m512 rest = _mm512_sub_ps(v, x1);  // exact
      const __m512 x2 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(rest), top));
      const __m512 parts[3] = {x1, x2, _mm512_sub_ps(rest, x2)};  // the last exact and 8 bits wide
      for (int l = 0; l < 3; ++l)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(limbs + (l * m + r) * K + k),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(parts[l]), 16)));
      if (k % 32 == 16)
        sums[r * (K / 32) + k / 32] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(x + r * K + k - 16), v));
    }
}

// whether a pass of m rows takes a tile a limb (else chunks of 5)
constexpr bool tile_a_limb(int m) { return m > kChunked; }

// x [m, K] (m <= kRows) -> a pass, its limbs in limbs [3 m, K] and block sums in sums [m, K / 32]
EAGLE_AMX Pass plan(const float* x, int m, int64_t K, uint16_t* limbs, float* sums) {
  Pass p{};
  p.m = m, p.sums = sums, p.K = K;
  if (!tile_a_limb(m)) {
    for (int r0 = 0; r0 < m; r0 += kChunk, ++p.n) {
      const int rows = std::min(kChunk, m - r0);
      p.a[p.n] = limbs + 3 * r0 * K;
      p.rows[p.n] = 3 * rows;
      split(x + r0 * K, rows, K, limbs + 3 * r0 * K, sums + r0 * (K / 32));
    }
  } else {
    split(x, m, K, limbs, sums);
    p.n = 3;
    for (int l = 0; l < 3; ++l) {
      p.a[l] = limbs + l * m * K;
      p.rows[l] = m;
    }
  }
  return p;
}

// acc row j += d * S + m * (its block sum), S = (S3 + S2) + S1 its limb sums in c
EAGLE_AMX inline void add_row(const float* s1, const float* s2, const float* s3, __m512 d, __m512 m, float sum,
                              float* a) {
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_load_ps(s3), _mm512_load_ps(s2)), _mm512_load_ps(s1));
  _mm512_storeu_ps(a, _mm512_fmadd_ps(m, _mm512_set1_ps(sum), _mm512_fmadd_ps(d, s, _mm512_loadu_ps(a))));
}

// acc [m, 16] += d * S + m * (block sum), for one group and block
EAGLE_AMX inline void accumulate(const Pass& p, const float* c, const float* dm, int64_t b, float* acc) {
  const __m512 d = _mm512_loadu_ps(dm), m = _mm512_loadu_ps(dm + kGroup);
  const int64_t B = p.K / 32;
  if (tile_a_limb(p.m)) {
    for (int j = 0; j < p.m; ++j)
      add_row(c + 16 * j, c + 256 + 16 * j, c + 512 + 16 * j, d, m, p.sums[j * B + b], acc + 16 * j);
    return;
  }
  for (int i = 0; i < p.n; ++i) {
    const int rows = p.rows[i] / 3;
    for (int r = 0; r < rows; ++r) {
      const float* s = c + 256 * i + 16 * r;
      const int j = i * kChunk + r;
      add_row(s, s + 16 * rows, s + 32 * rows, d, m, p.sums[j * B + b], acc + 16 * j);
    }
  }
}

// groups g0 .. g1 of one pass -> out (row j of the pass at out + j * N)
EAGLE_AMX void run_pass(const Pass& p, const uint8_t* q, const float* scales, int64_t g0, int64_t g1,
                        float* out, int64_t N, float* acc) {
  const int64_t G = N / kGroup;
  alignas(64) uint16_t b[2][16 * 32];
  alignas(64) float c[2][3 * 256];
  alignas(64) uint16_t table[32];
  for (int j = 0; j < 32; ++j) {
    const float f = static_cast<float>(j & 15);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    table[j] = u >> 16;  // bf16(j & 15), exact
  }
  const __m512i bf16_of = _mm512_load_si512(table);
  const int64_t B = p.K / 32;
  std::fill(acc, acc + (g1 - g0) * kRows * 16, 0.0f);
  for (int64_t k = 0; k < B; ++k) {
    _tile_loadd(0, p.a[0] + 32 * k, 2 * p.K);
    if (p.n > 1) _tile_loadd(1, p.a[1] + 32 * k, 2 * p.K);
    if (p.n > 2) _tile_loadd(2, p.a[2] + 32 * k, 2 * p.K);
    auto wq = [&](int64_t g) { return q + (k * G + g) * 256; };
    auto dm = [&](int64_t g) { return scales + (k * G + g) * 32; };
    auto at = [&](int64_t g) { return acc + (g - g0) * kRows * 16; };
    unpack(wq(g0), b[0], bf16_of);
    for (int64_t g = g0; g < g1; g += 2) {  // ping: g, pong: g + 1
      if (g + 1 < g1) unpack(wq(g + 1), b[1], bf16_of);
      products<0>(b[0], c[0], p.n);
      if (g > g0) accumulate(p, c[1], dm(g - 1), k, at(g - 1));
      if (g + 1 == g1) {
        accumulate(p, c[0], dm(g), k, at(g));
        break;
      }
      if (g + 2 < g1) unpack(wq(g + 2), b[0], bf16_of);
      products<1>(b[1], c[1], p.n);
      accumulate(p, c[0], dm(g), k, at(g));
      if (g + 2 == g1) accumulate(p, c[1], dm(g + 1), k, at(g + 1));
    }
  }
  for (int64_t g = g0; g < g1; ++g)
    for (int j = 0; j < p.m; ++j)
      std::memcpy(out + j * N + g * kGroup, acc + ((g - g0) * kRows + j) * 16, kGroup * sizeof(float));
}

EAGLE_AMX void matmul(const float* x, int64_t R, int64_t K, const uint8_t* q, const float* scales,
                      int64_t N, float* out) {
  const int64_t passes = (R + kRows - 1) / kRows;
  const auto limbs = std::make_unique_for_overwrite<uint16_t[]>(3 * R * K);  // all written by split
  const auto sums = std::make_unique_for_overwrite<float[]>(R * (K / 32));
  std::vector<Pass> plans;
  plans.reserve(passes);
  for (int64_t r0 = 0; r0 < R; r0 += kRows)
    plans.push_back(plan(x + r0 * K, std::min<int64_t>(kRows, R - r0), K, limbs.get() + 3 * r0 * K,
                         sums.get() + r0 * (K / 32)));
  at::parallel_for(0, N / kGroup, 4, [&](int64_t g0, int64_t g1) {
    thread_local std::vector<float> acc;
    acc.resize(std::max<size_t>(acc.size(), (g1 - g0) * kRows * 16));
    for (int64_t i = 0; i < passes; ++i) {
      configure(plans[i].rows, plans[i].n);
      run_pass(plans[i], q, scales, g0, g1, out + i * kRows * N, N, acc.data());
    }
    release();
  });
}

}  // namespace

const bool kAmx = amx_usable();

// x [..., K] fp32; q [K/32, N/16, 256] uint8, scales [K/32, N/16, 2, 16] fp32 (the layout above);
// bias [N] or None -> [..., N]
at::Tensor linear_q4_1_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(kAmx, "linear_q4_1_amx: this CPU (or kernel) offers no AMX-BF16 tiles");
  const int64_t K = x.size(-1), N = q.size(1) * kGroup;
  TORCH_CHECK(x.scalar_type() == at::kFloat && q.scalar_type() == at::kByte &&
              scales.scalar_type() == at::kFloat && q.is_contiguous() && scales.is_contiguous() &&
              q.dim() == 3 && K % 32 == 0 && q.size(0) == K / 32 && q.size(2) == 256 &&
              scales.numel() == N / kGroup * (K / 32) * 32,
              "linear_q4_1_amx: x [..., K] fp32, q [K/32, N/16, 256] uint8, scales [K/32, N/16, 2, 16]");
  const auto rows = x.reshape({-1, K}).contiguous();
  const int64_t R = rows.size(0);
  auto out = x.new_empty({R, N});
  if (R) matmul(rows.data_ptr<float>(), R, K, q.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, out.data_ptr<float>());
  if (bias.has_value()) out.add_(*bias);
  auto shape = x.sizes().vec();
  shape.back() = N;
  return out.view(shape);
}

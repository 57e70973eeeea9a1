// The entry points of the CPU kernels' files (one extension, eagle_serve/kernels/cpu.py builds
// them; cpu_bind.cpp binds them).
#pragma once
#include <ATen/core/Tensor.h>  // the kernels call Tensor's methods only: see cpu_bind.cpp

#include <tuple>
#include <vector>

// built for AVX-512 (eagle_serve/kernels/cpu.py passes -mavx512f -mavx512dq on CPUs that have them)
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define EAGLE_AVX512 1
#endif

// the most rows for which linear_q4_1 / linear_q8_0 beat the dense `linear` (cpu.cpp's qlinear
// runs any number, in chunks of up to 12 rows on AVX-512 and of 7 on AVX2, each chunk rebuilding
// the weight; on AVX2 past 12 rows the dense weight is faster: the default target's linears at 16
// / 32 / 64 rows on the blocks 72.8 / 150 / 275 ms against 76.9 / 124 / 181, forward_bench.py
// --linears-only on a 2-core AMD EPYC)
#ifdef EAGLE_AVX512
constexpr int64_t kMaxBlockRows = INT64_MAX;
#else
constexpr int64_t kMaxBlockRows = 12;
#endif

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& scale, double eps);
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const c10::optional<at::Tensor>& bias);
at::Tensor linear_q4_1(const at::Tensor& x, const at::Tensor& q, const at::Tensor& dm,
                       const c10::optional<at::Tensor>& bias);
at::Tensor linear_q8_0(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d,
                       const c10::optional<at::Tensor>& bias);
extern const bool kI8Vnni;  // linear_i8 runs AVX512-VNNI here (else its AVX2 path)
at::Tensor linear_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias);
at::Tensor screen_i8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                     const at::Tensor& bound, int64_t max_kept);
extern const bool kAmx;  // linear_q4_1_amx runs here (AMX-BF16 tiles granted: cpu_amx.cpp)
at::Tensor linear_q4_1_amx(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales,
                           const c10::optional<at::Tensor>& bias);
at::Tensor rope_write_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping);
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& slots, const at::Tensor& starts, int64_t window,
                  double softcap);
std::vector<at::Tensor> decoder_stack(at::Tensor h, const at::Tensor& first_input,
                                      const std::vector<at::Tensor>& layers,
                                      const std::vector<int64_t>& windows, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& slot_mapping,
                                      const at::Tensor& slots, const at::Tensor& starts,
                                      int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                      double eps, double scale, double softcap,
                                      const std::vector<int64_t>& feature_layers);
at::Tensor keyed_uniforms(const at::Tensor& keys, int64_t n);
at::Tensor race(const at::Tensor& probs, const at::Tensor& keys);
// (match length, tokens, agreeing occurrences and occurrences of each step): cpu_lookup.cpp
using CorpusWalk = std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;
CorpusWalk corpus_walk(const at::Tensor& reverse, const at::Tensor& suffixes,
                       const std::vector<int64_t>& ctx, int64_t limit, double min_prob,
                       int64_t vote_cap);

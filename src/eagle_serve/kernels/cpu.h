// The entry points of the CPU kernels' files (one extension, eagle_serve/kernels/cpu.py builds
// them; cpu_bind.cpp binds them).
#pragma once
#include <torch/types.h>  // not torch/extension.h: see cpu_bind.cpp

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

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& scale, double eps);
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::optional<torch::Tensor>& bias);
torch::Tensor linear_q4_1(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& dm,
                          const c10::optional<torch::Tensor>& bias);
torch::Tensor linear_q8_0(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                          const c10::optional<torch::Tensor>& bias);
extern const bool kI8Vnni;  // linear_i8 runs AVX512-VNNI here (else its AVX2 path)
torch::Tensor linear_i8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                        const c10::optional<torch::Tensor>& bias);
torch::Tensor screen_i8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                        const torch::Tensor& bound, int64_t max_kept);
extern const bool kAmx;  // linear_q4_1_amx runs here (AMX-BF16 tiles granted: cpu_amx.cpp)
torch::Tensor linear_q4_1_amx(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scales,
                              const c10::optional<torch::Tensor>& bias);
torch::Tensor rope_write_kv(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& cos, const torch::Tensor& sin,
                            const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& slot_mapping);
torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& keys, const torch::Tensor& values,
                     const torch::Tensor& slots, const torch::Tensor& starts, int64_t window,
                     double softcap);
std::vector<torch::Tensor> decoder_stack(torch::Tensor h, const torch::Tensor& first_input,
                                         const std::vector<torch::Tensor>& layers,
                                         const std::vector<int64_t>& windows, const torch::Tensor& cos,
                                         const torch::Tensor& sin, const torch::Tensor& slot_mapping,
                                         const torch::Tensor& slots, const torch::Tensor& starts,
                                         int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                         double eps, double scale, double softcap,
                                         const std::vector<int64_t>& feature_layers);
torch::Tensor keyed_uniforms(const torch::Tensor& keys, int64_t n);
torch::Tensor race(const torch::Tensor& probs, const torch::Tensor& keys);
// (match length, tokens, agreeing occurrences and occurrences of each step): cpu_lookup.cpp
using CorpusWalk = std::tuple<int64_t, std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>>;
CorpusWalk corpus_walk(const torch::Tensor& reverse, const torch::Tensor& suffixes,
                       const std::vector<int64_t>& ctx, int64_t limit, double min_prob,
                       int64_t vote_cap);

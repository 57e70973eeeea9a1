// Keyed noise and the exponential race of eagle_serve/kernels/sampling.py's CPU paths, as sampling.py's
// torch form computes them, in one pass over the vocabulary instead of a dozen tensor ops (a
// race over SmolLM2's 49k tokens: ~0.15 ms here, ~0.9 ms through the tensor ops).
//
// Noise: SplitMix64's stream seeded with a key's 63-bit key_seed, u_i = ((z_i >> 11) + 0.5) / 2^53
// in (0, 1), z_i the stream's i-th output (counter-based: any i costs the same).
// Race: argmax over i with p_i > 0 of p_i / E_i, E_i = -log(u_i) ~ Exp(1), in float64, the
// first i on ties (torch.argmax's). E_i >= 1 - u_i, so p_i / E_i <= p_i / (1 - u_i): the log
// is taken only where that bound beats the best score so far, which leaves the argmax as is.
#include "cpu.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

namespace {

inline double keyed_u(uint64_t key, int64_t i) {
  uint64_t z = key + static_cast<uint64_t>(i + 1) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return (static_cast<double>(z >> 11) + 0.5) * 0x1.0p-53;
}

template <typename T>
int64_t race_row(const T* p, int64_t V, uint64_t key) {
  double best = -1.0;
  int64_t best_i = 0;
  for (int64_t i = 0; i < V; ++i) {
    const double pi = static_cast<double>(p[i]);
    if (!(pi > 0)) continue;
    const double u = keyed_u(key, i);
    if (best >= 0 && !(pi > best * (1.0 - u))) continue;  // cannot beat best (bound above)
    const double score = pi / -std::log(u);
    if (score > best) best = score, best_i = i;
  }
  return best_i;
}

}  // namespace

// keys [R] int64 -> [R, n] float64 uniforms of each key's stream
at::Tensor keyed_uniforms(const at::Tensor& keys, int64_t n) {
  TORCH_CHECK(keys.scalar_type() == at::kLong && keys.dim() == 1 && n >= 0, "keyed_uniforms: keys [R] int64");
  const auto k = keys.contiguous();
  auto out = k.new_empty({k.size(0), n}, at::kDouble);
  double* o = out.data_ptr<double>();
  for (int64_t r = 0; r < k.size(0); ++r)
    for (int64_t i = 0; i < n; ++i) o[r * n + i] = keyed_u(static_cast<uint64_t>(k.data_ptr<int64_t>()[r]), i);
  return out;
}

// probs [R, V] float32 or float64 (rows need not sum to 1), keys [R] int64 -> [R] int64 winners
at::Tensor race(const at::Tensor& probs, const at::Tensor& keys) {
  TORCH_CHECK(probs.dim() == 2 && keys.scalar_type() == at::kLong && keys.numel() == probs.size(0),
              "race: probs [R, V], keys [R] int64");
  TORCH_CHECK(probs.scalar_type() == at::kFloat || probs.scalar_type() == at::kDouble,
              "race: float32 or float64 probs");
  const auto p = probs.contiguous();
  const auto k = keys.contiguous();
  const int64_t R = p.size(0), V = p.size(1);
  auto out = k.new_empty({R});
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t* kp = k.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(p.scalar_type(), "race", [&] {
    const scalar_t* rows = p.data_ptr<scalar_t>();
    at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = race_row(rows + r * V, V, static_cast<uint64_t>(kp[r]));
    });
  });
  return out;
}

// A decoder's layer stack in one call (fp32, CPU): the same kernels of cpu.cpp, and the same
// ATen ops, in the same order as the Python loops over the layers (eagle_serve.models.target's,
// eagle_serve.models.heads'), so each output is bitwise that loop's, without PyTorch's Python dispatch
// per op (about half of a decode step of a 135M model on a 2-core CPU is spent there).
// Llama-like layers only: pre-norms, fused q/k/v and gate/up projections, SiLU-gated MLP, one
// RoPE table, no q/k norms (eagle_serve.models.cpu_stack checks the model and the batch before calling
// it); an EAGLE head's layers too, its first layer's attention input given.
#include "cpu.h"

#include <ATen/ops/silu_ops.h>  // at::silu's own call, without ATen/ops/silu.h's ~3 s of headers

namespace {

// a CpuLinear: {weight [N, K], q, scales, bias} (q, scales, bias empty where absent; q uint8:
// Q4_1, int8: Q8_0, 3-D: Q4_1 packed for AMX tiles, 4-D: packed for 8-bit activations), run as
// CpuLinear.forward runs it
at::Tensor run_linear(const at::Tensor& x, const at::Tensor* lin) {
  const auto& q = lin[1];
  const c10::optional<at::Tensor> bias =
      lin[3].numel() ? c10::optional<at::Tensor>(lin[3]) : c10::nullopt;
  if (q.dim() == 4) return ::linear_i8(x, q, lin[2], bias);  // packed for 8-bit activations
  if (q.dim() == 3) return ::linear_q4_1_amx(x, q, lin[2], bias);  // packed for AMX tiles
  if (q.numel() && x.numel() / x.size(-1) <= kMaxBlockRows)
    return q.scalar_type() == at::kByte ? ::linear_q4_1(x, q, lin[2], bias)
                                        : ::linear_q8_0(x, q, lin[2], bias);
  return ::linear(x, lin[0], bias);
}

}  // namespace

// h [T, H] the first layer's input; first_input: its attention input (an EAGLE head's, built
// from the embedding and the target's features), or empty: rms_norm(h) as in every other
// layer; per layer 20 tensors (`kPerLayer` below): input-norm scale (empty where first_input
// replaces it), post-attention-norm scale, k cache, v cache [num_slots, Hkv, D], then the
// q/k/v, output, gate/up and down linears (4 each, as run_linear); windows [L]; cos, sin
// [T, R]; slot_mapping [T]; slots, starts: each query's key slots (kernels.rowwise_attention's
// plan); feature_layers: the layers whose input is also returned -> {h after the last layer
// [T, H] (not normed), the inputs of feature_layers in order}
std::vector<at::Tensor> decoder_stack(at::Tensor h, const at::Tensor& first_input,
                                      const std::vector<at::Tensor>& layers,
                                      const std::vector<int64_t>& windows, const at::Tensor& cos,
                                      const at::Tensor& sin, const at::Tensor& slot_mapping,
                                      const at::Tensor& slots, const at::Tensor& starts,
                                      int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                                      double eps, double scale, double softcap,
                                      const std::vector<int64_t>& feature_layers) {
  constexpr size_t kPerLayer = 20;
  TORCH_CHECK(layers.size() == windows.size() * kPerLayer, "decoder_stack: 20 tensors a layer");
  const int64_t T = h.size(0), q_width = q_heads * head_dim, kv_width = kv_heads * head_dim;
  std::vector<at::Tensor> out(1);
  for (size_t i = 0; i < windows.size(); ++i) {
    const at::Tensor* t = layers.data() + i * kPerLayer;
    for (int64_t f : feature_layers)
      if (f == static_cast<int64_t>(i)) out.push_back(h);
    const bool given = i == 0 && first_input.numel();  // an EAGLE head's first layer
    const auto qkv = run_linear(given ? first_input : ::rms_norm(h, t[0], eps), t + 4);  // [T, q + 2 kv]
    const auto parts = qkv.split_with_sizes({q_width, kv_width, kv_width}, -1);
    const auto q = parts[0].reshape({T, q_heads, head_dim});
    const auto k = parts[1].reshape({T, kv_heads, head_dim});
    const auto v = parts[2].reshape({T, kv_heads, head_dim});
    const auto rotated = ::rope_write_kv(q, k, v, cos, sin, t[2], t[3], slot_mapping);
    const auto q32 = rotated.mul(scale).contiguous();  // rowwise_attention: q.float() * scale
    const auto a = ::attend(q32, t[2], t[3], slots, starts, windows[i], softcap).reshape({T, -1});
    h = h.add(run_linear(a, t + 8));
    const auto gate_up = run_linear(::rms_norm(h, t[1], eps), t + 12).chunk(2, -1);  // [T, I] each
    h = h.add(run_linear(at::_ops::silu::call(gate_up[0]).mul(gate_up[1]), t + 16));
  }
  out[0] = h;
  return out;
}

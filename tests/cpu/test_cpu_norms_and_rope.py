"""eagle_serve/kernels/cpu.cpp's RMSNorm and RoPE + KV write: HF's arithmetic (the norm within fp32 rounding,
RoPE bitwise), every row on its own, and wired into the fp32 CPU target and drafter only."""
from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from eagle_serve.cpu.norm import CpuRMSNorm
from eagle_serve.kernels.cpu import cpu_kernels, rope_write_kv, rope_write_kv_fits
from eagle_serve.kernels.layer_ops import apply_rope
from eagle_serve.kernels.paged_attention import write_kv_ref
from eagle_serve.models.checkpoints import load_drafter
from eagle_serve.models.target import TargetModel

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="eagle_serve/kernels/cpu.cpp needs AVX2, FMA and a compiler")


@needs_kernels
@pytest.mark.parametrize("hf_norm,plus_one", [(LlamaRMSNorm, False), (Gemma2RMSNorm, True)],
                         ids=["llama", "gemma"])
def test_the_cpu_rms_norm_computes_hf_norms_and_gives_a_row_the_same_bits_in_any_batch(hf_norm, plus_one):
    torch.manual_seed(0)
    hf = hf_norm(576, eps=1e-5)
    with torch.no_grad():
        hf.weight.normal_()
    norm = CpuRMSNorm(hf, plus_one)
    x = torch.randn(20, 576) * 3
    with torch.inference_mode():
        alone = torch.cat([norm(x[r:r + 1]) for r in range(20)])
        for rows in range(2, 21):
            assert torch.equal(norm(x[:rows]), alone[:rows]), f"{rows} rows"
        torch.testing.assert_close(alone, hf(x), rtol=1e-5, atol=1e-5)
        assert torch.equal(norm(x.view(4, 5, 576)), alone.view(4, 5, 576))  # [..., H]
        assert torch.equal(norm(x.double()), hf(x.double()))  # float64: HF's own module


@needs_kernels
def test_a_cpu_norm_keeps_hf_gradients_when_training():
    hf = LlamaRMSNorm(64, eps=1e-6)
    norm = CpuRMSNorm(hf, plus_one=False)
    x = torch.randn(3, 64)
    norm(x).sum().backward()  # the weight needs its gradient: HF's module runs
    assert hf.weight.grad is not None and norm.weight is hf.weight


@needs_kernels
@pytest.mark.parametrize("rotary", [64, 32], ids=["full", "partial"])
def test_rope_and_the_kv_write_in_one_call_equal_apply_rope_then_write_kv_bitwise(rotary):
    torch.manual_seed(0)
    T, Hq, Hkv, D = 5, 9, 3, 64
    qkv = torch.randn(T, (Hq + 2 * Hkv) * D)  # q, k, v as views of one projection, as the target's
    q, k, v = (t.reshape(T, -1, D) for t in qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1))
    cos, sin = torch.randn(T, rotary), torch.randn(T, rotary)
    slots = torch.tensor([3, -1, 17, 0, 40])  # -1: a padding row, not written
    expected_caches = [torch.randn(4, 16, Hkv, D) for _ in range(2)]
    caches = [c.clone() for c in expected_caches]
    assert rope_write_kv_fits(q, caches[0], cos)
    q_ref, k_ref = apply_rope(q, k, cos, sin)
    write_kv_ref(k_ref, v, *expected_caches, slots)
    assert torch.equal(rope_write_kv(q, k, v, cos, sin, *caches, slots), q_ref)
    assert all(torch.equal(c, e) for c, e in zip(caches, expected_caches))
    assert not rope_write_kv_fits(q.double(), caches[0].double(), cos.double())


@needs_kernels
def test_the_fp32_cpu_target_and_drafter_norm_through_the_kernel_with_their_state_dicts_unchanged(tiny_target, eagle3_head):
    target = TargetModel(tiny_target, dtype=torch.float32, num_pages=8, page_size=4)
    drafter = load_drafter(eagle3_head, tiny_target, dtype=torch.float32, num_pages=8, page_size=4)
    for model in (target.hf, drafter.head):
        kinds = {type(m).__name__ for m in model.modules()}
        assert "CpuRMSNorm" in kinds and not any(k.endswith("RMSNorm") and k != "CpuRMSNorm" for k in kinds)
    assert "model.norm.weight" in target.hf.state_dict()
    assert not any(".hf." in key for key in target.hf.state_dict())

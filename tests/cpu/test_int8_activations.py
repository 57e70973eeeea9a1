"""Linears on 8-bit activations (eagle_serve/kernels/cpu_i8.cpp, llama.cpp's arithmetic; AVX512-VNNI or
AVX2, whichever this build runs: tests/cpu/test_cpu_quant.py runs this file on the AVX2 build
too): each output is the exact integer sum of each block, scaled, whatever the other rows and
threads, so verification still reproduces decoding; the drafter runs them by default, the target
where asked."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.core.requests import SamplingParams
from eagle_serve.cpu.matmul import CpuLinear
from eagle_serve.cpu.quant import block_form, int8_activations_run
from eagle_serve.testing import assert_drafts_verify_to_plain, gguf_weight, other_thread_count, q8_0_target, tiny_engine

pytestmark = pytest.mark.skipif(not int8_activations_run(),
                                reason="8-bit activations run on the CPU kernels (AVX2, FMA)")


def reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [R, K] rounded to 8 bits per block of 32 as the kernel rounds it (fp32: max |x| / 127,
    round half to even), then the exact product in float64 -> [R, N]"""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    qa = torch.where(amax > 0, blocks * (127 / amax), 0).round()
    return (qa.double() * (amax / 127).double()).reshape(x.shape) @ weight.double().T


@pytest.mark.parametrize("kind,shape", [("q4_1", (96, 64)), ("q4_1", (48, 160)), ("q8_0", (64, 96))])
def test_a_linear_on_8_bit_activations_sums_each_block_exactly_for_any_rows_and_threads(kind, shape):
    weight = gguf_weight(kind, *shape)
    blocks = block_form(weight).int8_activations()
    assert blocks.kind == kind + "_a8"
    x = torch.randn(13, shape[1], generator=torch.Generator().manual_seed(1))
    x[2, :32] = 0  # an all-zero block
    out = blocks.linear(x, None)
    ref = reference(x, weight)
    assert ((out.double() - ref).abs() <= 1e-5 * ref.abs().amax() + 1e-6).all()
    rows = torch.cat([blocks.linear(x[i:i + 1], None) for i in range(len(x))])
    with other_thread_count():
        other_threads = blocks.linear(x, None)
    assert torch.equal(rows, out) and torch.equal(other_threads, out)
    bias = torch.randn(shape[0])
    assert torch.equal(blocks.linear(x, bias), out + bias)


def test_a_weight_with_outputs_not_a_multiple_of_16_is_refused_for_8_bit_activations():
    with pytest.raises(ValueError, match="multiple of 16"):
        block_form(gguf_weight("q8_0", 40, 64)).int8_activations()


def test_a_target_on_8_bit_activations_verifies_to_exactly_its_own_plain_decoding(tiny_target, eagle3_head,
                                                                                  prompts, tmp_path):
    """Greedy chains and trees give what the same int8 target decodes alone (its outputs differ
    from the fp32 forward's: another arithmetic), and a seeded sampled request the same tokens
    alone as beside others."""
    target = q8_0_target(tiny_target, tmp_path / "q8")
    engine = tiny_engine(target, eagle3_head, dtype="float32", target_activations="int8")
    linears = [m for m in engine.target.cpu_linears() if m.blocks is not None]
    assert linears and all(m.blocks.kind == "q8_0_a8" for m in linears)
    assert_drafts_verify_to_plain(engine, prompts)
    sampled = SamplingParams(max_tokens=16, num_speculative_tokens=3, temperature=0.8, seed=11)
    together = [r.token_ids for r in engine.generate(prompts, sampled)]
    assert [engine.generate([p], sampled)[0].token_ids for p in prompts[:3]] == together[:3]


def test_int8_target_activations_are_refused_for_a_target_without_block_weights(tiny_target):
    with pytest.raises(ValueError, match="holds no GGUF block weights"):
        tiny_engine(tiny_target, dtype="float32", target_activations="int8")
    with pytest.raises(ValueError, match="target activations must be one of"):
        tiny_engine(tiny_target, dtype="float32", target_activations="int4")


def test_the_drafter_runs_its_q8_0_linears_on_8_bit_activations_by_default(tiny_target, eagle3_head):
    engine = tiny_engine(tiny_target, eagle3_head, dtype="float32")
    linears = [m for m in engine.drafter.head.modules() if isinstance(m, CpuLinear)]
    assert linears and all(m.blocks.kind == ("q8_0_a8" if m.out_features % 16 == 0 else "q8_0")
                           for m in linears)

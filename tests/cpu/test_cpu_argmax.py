"""Greedy tokens from a block-quantized LM head screened on 8-bit activations (eagle_serve.cpu.argmax):
every logit within a proven bound of its fp32 value, the fp32 logits of the tokens that may be
the largest, and so the full head's argmax bit for bit, ties to the lowest id."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.core.requests import SamplingParams
from eagle_serve.cpu.argmax import ScreenedArgmax, screenable
from eagle_serve.cpu.matmul import CpuLinear
from eagle_serve.cpu.quant import int8_activations_run
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.testing import gguf_weight, q8_0_target, tiny_engine

pytestmark = pytest.mark.skipif(not int8_activations_run(),
                                reason="the screen runs on the 8-bit kernels (AVX2, FMA)")


def head(weight: torch.Tensor) -> CpuLinear:
    linear = CpuLinear(torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False))
    with torch.no_grad():
        linear.weight.copy_(weight)
    linear.find_blocks()
    return linear


def one_step_apart(block: torch.Tensor, j: int, kind: str) -> torch.Tensor:
    """Weight j of a gguf_weight block with its q one step away, computed as the dequantizer
    does (its first weight holds q = 127 (Q8_0) or 0 (Q4_1), its second q = 15 (Q4_1))."""
    if kind == "q8_0":
        d, m = block[0] / 127, torch.tensor(0.0)
        q = torch.round(block[j] / d)
        return d * (q - 1 if q > -127 else q + 1)
    m = block[0]
    d = ((block[1] - m) / 15).half().float()  # d is an fp16 value
    q = torch.round((block[j] - m) / d)
    return d * (q - 1 if q > 0 else q + 1) + m


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("kind", ["q8_0", "q4_1"])
def test_the_screened_argmax_is_the_full_heads_for_any_rows_with_near_ties_and_exact_ties(kind, fused):
    """(fused: the kept tokens from cpu_i8.cpp's screen_i8; else ScreenedArgmax.kept)"""
    weight = gguf_weight(kind, 512, 128, seed=3)
    # near ties: row 7 is row 5 with one weight a quantization step apart; exact ties: row 300 is row 9
    weight[7], weight[300] = weight[5], weight[9]
    weight[7, 40] = one_step_apart(weight[5, 32:64], 8, kind)
    lm = head(weight)
    screen = ScreenedArgmax(lm)
    screen.fused = fused
    g = torch.Generator().manual_seed(4)
    x = torch.randn(64, 128, generator=g)
    x[:, 3] *= 30  # an outlier feature, as a final norm's output has
    x[1, :32] = 0  # an all-zero block
    # rows whose argmax is row 5 / 7 (near tie) or row 9 / 300 (exact tie: the lower id wins)
    centre = weight.mean(0)
    x[10:20] = (weight[5] - centre) * 50 + torch.randn(10, 128, generator=g) * 1e-3
    x[20:30] = (weight[9] - centre) * 50 + torch.randn(10, 128, generator=g) * 1e-3
    full = lm(x).argmax(-1)
    assert set(full[10:20].tolist()) <= {5, 7} and set(full[20:30].tolist()) == {9}
    for rows in (1, 2, 3, 5, 8):
        got = torch.cat([screen(part) for part in x.split(rows)])
        assert torch.equal(got, full)


def test_the_fused_screen_keeps_the_tokens_its_pytorch_reference_keeps():
    lm = head(gguf_weight("q8_0", 4096, 576, seed=7))
    screen = ScreenedArgmax(lm)
    g = torch.Generator().manual_seed(8)
    for rows in (1, 3, 8):
        x = torch.randn(rows, 576, generator=g) * 2
        x[:, 5] *= 40
        kept = cpu_kernels().screen_i8(x, screen.approx.q, screen.approx.scales, screen.packed_bound, 4096)
        assert torch.equal(kept, screen.kept(x))
        assert set(lm(x).argmax(-1).tolist()) <= set(kept.tolist())
    x[0, 0] = float("nan")
    assert cpu_kernels().screen_i8(x, screen.approx.q, screen.approx.scales, screen.packed_bound, 4096).numel() == 0
    assert cpu_kernels().screen_i8(x[1:], screen.approx.q, screen.approx.scales, screen.packed_bound, 1).numel() == 0


def test_a_head_with_a_bias_or_without_exact_blocks_is_not_screened():
    weight = gguf_weight("q8_0", 64, 64)
    assert screenable(head(weight))
    assert not screenable(head(weight + 1e-3 * torch.randn(64, 64)))  # no exact Q8_0 form
    biased = CpuLinear(torch.nn.Linear(64, 64))
    biased.find_blocks()
    assert not screenable(biased)


def test_a_q8_0_target_decodes_and_verifies_the_same_tokens_screened_as_from_every_logit(
        tiny_target, eagle3_head, prompts, tmp_path):
    """The screen serves the greedy rows (sampled rows and min_tokens bans keep every logit);
    plain decoding and verified chains and trees give the same tokens with it as without."""
    engine = tiny_engine(q8_0_target(tiny_target, tmp_path / "q8"), eagle3_head, dtype="float32")
    assert engine.target.screen is not None
    calls = 0
    screen = engine.target.screen

    def counted(final):
        nonlocal calls
        calls += 1
        return screen(final)

    shapes = (dict(num_speculative_tokens=0), dict(num_speculative_tokens=3),
              dict(num_speculative_tokens=6, draft_topk=2, draft_depth=3), dict(min_tokens=12))
    engine.target.screen = counted
    screened = [[r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=16, **s))]
                for s in shapes]
    assert calls > 0
    engine.target.screen = None
    assert screened == [[r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=16, **s))]
                        for s in shapes]


def test_flat_logits_fall_back_to_every_logit_and_a_run_of_them_skips_the_screen_for_a_while():
    lm = head(gguf_weight("q8_0", 2048, 64, seed=5))
    screen = ScreenedArgmax(lm)
    flat = torch.zeros(2, 64)  # every logit 0: every token may be the largest
    sharp = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)) * 4
    for _ in range(8):
        assert torch.equal(screen(flat), torch.zeros(2, dtype=torch.int64))
    assert screen.skip > 0  # most recent calls kept too many
    skipped = screen.skip
    assert torch.equal(screen(sharp), lm(sharp).argmax(-1)) and screen.skip == skipped - 1

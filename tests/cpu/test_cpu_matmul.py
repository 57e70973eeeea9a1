"""CPU linears (oneDNN inner products, the fp32 row kernel) compute what nn.Linear computes."""
from __future__ import annotations

import shutil

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.cpp_extension import is_ninja_available

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.cpu.matmul import CpuLinear, fuse_linears, onednn_bf16
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.machine import cpu_flags
from eagle_serve.models.checkpoints import load_drafter
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import other_thread_count


@pytest.mark.skipif(not ({"avx2", "fma"} <= cpu_flags() and shutil.which("c++") and is_ninja_available()),
                    reason="the kernels build only on CPUs with AVX2 and FMA, with a C++ compiler and ninja")
def test_the_cpu_kernels_build_wherever_the_cpu_and_the_toolchain_can():
    """A kernel that does not compile fails here, where elsewhere it only turns into PyTorch paths
    (a warning) and the kernels' tests into skips."""
    assert cpu_kernels() is not None


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("width", [24, 20])  # fp32: the row kernel takes 24 (a multiple of 8), oneDNN 20
def test_a_cpu_linear_matches_nn_linear_for_zero_to_nine_rows(dtype, tol, bias, width):
    torch.manual_seed(0)
    linear = nn.Linear(width, 40, bias=bias).to(dtype)
    ours = CpuLinear(linear)
    with torch.inference_mode():
        for rows in range(0, 10):
            x = torch.randn(rows, width, dtype=dtype)
            out = ours(x)
            assert out.shape == (rows, 40) and out.dtype == dtype
            torch.testing.assert_close(out, linear(x), rtol=tol, atol=tol)
        x = torch.randn(2, 3, width, dtype=dtype)  # leading dims are kept
        torch.testing.assert_close(ours(x), linear(x), rtol=tol, atol=tol)
    assert torch.equal(ours.weight, linear.weight)
    assert ours.onednn == (dtype == torch.float32)
    assert ours.cpu_kernel == (dtype == torch.float32 and width == 24 and cpu_kernels() is not None)
    assert ours.weight.data_ptr() == linear.weight.data_ptr()  # no copy


@pytest.mark.skipif(cpu_kernels() is None, reason="the fp32 row kernel needs AVX2 and FMA")
@pytest.mark.parametrize("width,parts", [(576, (576, 192, 192)), (576, (1536, 1536)), (1536, (576,)),
                                         (576, (49152,)), (40, (40, 8, 8)), (8, (3,))])
def test_the_fp32_row_kernel_gives_a_row_the_same_bits_in_any_batch_and_on_any_thread_count(width, parts):
    """What fp32 verify == decode rests on, for SmolLM2's GEMM shapes (fused q/k/v and gate/up,
    down projection, LM head) and tiny ones: row r alone, and among 2 .. 20 rows, on 1 or 2
    threads, equal bitwise; and within fp32 rounding of the float64 product."""
    torch.manual_seed(0)
    fused = fuse_linears([CpuLinear(nn.Linear(width, w)) for w in parts])
    assert fused.cpu_kernel
    x = torch.randn(20, width)
    with torch.inference_mode():
        alone = torch.cat([fused(x[r:r + 1]) for r in range(20)])
        for rows in range(2, 21):
            assert torch.equal(fused(x[:rows]), alone[:rows]), f"{rows} rows"
        with other_thread_count():
            assert torch.equal(fused(x), alone)
    expected = x.double() @ fused.weight.double().T + fused.bias.double()
    torch.testing.assert_close(alone.double(), expected, rtol=1e-5, atol=1e-5)


def test_the_cpu_target_and_drafter_run_cpu_linears_only(tiny_target, eagle3_head):
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=8, page_size=4)
    drafter = load_drafter(eagle3_head, tiny_target, dtype=torch.float64, num_pages=8, page_size=4)
    for model in (target.hf, drafter.head):
        kinds = {type(m) for m in model.modules()}
        assert nn.Linear not in kinds and CpuLinear in kinds
    assert target.lm_head.weight.shape == (target.vocab_size, target.config.hidden_size)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_linears_compute_their_parts_side_by_side_and_share_their_weights(bias):
    torch.manual_seed(0)
    parts = [CpuLinear(nn.Linear(24, out, bias=bias).to(torch.float64)) for out in (40, 8, 8)]
    x = torch.randn(5, 24, dtype=torch.float64)
    with torch.inference_mode():
        expected = torch.cat([p(x) for p in parts], dim=-1)
        fused = fuse_linears(parts)
        assert isinstance(fused, CpuLinear) and fused.out_features == 56
        torch.testing.assert_close(fused(x), expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(torch.cat([p(x) for p in parts], dim=-1), expected, rtol=0, atol=0)
    assert parts[1].weight.data_ptr() == fused.weight.data_ptr() + 40 * 24 * 8  # a view, no copy
    with pytest.raises(ValueError, match="all or no biases"):
        fuse_linears([CpuLinear(nn.Linear(4, 4)), CpuLinear(nn.Linear(4, 4, bias=False))])


@pytest.mark.skipif(not onednn_bf16(), reason="needs oneDNN bf16 inner products (AVX512)")
@pytest.mark.parametrize("width,parts", [(576, (576, 192, 192)), (576, (1536, 1536)), (1536, (576,)),
                                         (40, (40, 8, 8))])
def test_a_fused_bf16_linear_gives_a_row_the_same_bits_in_any_batch(width, parts):
    """What the bitwise verify == decode guarantee rests on, for the GEMM shapes (SmolLM2's fused
    q/k/v and gate/up, its down projection, and a tiny model's), through oneDNN's packed weights:
    row r alone, and among 2 .. 20 rows, equal bitwise."""
    torch.manual_seed(0)
    fused = fuse_linears([CpuLinear(nn.Linear(width, w, bias=False).to(torch.bfloat16)) for w in parts])
    x = torch.randn(20, width, dtype=torch.bfloat16)
    with torch.inference_mode():
        alone = torch.cat([fused(x[r:r + 1]) for r in range(20)])
        for rows in range(2, 21):
            assert torch.equal(fused(x[:rows]), alone[:rows]), f"{rows} rows"


@pytest.mark.parametrize("dtype", [
    torch.float32,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        not onednn_bf16(), reason="needs oneDNN bf16 inner products (AVX512)"))])
def test_a_linear_packs_its_weight_once_on_first_use_and_computes_what_the_dense_weight_does(dtype):
    """bf16: the same bits; fp32 (another summation order): the same up to rounding. (fp32 with
    AVX2 runs the row kernel, which reads the dense weight: here it is turned off.)"""
    torch.manual_seed(0)
    dense = nn.Linear(64, 96).to(dtype)
    linear = CpuLinear(dense)
    linear.cpu_kernel = False
    assert linear._packed is None  # fused parts that never run are never packed
    x = torch.randn(9, 64, dtype=dtype)
    with torch.inference_mode():
        out = linear(x)
        packed = linear._packed
        assert packed is not None and packed.layout == torch._mkldnn
        expected = torch.ops.mkldnn._linear_pointwise(x, dense.weight, dense.bias, "none", [], "")
        if dtype == torch.bfloat16:
            assert torch.equal(out, expected)
        else:
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        linear(x[:3])
    assert linear._packed is packed
    assert torch.equal(linear.weight, dense.weight)  # the dense weight stays for tied embeddings


def test_a_target_forward_runs_four_linears_per_layer_and_the_lm_head(tiny_target):
    """q/k/v fused, o, gate/up fused, down (float64 linears are aten::linear calls)."""
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=8, page_size=4)
    pool, table = PagePool(8, 4), []
    pool.grow(table, 3)
    batch = RaggedBatch(torch.tensor([5, 6, 7]), torch.arange(3), torch.tensor([0, 3]), torch.tensor([3]),
                        torch.tensor([table]), torch.tensor([pool.slot(table, p) for p in range(3)]))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        target.logits(batch, torch.tensor([2]))
    calls = {e.key: e.count for e in prof.key_averages()}
    assert calls["aten::linear"] == 4 * target.num_layers + 1


@pytest.mark.skipif(not onednn_bf16(), reason="needs oneDNN bf16 inner products (AVX512)")
def test_a_single_bf16_row_gets_its_two_row_bits_in_and_out_of_inference_mode():
    """The padded single row runs through a reused buffer: it must not keep an old row's values
    or refuse writes in either mode."""
    torch.manual_seed(0)
    linear = CpuLinear(nn.Linear(48, 24).to(torch.bfloat16))
    x = torch.randn(3, 48, dtype=torch.bfloat16)
    with torch.inference_mode():
        pair = linear(x[:2])
        first = linear(x[:1])
    with torch.no_grad():
        second = linear(x[1])
    assert torch.equal(first, pair[:1]) and torch.equal(second, pair[1])
    assert torch.equal(linear(x[:1]), pair[:1])

"""The fused layer kernels (eagle_serve.kernels.layer_ops, under TRITON_INTERPRET=1 on CPU)
against their references, at sizes that are not powers of two, on strided inputs (views of
the fused projections), with skipped KV slots and partial rotary; and each row's result
independent of the rows beside it.

The interpreter rounds float32 to bfloat16 by truncation where a GPU rounds to nearest, so
bfloat16 is checked within a few bfloat16 steps here (one per rounding) (gpu_check compares bitwise on the GPU);
float32 results are bitwise wherever the arithmetic is elementwise."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.kernels import layer_ops as ops

BF16_STEPS = 3 * 2 ** -7  # relative: a bfloat16 rounding step per rounding (up to 3)


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def close(a: torch.Tensor, b: torch.Tensor, dtype) -> bool:
    if dtype == torch.float32:
        return torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    return bool(((a.float() - b.float()).abs() <= BF16_STEPS * b.float().abs() + 1e-2).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_matches_its_reference(dtype, with_residual):
    wide = randn(5, 200, dtype=dtype)
    x = wide[:, 30:102]  # [5, 72]: rows 200 apart
    residual = randn(5, 72, seed=1, dtype=dtype) if with_residual else None
    weight = randn(72, seed=2, dtype=dtype)
    out, total = ops.add_rms_norm_triton(x, residual, weight, 1e-5)
    ref_out, ref_total = ops.add_rms_norm_ref(x, residual, weight, 1e-5)
    assert close(out, ref_out, dtype)
    if dtype == torch.float32:  # the add is elementwise: bitwise
        assert torch.equal(total, ref_total)


@pytest.mark.parametrize("kernel", ["add_rms_norm", "silu_mul"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel):
    rows = randn(37, 2 * 1100 if kernel == "silu_mul" else 576, dtype=torch.bfloat16)
    if kernel == "silu_mul":
        run = ops.silu_mul_triton
    else:
        weight, residual = randn(576, seed=3, dtype=torch.bfloat16), randn(37, 576, seed=4, dtype=torch.bfloat16)
        def run(x):
            return ops.add_rms_norm_triton(x, residual[:x.shape[0]], weight, 1e-6)[0]
    assert torch.equal(run(rows[:1]), run(rows)[:1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_its_reference(dtype):
    gate_up = randn(3, 2 * 1100, dtype=dtype)  # more columns than one program covers
    assert close(ops.silu_mul_triton(gate_up), ops.silu_mul_ref(gate_up), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rotary", [40, 24])  # full, and partial rotary (Phi-3's kind)
def test_rope_and_the_kv_write_match_their_reference(dtype, rotary):
    tokens, q_heads, kv_heads, head_dim = 4, 6, 2, 40
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * head_dim, dtype=dtype)  # the fused projection
    q, k, v = (t.reshape(tokens, -1, head_dim)
               for t in qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1))
    cos, sin = randn(tokens, rotary, seed=1, dtype=dtype), randn(tokens, rotary, seed=2, dtype=dtype)
    slots = torch.tensor([3, -1, 7, 14])  # the second token is skipped
    caches = [torch.zeros(3, 5, kv_heads, head_dim, dtype=dtype) for _ in range(4)]
    out = ops.rope_write_kv_triton(q, k, v, cos, sin, caches[0], caches[1], slots)
    ref = ops.rope_write_kv_ref(q, k, v, cos, sin, caches[2], caches[3], slots)
    assert out.is_contiguous() and out.shape == (tokens, q_heads, head_dim)
    assert torch.equal(caches[1], caches[3])  # v is copied
    if dtype == torch.float32:
        assert torch.equal(out, ref) and torch.equal(caches[0], caches[2])
    else:
        assert close(out, ref, dtype) and close(caches[0], caches[2], dtype)


def test_float64_and_cpu_tensors_take_the_references():
    x = randn(2, 8, dtype=torch.float64)
    assert not ops.fused_layers_run(x) and not ops.fused_layers_run(x, impl="triton")
    assert not ops.fused_layers_run(x.float()) and ops.fused_layers_run(x.float(), impl="triton")

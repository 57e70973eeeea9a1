"""Q4_1 linears on AMX tiles (eagle_serve/kernels/cpu_amx.cpp, on CPUs with AMX-BF16): fp32 with exact
products in another summation order, each output computed alike whatever the other rows and
threads, so verification still reproduces decoding; on by default where the CPU has the tiles."""
from __future__ import annotations

import pytest
import torch

from eagle_serve import paths
from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.cpu.quant import block_form
from eagle_serve.kernels.cpu import amx_tiles
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import (
    assert_drafts_verify_to_plain,
    gguf_weight,
    other_thread_count,
    q8_0_target,
    round_to_q4_1,
    tiny_engine,
)

pytestmark = pytest.mark.skipif(not amx_tiles(), reason="AMX tiles: a CPU with AMX-BF16 (e.g. Xeon Sapphire Rapids)")


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (48, 64), (16, 32)])
def test_a_q4_1_linear_on_amx_tiles_is_fp32_grade_and_the_same_for_any_rows_and_threads(shape):
    weight = gguf_weight("q4_1", *shape, seed=3)
    tiles = block_form(weight).amx()
    assert tiles.kind == "q4_1_amx" and tiles.runs(1000)
    x = torch.randn(37, shape[1], generator=torch.Generator().manual_seed(2))
    x[4, :32] = 0  # an all-zero block
    x[5, 7] = 1e-30  # limbs below bf16's normal range
    bias = torch.randn(shape[0])
    out = tiles.linear(x, bias)
    exact = x.double() @ weight.double().T + bias.double()
    scale = x.double().abs() @ weight.double().abs().T + bias.double().abs()
    assert ((out.double() - exact).abs() <= 4e-7 * scale).all()  # fp32 rounding, not bf16's
    alone = torch.cat([tiles.linear(x[r:r + 1], bias) for r in range(len(x))])
    for rows in range(0, len(x) + 1):  # 1 .. 15 rows in chunks of 5, 16 a tile a limb, more in passes
        assert torch.equal(tiles.linear(x[:rows], bias), alone[:rows]), f"{rows} rows"
    with other_thread_count():
        assert torch.equal(tiles.linear(x, bias), alone)
    assert torch.equal(alone, out)


def test_amx_tiles_take_q4_1_weights_of_a_multiple_of_16_outputs_only():
    with pytest.raises(ValueError, match="multiple of 16"):
        block_form(gguf_weight("q4_1", 40, 64)).amx()
    with pytest.raises(ValueError, match="Q4_1"):
        block_form(gguf_weight("q8_0", 64, 64)).amx()


def test_amx_tiles_are_off_where_the_environment_says_so(monkeypatch):
    monkeypatch.setenv("EAGLE_CPU_AMX", "0")
    assert not amx_tiles()


def test_a_q4_1_target_on_amx_tiles_verifies_to_exactly_its_own_plain_decoding(tiny_target, eagle3_head,
                                                                              prompts, tmp_path):
    target = q8_0_target(tiny_target, tmp_path / "q4", rounding=round_to_q4_1)
    engine = tiny_engine(target, eagle3_head, dtype="float32")
    layers = [m for m in engine.target.cpu_linears() if m.blocks is not None and m is not engine.target.lm_head]
    assert layers and all(m.blocks.kind == "q4_1_amx" for m in layers)
    assert_drafts_verify_to_plain(engine, prompts)


def test_the_default_target_runs_its_layers_on_amx_tiles_close_to_the_fma_kernels(monkeypatch):
    if not (paths.default_target_dir() / "config.json").exists():
        pytest.skip("default model not converted (run make setup)")
    tiles = TargetModel(paths.default_target_dir(), num_pages=16, page_size=16)
    monkeypatch.setenv("EAGLE_CPU_AMX", "0")
    fma = TargetModel(paths.default_target_dir(), num_pages=16, page_size=16)
    layers = [m for p, layer in zip(tiles.layers, tiles.hf.model.layers)
              for m in (p.qkv, p.gate_up, layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert {m.blocks.kind for m in layers} == {"q4_1_amx"} and tiles.lm_head.blocks.kind == "q8_0"
    assert fma.layers[0].qkv.blocks.kind == "q4_1"
    pool, table = PagePool(16, 16), []
    pool.grow(table, 32)

    def batch(ids, start):
        pos = list(range(start, start + len(ids)))
        return RaggedBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor([0, len(ids)]),
                           torch.tensor([start + len(ids)]), torch.tensor([table]),
                           torch.tensor([pool.slot(table, p) for p in pos]))

    prompt, step = list(range(100, 120)), [7, 8, 9, 10, 11, 12]
    with torch.inference_mode():
        for model in (tiles, fma):
            model.logits(batch(prompt, 0), torch.arange(len(prompt)))
        verify = tiles.logits(batch(step, 20), torch.arange(len(step)))
        torch.testing.assert_close(verify, fma.logits(batch(step, 20), torch.arange(len(step))),
                                   rtol=0, atol=2e-3)  # logits of magnitude ~20: fp32's drift
        decode = torch.cat([tiles.logits(batch([t], 20 + i), torch.arange(1)) for i, t in enumerate(step)])
    assert torch.equal(decode, verify)  # each verify row is its decode step, bit for bit

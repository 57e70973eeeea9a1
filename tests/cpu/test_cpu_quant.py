"""Exact block-quantized forms of fp32 weights (GGUF's Q4_1, Q8_0) and their row kernels give the
dense fp32 kernel's bits; a drafter rounded to Q8_0 leaves the output exact."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from eagle_serve import paths
from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.cpu.matmul import CpuLinear, find_block_weights, fuse_linears
from eagle_serve.cpu.quant import block_form, round_to_q8_0
from eagle_serve.kernels.cpu import cpu_kernels, wide_linears
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import gguf_weight, other_thread_count, tiny_engine

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the row kernels need AVX2 and FMA")


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("shape", [(40, 64), (576 + 2 * 192, 576), (576, 1536), (7, 32)])
def test_a_gguf_weight_is_found_again_and_gives_the_dense_kernels_bits_for_any_rows_and_threads(kind, shape):
    weight = gguf_weight(kind, *shape)
    form = block_form(weight)
    assert form is not None and form.kind == kind
    linear = nn.Linear(shape[1], shape[0], bias=True)
    linear.weight.data.copy_(weight)
    ours = CpuLinear(linear)
    assert ours.find_blocks().kind == kind
    x = torch.randn(20, shape[1])
    with torch.inference_mode():
        dense = cpu_kernels().linear(x, weight, linear.bias.detach())
        alone = torch.cat([form.linear(x[r:r + 1], linear.bias.detach()) for r in range(20)])
        for rows in range(0, 21):  # a tile of up to 7 (AVX2) or 12 rows (AVX-512), then chunks
            assert torch.equal(form.linear(x[:rows], linear.bias.detach()), alone[:rows]), f"{rows} rows"
            assert torch.equal(ours(x[:rows]), dense[:rows]), f"{rows} rows"
        with other_thread_count():
            for rows in (6, 20):
                assert torch.equal(form.linear(x[:rows], linear.bias.detach()), alone[:rows])
    assert torch.equal(alone, dense)
    torch.testing.assert_close(alone.double(), x.double() @ weight.double().T
                               + linear.bias.detach().double(), rtol=1e-4, atol=1e-4)


def test_the_kernels_are_built_for_avx512_where_the_cpu_has_it_unless_avx2_is_asked(monkeypatch):
    assert cpu_kernels().__name__.endswith("_avx512") == wide_linears()
    monkeypatch.setenv("EAGLE_CPU_ISA", "avx2")
    assert not wide_linears()


@pytest.mark.slow
@pytest.mark.skipif(not wide_linears(), reason="the AVX2 build is this CPU's default: tested above")
def test_the_avx2_build_gives_the_same_guarantees_where_avx512_is_the_default():
    """This file, the linears', the 8-bit activations' and the screened argmax's tests again, in
    a process with EAGLE_CPU_ISA=avx2 (the build of AVX2-only CPUs: 8 lanes, 6-row tiles, the
    dense weight past 12 rows, 8-bit activations without VNNI)."""
    root = Path(__file__).resolve().parents[2]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-k", "not avx2_build",
         "tests/cpu/test_cpu_quant.py", "tests/cpu/test_cpu_matmul.py",
         "tests/cpu/test_int8_activations.py", "tests/cpu/test_cpu_argmax.py"],
        cwd=root, env={**os.environ, "EAGLE_CPU_ISA": "avx2"}, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]


def test_a_weight_with_no_exact_block_form_keeps_the_dense_kernel():
    weight = gguf_weight("q4_1", 64, 96)
    off = weight.clone()
    off[50, 70] = torch.nextafter(off[50, 70], torch.tensor(1.0))  # one weight one ulp off
    for w in (off, torch.randn(64, 96), gguf_weight("q4_1", 64, 64)[:, :40].contiguous(),
              weight.double()):
        assert block_form(w) is None
    linear = nn.Linear(96, 64, bias=False)
    linear.weight.data.copy_(off)
    ours = CpuLinear(linear)
    x = torch.randn(3, 96)
    with torch.inference_mode():
        assert ours.find_blocks() is None and torch.equal(ours(x), cpu_kernels().linear(x, off, None))


def test_fused_gguf_linears_find_their_blocks_and_their_parts_are_not_searched():
    model = nn.Sequential(*[CpuLinear(nn.Linear(64, n, bias=False)) for n in (64, 32, 32)],
                          CpuLinear(nn.Linear(64, 16, bias=False)))
    for i, p in enumerate(model):
        p.weight.data.copy_(gguf_weight("q4_1", p.out_features, 64, seed=i))
    fused = fuse_linears(list(model[:3]))
    assert find_block_weights(model, [fused]) == 2
    assert fused.blocks.kind == model[3].blocks.kind == "q4_1"
    assert all(p.blocks is None for p in model[:3])
    x = torch.randn(2, 64)
    with torch.inference_mode():
        parts = [cpu_kernels().linear(x, p.weight, None) for p in model[:3]]
        assert torch.equal(fused(x), torch.cat(parts, -1))


def test_the_default_gguf_target_runs_every_linear_on_its_blocks_with_unchanged_bits(monkeypatch):
    """(on the FMA kernels: AMX tiles, where the CPU has them, sum in another order:
    tests/cpu/test_amx_tiles.py)"""
    if not (paths.default_target_dir() / "config.json").exists():
        pytest.skip("default model not converted (run make setup)")
    monkeypatch.setenv("EAGLE_CPU_AMX", "0")
    target = TargetModel(paths.default_target_dir(), num_pages=16, page_size=16)
    running = [target.lm_head] + [m for p, layer in zip(target.layers, target.hf.model.layers)
                                  for m in (p.qkv, p.gate_up, layer.self_attn.o_proj, layer.mlp.down_proj)]
    assert [m.blocks.kind for m in running] == ["q8_0"] + ["q4_1"] * (len(running) - 1)
    pool, table = PagePool(16, 16), []
    pool.grow(table, 24)
    prompt, step = list(range(100, 120)), [7, 8, 9]

    def batch(ids, start):
        pos = list(range(start, start + len(ids)))
        return RaggedBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor([0, len(ids)]),
                           torch.tensor([start + len(ids)]), torch.tensor([table]),
                           torch.tensor([pool.slot(table, p) for p in pos]))

    with torch.inference_mode():
        target.logits(batch(prompt, 0), torch.arange(len(prompt)))
        on_blocks = target.logits(batch(step, 20), torch.arange(3))
        for m in running:
            m.blocks = None
        assert torch.equal(target.logits(batch(step, 20), torch.arange(3)), on_blocks)


def test_rounding_to_q8_0_moves_each_weight_at_most_half_a_step_and_gives_findable_blocks():
    weight = torch.randn(48, 96)
    weight[3, :32] = 0  # an all-zero block
    rounded = round_to_q8_0(weight)
    step = (weight.reshape(48, 3, 32).abs().amax(-1, keepdim=True) / 127).to(torch.float16).float()
    assert ((rounded - weight).reshape(48, 3, 32).abs() <= step * 0.5 * (1 + 1e-6) + 1e-12).all()
    assert torch.equal(rounded[3, :32], torch.zeros(32)) and block_form(rounded).kind == "q8_0"
    assert torch.equal(round_to_q8_0(rounded), rounded)


def test_a_q8_0_drafter_runs_on_its_blocks_and_greedy_output_stays_plain_decodings(tiny_target, eagle3_head,
                                                                                   prompts):
    """The drafter's weights are rounded (its drafts may change), never the target's output."""
    def linears(engine):
        return [m for m in engine.drafter.head.modules() if isinstance(m, CpuLinear)]

    params = SamplingParams(max_tokens=16, num_speculative_tokens=3)
    plain = [r.token_ids for r in tiny_engine(tiny_target, dtype="float32").generate(
        prompts, SamplingParams(max_tokens=16, num_speculative_tokens=0))]
    for weights in ("q8_0", "q8_0_a8", "trained"):
        engine = tiny_engine(tiny_target, eagle3_head, dtype="float32", drafter_weights=weights)
        assert all((m.blocks is not None) == (weights != "trained") for m in linears(engine))
        assert [r.token_ids for r in engine.generate(prompts, params)] == plain
        assert engine.stats.draft_tokens > 0
    with pytest.raises(ValueError, match="drafter weights must be one of"):
        tiny_engine(tiny_target, eagle3_head, dtype="float32", drafter_weights="q4")


def test_auto_runs_float32_for_a_target_of_gguf_blocks_where_bf16_is_native_and_bf16_for_dense_weights(
        tmp_path, monkeypatch):
    """A target of exact blocks is faster in float32 on the block kernels than in bf16 even with
    AMX (checkpoints.torch_dtype); dense weights keep bf16 where the CPU computes it natively."""
    from safetensors.torch import save_file

    from eagle_serve import machine
    from eagle_serve.models.dtypes import torch_dtype

    folders = {}
    for name, weight in (("blocks", gguf_weight("q4_1", 64, 64)), ("dense", torch.randn(64, 64))):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        save_file({"model.embed_tokens.weight": torch.randn(8, 64),
                   "model.layers.0.self_attn.q_proj.weight": weight}, folders[name] / "model.safetensors")
    for native in (True, False):
        monkeypatch.setattr(machine, "native_bf16", lambda: native)
        assert torch_dtype("auto", False, folders["blocks"]) == torch.float32
        assert torch_dtype("auto", False, folders["dense"]) == (torch.bfloat16 if native else torch.float32)
        assert torch_dtype("auto", True, folders["blocks"]) == torch.bfloat16
    if (paths.default_target_dir() / "config.json").exists():
        assert torch_dtype("auto", False, paths.default_target_dir()) == torch.float32


def test_without_the_cpu_kernels_int8_target_activations_are_refused_and_the_drafter_keeps_fp32_inputs(
        tiny_target, eagle3_head, monkeypatch):
    """What the 8-bit-activation settings do where eagle_serve/kernels/cpu_i8.cpp cannot run."""
    from eagle_serve.models import checkpoints, target

    monkeypatch.setattr(target, "int8_activations_run", lambda: False)
    monkeypatch.setattr(checkpoints, "int8_activations_run", lambda: False)
    with pytest.raises(ValueError, match="run on a CPU with AVX2"):
        tiny_engine(tiny_target, dtype="float32", target_activations="int8")
    engine = tiny_engine(tiny_target, eagle3_head, dtype="float32", drafter_weights="q8_0_a8")
    kinds = {m.blocks.kind for m in engine.drafter.head.modules() if isinstance(m, CpuLinear)}
    assert kinds == {"q8_0"}


def test_a_build_lock_left_by_a_killed_build_is_cleared_and_a_live_ones_kept(tmp_path, monkeypatch):
    import time

    from eagle_serve.kernels.cpu import STALE_LOCK_S, clear_stale_lock
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / "probe" / "lock"
    lock.parent.mkdir()
    lock.touch()
    assert not clear_stale_lock("probe") and lock.exists()  # a build under way
    long_ago = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (long_ago, long_ago))
    assert clear_stale_lock("probe") and not lock.exists()
    assert not clear_stale_lock("probe")

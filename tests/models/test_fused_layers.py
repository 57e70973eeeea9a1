"""The target on its GPU path: the fused layer kernels (eagle_serve.kernels.layer_ops) and the
Triton attention, run through the interpreter on CPU tensors. Its logits agree with the
PyTorch layers' (float32 tolerance: the norms sum in another order) for each architecture
the fused loop serves, and one forward launches few kernels a layer; a draft step of the head
launches a bounded number: counted with eagle_serve.tools.launches, the same operators a GPU
would run."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.local import build_local_engine
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import (
    force_gpu_kernels,
    greedy_rows,
    make_random_head,
    make_tiny_target,
    ragged_prefill,
    reference_ops,
)
from eagle_serve.tools.launches import count_launches, launches_per_call

LAUNCHES_PER_LAYER = 10  # norm, qkv, rope + KV write, attention, o_proj, norm, gate_up, act, down


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3", "mixtral"])
def test_the_fused_layers_give_the_logits_of_the_pytorch_layers(tmp_path, monkeypatch, arch):
    folder = make_tiny_target(tmp_path / arch, arch, vocab_size=512)
    prompts = [list(range(5, 26)), [7, 8, 9]]
    reference = TargetModel(folder, dtype=torch.float32, num_pages=32, page_size=4)
    expected = reference.logits(ragged_prefill(prompts, PagePool(32, 4)), torch.arange(24))
    force_gpu_kernels(monkeypatch)
    fused = TargetModel(folder, dtype=torch.float32, num_pages=32, page_size=4)
    assert fused.fusable
    logits = fused.logits(ragged_prefill(prompts, PagePool(32, 4)), torch.arange(24))
    assert torch.allclose(logits, expected, rtol=1e-4, atol=1e-4)


def decode_launches(folder, monkeypatch) -> tuple[int, str]:
    """Kernels one greedy decode forward (one token after a 9-token prompt) launches."""
    force_gpu_kernels(monkeypatch)
    target = TargetModel(folder, dtype=torch.float32, num_pages=8, page_size=4)
    pool, table = PagePool(8, 4), []
    prefill = ragged_prefill([list(range(5, 14))], pool)
    with reference_ops(monkeypatch):  # the prompt's KV (not counted)
        target.forward(prefill, torch.tensor([8]), greedy_rows(1))
    pool.grow(table := prefill.block_tables[0].tolist(), 10)
    step = RaggedBatch(torch.tensor([40]), torch.tensor([9]), torch.tensor([0, 1]), torch.tensor([10]),
                       torch.tensor([table]), torch.tensor([pool.slot(table, 9)]), max_query_len=1)
    rows, sampling = torch.tensor([0]), greedy_rows(1)
    with count_launches() as counter:
        target.forward(step, rows, sampling)
    return counter.total, counter.report()


def test_a_decode_forward_launches_at_most_ten_kernels_a_layer(tmp_path, monkeypatch):
    counts = {}
    for layers in (2, 6):
        folder = make_tiny_target(tmp_path / f"llama-{layers}", vocab_size=512, num_layers=layers)
        counts[layers], report = decode_launches(folder, monkeypatch)
        print(f"{layers} layers: {counts[layers]} launches\n{report}")
    per_layer = (counts[6] - counts[2]) / 4
    assert per_layer <= LAUNCHES_PER_LAYER
    assert counts[2] - 2 * per_layer <= 15  # embedding, RoPE tables, final norm, LM head, argmax


DRAFT_STEP_LAUNCHES = 36  # a step of a one-layer head (31 measured): its layer and the bookkeeping


def draft_launches(folder, head, monkeypatch, drafts: int) -> int:
    """Kernels one propose call launches for a greedy chain of `drafts` (after a prefill)."""
    force_gpu_kernels(monkeypatch)
    engine = build_local_engine(folder, head, dtype=torch.float32, corpus=None, drafter_weights="trained",
                                draft_call_cost=0.0, draft_step_cost=0.0, draft_min_prob=0.0,
                                draft_expand_prob=0.0, num_target_pages=64)
    with launches_per_call(engine.drafter, "propose") as counts:
        engine.add_request(list(range(5, 14)), SamplingParams(max_tokens=20, ignore_eos=True, context_lookup=False,
                                                              num_speculative_tokens=drafts, draft_topk=1))
        with reference_ops(monkeypatch):  # the prefill and the drafts after it (not counted)
            engine.step()
        while len(counts) < 2:  # the engine's steps until a round's propose call
            engine.step()
    return counts[1]  # a round's (the first follows the prefill)


@pytest.mark.slow
def test_a_draft_step_launches_a_bounded_number_of_kernels(tmp_path, monkeypatch):
    folder = make_tiny_target(tmp_path / "llama", vocab_size=512)
    head = make_random_head(tmp_path / "head", folder, 3, draft_vocab_size=256)
    one, four = (draft_launches(folder, head, monkeypatch, k) for k in (1, 4))
    per_step = (four - one) / 3
    print(f"propose: {one} launches for 1 draft, {four} for 4: {per_step:.1f} a step")
    assert per_step <= DRAFT_STEP_LAUNCHES

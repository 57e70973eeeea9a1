"""The target forward matches HF transformers; EAGLE checkpoints in published layouts load."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_serve import paths
from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.models.checkpoints import CheckpointError, load_drafter, load_head
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import local_engine, make_random_head, ragged_prefill


def check_against_hf(folder, dtype, prompts, tol, page_size=5):
    target = TargetModel(folder, dtype=dtype, num_pages=64, page_size=page_size)
    batch = ragged_prefill(prompts, PagePool(64, page_size))
    logits = target.logits(batch, torch.arange(batch.input_ids.shape[0]))
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).eval()
    cu = batch.cu_seqlens.tolist()
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0]
            assert (ref - logits[cu[i]:cu[i + 1]]).abs().max().item() < tol


def test_target_logits_equal_hf_on_a_tiny_gqa_llama_in_float64(tiny_target, prompts):
    check_against_hf(tiny_target, torch.float64, prompts[:5], tol=1e-10)


def test_target_logits_equal_hf_on_the_default_smollm2(prompts):
    if not (paths.default_target_dir() / "config.json").exists():
        pytest.skip("default model not converted (run make setup)")
    check_against_hf(paths.default_target_dir(), torch.float32, prompts[:3], tol=2e-3)


def test_eagle3_features_are_the_inputs_of_layers_2_mid_and_last_minus_3(tiny_target, prompts):
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=16, page_size=8,
                         feature_layers=(2, 2, 1))
    batch = ragged_prefill(prompts[:1], PagePool(16, 8))
    _, features = target.hidden_states(batch)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    with torch.no_grad():
        hs = hf(torch.tensor(prompts[:1]), output_hidden_states=True).hidden_states
    expected = torch.cat([hs[2][0], hs[2][0], hs[1][0]], dim=-1)
    assert (features - expected).abs().max().item() < 1e-10


LAYOUTS = [
    dict(version=1, fc_bias=True, fmt="safetensors"),
    dict(version=1, fc_bias=False, fmt="bin"),
    dict(version=3, draft_vocab_size=4096, fmt="safetensors"),
    dict(version=3, draft_vocab_size=None, with_d2t=False, fmt="bin"),
    dict(version=3, draft_vocab_size=None, with_d2t=True, fmt="safetensors"),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
def test_published_layouts_load_and_decode_losslessly(tmp_path, tiny_target, prompts, hf_greedy, layout):
    version = layout.pop("version")
    fmt = layout.pop("fmt")
    head_dir = tmp_path / "head"
    make_random_head(head_dir, tiny_target, version, fmt=fmt if fmt == "safetensors" else "bin", **layout)
    if fmt == "bin":
        assert (head_dir / "pytorch_model.bin").exists()
    engine = local_engine(tiny_target, head_dir)
    assert engine.drafter.head.version == version
    results = engine.generate(prompts[:3], SamplingParams(max_tokens=12, num_speculative_tokens=3))
    assert [r.token_ids for r in results] == [hf_greedy(p, 12) for p in prompts[:3]]


def test_vllm_style_layers0_naming_of_an_eagle3_head_loads(tmp_path, tiny_target):
    from safetensors.torch import load_file, save_file
    head_dir = make_random_head(tmp_path / "h", tiny_target, 3, draft_vocab_size=4096)
    state = load_file(str(head_dir / "model.safetensors"))
    state = {k.replace("midlayer.", "layers.0."): v for k, v in state.items()}
    save_file(state, str(head_dir / "model.safetensors"))
    assert load_head(head_dir, tiny_target).version == 3


def test_a_head_for_another_target_fails_with_a_clear_message(tmp_path, tiny_target):
    head_dir = make_random_head(tmp_path / "h", tiny_target, 1)
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((tiny_target / "config.json").read_text())
    cfg["hidden_size"] = 96
    (other / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="head expects target hidden size 64, target has 96"):
        load_head(head_dir, other)


def test_a_reduced_vocab_head_without_d2t_fails_with_a_clear_message(tmp_path, tiny_target):
    head_dir = make_random_head(tmp_path / "h", tiny_target, 3, draft_vocab_size=4096, with_d2t=False)
    with pytest.raises(CheckpointError, match="no d2t"):
        load_drafter(head_dir, tiny_target)


def test_a_folder_without_weights_fails_with_a_clear_message(tmp_path, tiny_target):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no model.safetensors or pytorch_model.bin"):
        load_head(tmp_path, tiny_target)


def test_a_sampled_request_without_drafts_adds_no_draft_probabilities(tiny_target, eagle1_head):
    from eagle_serve.core.interfaces import DraftShapes, RowSampling
    drafter = load_drafter(eagle1_head, tiny_target, dtype=torch.float64, num_pages=16, page_size=4)
    seqs = [[5, 6, 7, 8], [9, 10, 11]]
    short = ragged_prefill(seqs, PagePool(16, 4))  # pages 0, 1 / 2 ... then room for the drafts
    batch = RaggedBatch(short.input_ids, short.positions, short.cu_seqlens, short.seq_lens,
                        torch.tensor([[0, 2, 4], [1, 3, 5]]), short.slot_mapping)
    features = torch.randn(7, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    sampled = RowSampling(torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.ones(2),
                          torch.tensor([1, 2]))
    both = drafter.propose(batch, features, DraftShapes.chains(torch.tensor([0, 2])), sampled)
    assert both.probs.shape[0] == 2  # only the second request's two drafts
    alone = drafter.propose(batch, features, DraftShapes.chains(torch.tensor([2, 2])), sampled)
    assert torch.equal(both.probs, alone.probs[2:])

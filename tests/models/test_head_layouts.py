"""Every published EAGLE head layout: a tiny checkpoint written with exactly the key names and
config fields of the tool that publishes it loads to the same weights, computes what that
layout's own forward computes (written out below as vLLM / the EAGLE repository run it), and
serves greedy output equal to HF's. A head that does not fit its target is refused, naming the
mismatch."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.engine import SamplingParams
from eagle_serve.models.checkpoints import CheckpointError, load_drafter, load_head
from eagle_serve.models.heads import layer_config, random_head
from eagle_serve.models.target import load_target_config
from eagle_serve.testing import hf_generate_greedy, local_engine, make_tiny_llama, write_head_layout

# name -> (layout, head kind, random_head fields, extra config fields, target)
CASES = {
    "eagle1 (yuhuili/EAGLE-*)": ("eagle1", 1, dict(fc_bias=True), {}, "plain"),
    "eagle1, qkv bias, two layers (EAGLE-Qwen2 style)": (
        "eagle1", 1, dict(fc_bias=True, qkv_bias=True, num_layers=2), {}, "plain"),
    "eagle3 (yuhuili/EAGLE3-*), reduced vocabulary": ("eagle3", 3, dict(draft_vocab_size=4096), {}, "plain"),
    "eagle3 (SpecForge), eagle_config layer ids": (
        "specforge", 3, dict(draft_vocab_size=4096, feature_layers=(2, 3, 1)),
        {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 0], "use_aux_hidden_state": True}}, "plain"),
    "speculators, llama layers x2, biases, norm_before_residual": (
        "speculators", 3, dict(draft_vocab_size=4096, num_layers=2, qkv_bias=True, o_bias=True, mlp_bias=True,
                               norm_before_residual=True, feature_layers=(1, 3, 2)), {}, "plain"),
    "speculators, qwen3 layers (q/k norm), norm_before_residual absent": (
        "speculators", 3, dict(draft_vocab_size=4096, qk_norm=True, norm_before_residual=True),
        {"norm_before_residual": None}, "plain"),
    "eagle3 without lm_head (the target's, tied)": (
        "eagle3", 3, dict(own_lm_head=False), {"draft_vocab_size": None}, "tied"),
    "speculators, narrower than the target, own embedding": ("speculators", 3, dict(draft_vocab_size=4096), {}, "plain"),
}
NARROW = "speculators, narrower than the target, own embedding"


@pytest.fixture(scope="session")
def targets(tmp_path_factory, tiny_target):
    return {"plain": tiny_target,
            "tied": make_tiny_llama(tmp_path_factory.mktemp("tied") / "target", tie_word_embeddings=True)}


@pytest.fixture(scope="session")
def written(tmp_path_factory, targets):
    """case -> (head as built, folder as the tool writes it, the embedding it ships or None)"""
    root, out = tmp_path_factory.mktemp("layouts"), {}
    for i, (name, (layout, version, fields, extra, target)) in enumerate(CASES.items()):
        config = load_target_config(targets[target])
        fields, embed = dict(fields), None
        vocab = fields.pop("draft_vocab_size", None)
        if name == NARROW:
            fields["layer"] = layer_config(config, hidden_size=48, intermediate_size=96, head_dim=12)
            embed = torch.randn(config.vocab_size, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        d2t = torch.arange(vocab) if vocab else None  # draft i -> target 2i
        head = random_head(config, version, vocab, seed=i, d2t=d2t, random_norms=True, **fields).double()
        folder = write_head_layout(head, root / f"h{i}", layout, targets[target], embed=embed, extra_config=extra)
        out[name] = head, folder, embed
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_each_published_layout_loads_to_the_same_weights(name, written, targets):
    head, folder, embed = written[name]
    layout, version, fields, _, target = CASES[name]
    drafter = load_drafter(folder, targets[target], dtype=torch.float64)
    loaded = drafter.head
    assert type(loaded) is type(head) and loaded.version == version
    assert replace(loaded.spec, layer=None) == replace(head.spec, layer=None)
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "rms_norm_eps", "rope_parameters"):
        assert getattr(loaded.spec.layer, field) == getattr(head.spec.layer, field), field
    source, got = head.state_dict(), loaded.state_dict()
    assert source.keys() == got.keys() and all(torch.equal(source[k], got[k]) for k in source)
    if embed is not None:
        assert torch.equal(drafter.embed_tokens, embed)
    if target == "tied":  # no LM head of its own: the target's, which is its embedding
        assert torch.equal(drafter.lm_head, drafter.embed_tokens)


def rms(x, weight, eps):
    """HF's LlamaRMSNorm, float32 inside (so both sides round alike)."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def attention(w, prefix, x, cfg, qk_norm):
    """Causal self-attention of one sequence at positions 0..T-1 (GQA, HF's RoPE)."""
    t, d = x.shape[0], cfg["head_dim"]
    proj = lambda n: x @ w[f"{prefix}.{n}_proj.weight"].T + w.get(f"{prefix}.{n}_proj.bias", 0)  # noqa: E731
    q, k, v = (proj(n).view(t, -1, d).transpose(0, 1) for n in "qkv")  # [H, T, D]
    if qk_norm:
        q, k = rms(q, w[f"{prefix}.q_norm.weight"], cfg["rms_norm_eps"]), rms(k, w[f"{prefix}.k_norm.weight"], cfg["rms_norm_eps"])
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.float) / d))
    angles = torch.arange(t).float()[:, None] * inv
    cos, sin = (f(torch.cat([angles, angles], -1)).to(x.dtype) for f in (torch.cos, torch.sin))
    rot = lambda y: y * cos + torch.cat([-y[..., d // 2:], y[..., :d // 2]], -1) * sin  # noqa: E731
    q, k = rot(q), rot(k)
    k, v = (y.repeat_interleave(q.shape[0] // k.shape[0], 0) for y in (k, v))
    scores = (q @ k.transpose(1, 2)) / d ** 0.5
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    out = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(t, -1)
    return out @ w[f"{prefix}.o_proj.weight"].T + w.get(f"{prefix}.o_proj.bias", 0)


def mlp(w, prefix, x):
    lin = lambda n, y: y @ w[f"{prefix}.{n}_proj.weight"].T + w.get(f"{prefix}.{n}_proj.bias", 0)  # noqa: E731
    return lin("down", torch.nn.functional.silu(lin("gate", x)) * lin("up", x))


def published_forward(folder, emb, feats):
    """The head's output features [T, H] for one sequence, from its files alone: EAGLE-1 as
    the EAGLE repository's cnets1 runs it, EAGLE-3 as vLLM's llama_eagle3 does (residual
    carried beside the hidden state, fused add + norm, `norm_before_residual`)."""
    raw = json.loads((folder / "config.json").read_text())
    w = load_file(str(folder / "model.safetensors")) if (folder / "model.safetensors").exists() else \
        torch.load(folder / "pytorch_model.bin", weights_only=True)
    w = {k.replace("midlayer.", "layers.0."): v for k, v in w.items()}
    cfg = raw.get("transformer_layer_config", raw)
    eps, n = cfg["rms_norm_eps"], cfg["num_hidden_layers"]
    qk_norm = cfg.get("model_type") == "qwen3"
    if "hidden_norm" not in "".join(w):  # EAGLE-1
        x = torch.cat([emb, feats], -1) @ w["fc.weight"].T + w.get("fc.bias", 0)
        for i in range(n):
            y = x if i == 0 else rms(x, w[f"layers.{i}.input_layernorm.weight"], eps)
            x = x + attention(w, f"layers.{i}.self_attn", y, cfg, qk_norm)
            x = x + mlp(w, f"layers.{i}.mlp", rms(x, w[f"layers.{i}.post_attention_layernorm.weight"], eps))
        return x
    hidden, residual = feats @ w["fc.weight"].T, None
    for i in range(n):
        if i == 0:
            normed = rms(hidden, w["layers.0.hidden_norm.weight"], eps)
            residual = normed if raw.get("norm_before_residual", "speculators_model_type" in raw) else hidden
            x = torch.cat([rms(emb, w["layers.0.input_layernorm.weight"], eps), normed], -1)
        else:
            residual = hidden + residual
            x = rms(residual, w[f"layers.{i}.input_layernorm.weight"], eps)
        residual = attention(w, f"layers.{i}.self_attn", x, cfg, qk_norm) + residual
        hidden = mlp(w, f"layers.{i}.mlp", rms(residual, w[f"layers.{i}.post_attention_layernorm.weight"], eps))
    return hidden + residual


@pytest.mark.parametrize("name", list(CASES))
@torch.inference_mode()
def test_each_published_layout_computes_what_its_own_forward_computes(name, written, targets):
    _, folder, _ = written[name]
    target = targets[CASES[name][4]]
    drafter = load_drafter(folder, target, dtype=torch.float64, num_pages=8, page_size=4)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, drafter.vocab_size, (13,), generator=gen)
    width = drafter.head.fc.in_features - (drafter.head.spec.hidden_size if drafter.head.version == 1 else 0)
    feats = torch.randn(13, width, dtype=torch.float64, generator=gen)
    batch = RaggedBatch(ids, torch.arange(13), torch.tensor([0, 13]), torch.tensor([13]),
                        torch.tensor([[5, 2, 7, 0]]), torch.tensor([PagePool(8, 4).slot([5, 2, 7, 0], p) for p in range(13)]))
    emb = torch.nn.functional.embedding(ids, drafter.embed_tokens)
    ours = drafter.head.step(emb, feats, True, batch, drafter.cache)
    expected = published_forward(folder, emb, feats)
    assert (ours - expected).abs().max().item() < 1e-9
    assert (drafter.logits(ours) - drafter.logits(expected)).abs().max().item() < 1e-9


@pytest.mark.parametrize("name", list(CASES))
def test_each_published_layout_serves_greedy_output_equal_to_hf(name, written, targets, prompts):
    _, folder, _ = written[name]
    target = targets[CASES[name][4]]
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()
    engine = local_engine(target, folder)
    cases = [(prompts[0], SamplingParams(max_tokens=10, num_speculative_tokens=3)),
             (prompts[3], SamplingParams(max_tokens=10, num_speculative_tokens=5, draft_topk=2, draft_depth=3))]
    results = engine.generate([p for p, _ in cases], [sp for _, sp in cases])
    for (prompt, sp), result in zip(cases, results):
        assert result.token_ids == hf_generate_greedy(hf, prompt, sp.max_tokens)


# ---- heads that do not fit ----

def layers_x2(raw: dict) -> dict:
    return raw | {"transformer_layer_config": raw["transformer_layer_config"] | {"num_hidden_layers": 2}}


MISMATCHES = {  # name -> (config change, weights change, message)
    "feature layers out of range": (lambda raw: raw | {"eagle_aux_hidden_state_layer_ids": [2, 9, 1]}, None,
                                    r"feature layers \(2, 9, 1\) outside the target's 4 layers"),
    "fewer feature layers than fc fuses": (lambda raw: raw | {"eagle_aux_hidden_state_layer_ids": [2, 3]}, None,
                                           r"fc.weight is \(64, 192\) but fuses 2 target layers of hidden size 64"),
    "another target's hidden size": (lambda raw: raw | {"target_hidden_size": 96}, None,
                                     "head expects target hidden size 96, target has 64"),
    "t2d of another vocabulary": (None, lambda w: w | {"t2d": torch.ones(32000, dtype=torch.bool)},
                                  "t2d covers 32000 target ids, the target vocab has 12288"),
    "d2t past the target vocabulary": (None, lambda w: w | {"d2t": w["d2t"] + 46000},
                                       "d2t .* does not map a draft vocab of 4096 into the target vocab of 12288"),
    "embedding of another vocabulary": (None, lambda w: w | {"embed_tokens.weight": w["embed_tokens.weight"][:1000]},
                                        r"embed_tokens is \(1000, 64\), needs \[target vocab 12288, 64\]"),
    "draft_vocab_size against lm_head": (lambda raw: raw | {"draft_vocab_size": 32000}, None,
                                         "config draft_vocab_size 32000 != lm_head.weight rows 4096"),
    "layer count against the weights": (layers_x2, None,
                                        r"config num_hidden_layers is 2 but the weights hold layers \[0\]"),
    "an option not supported": (lambda raw: raw | {"fc_norm": True}, None, "head options not supported: fc_norm"),
    "another speculators model": (lambda raw: raw | {"speculators_model_type": "mlp_speculator"}, None,
                                  "speculators model type 'mlp_speculator' is not supported"),
}


@pytest.mark.parametrize("name", list(MISMATCHES))
def test_a_head_that_does_not_fit_is_refused_naming_the_mismatch(name, tmp_path, tiny_target):
    config_change, weights_change, message = MISMATCHES[name]
    config = load_target_config(tiny_target)
    head = random_head(config, 3, 4096, d2t=torch.arange(4096))
    folder = write_head_layout(head, tmp_path / "h", "speculators", tiny_target)
    if config_change:
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config_change(raw)))
    if weights_change:
        save_file(weights_change(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        load_drafter(folder, tiny_target)


def test_a_narrower_head_without_its_own_embedding_is_refused(tmp_path, tiny_target):
    config = load_target_config(tiny_target)
    head = random_head(config, 3, layer=layer_config(config, hidden_size=48, head_dim=12))
    folder = write_head_layout(head, tmp_path / "h", "eagle3", tiny_target)  # yuhuili layout: no embedding
    with pytest.raises(CheckpointError, match="head hidden size 48 != target hidden size 64 and the head has "
                                              "no embed_tokens of its own"):
        load_head(folder, tiny_target)

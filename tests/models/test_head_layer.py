"""A head's layer shape, RMSNorm and RoPE are transformers' Llama ones bit for bit (LlamaConfig's
reading of a config.json, LlamaRMSNorm, LlamaRotaryEmbedding), and a drafter loads without
importing transformers (whose import costs every drafter process seconds at each start)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

from eagle_serve.models.head_layer import HeadLayer, RMSNorm, Rotary

CONFIGS = {  # config.json layer fields, as heads publish them
    "defaults": {},
    "legacy rope_theta": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                              intermediate_size=96, rms_norm_eps=1e-5, rope_theta=500000.0, vocab_size=300),
    "head_dim of its own": dict(hidden_size=48, num_attention_heads=4, head_dim=16, max_position_embeddings=4096),
    "llama3 rope_scaling": dict(hidden_size=64, num_attention_heads=4, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024}, max_position_embeddings=8192),
    "legacy linear scaling": dict(hidden_size=64, num_attention_heads=4, rope_scaling={"type": "linear", "factor": 2.0}),
    "rope_parameters": dict(hidden_size=64, num_attention_heads=4,
                            rope_parameters={"rope_type": "default", "rope_theta": 1234.0}),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_a_layer_config_reads_as_llama_config_reads_it(name):
    ours, theirs = HeadLayer.from_config(CONFIGS[name]), LlamaConfig(**CONFIGS[name])
    for field in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act"):
        assert getattr(ours, field) == getattr(theirs, field), field
    for key in ("rope_type", "rope_theta", "factor"):
        assert ours.rope_parameters.get(key) == theirs.rope_parameters.get(key), key
    assert HeadLayer.from_config(ours.to_dict()).to_dict() == ours.to_dict()  # what save_head writes


@pytest.mark.parametrize("name", ["legacy rope_theta", "head_dim of its own", "llama3 rope_scaling",
                                  "legacy linear scaling"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_rope_tables_and_the_norm_are_llamas_bitwise(name, dtype):
    layer = HeadLayer.from_config(CONFIGS[name])
    positions = torch.tensor([[0, 1, 7, 1000, 5000, 9000]])
    x = torch.randn(1, 6, layer.hidden_size, generator=torch.Generator().manual_seed(0)).to(dtype)
    ours, theirs = Rotary(layer).to(dtype), LlamaRotaryEmbedding(LlamaConfig(**CONFIGS[name])).to(dtype)
    for a, b in zip(ours(x, positions), theirs(x, positions)):
        assert a.dtype == dtype and torch.equal(a, b)
    norm, llama = RMSNorm(layer.hidden_size, layer.rms_norm_eps), LlamaRMSNorm(layer.hidden_size, layer.rms_norm_eps)
    with torch.no_grad():
        llama.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(1))
        norm.weight.copy_(llama.weight)
    assert torch.equal(norm.to(dtype)(x), llama.to(dtype)(x))


def test_a_drafter_loads_without_importing_transformers(tiny_target, eagle3_head):
    code = (f"import sys, torch\nfrom eagle_serve.models.checkpoints import load_drafter\n"
            f"d = load_drafter({str(eagle3_head)!r}, {str(tiny_target)!r}, dtype=torch.float64)\n"
            f"assert d.head.spec.draft_vocab_size == 4096\n"
            f"heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
            f"assert not heavy, heavy[:5]\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

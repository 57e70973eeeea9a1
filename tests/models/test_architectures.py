"""Every supported target architecture: a tiny random model of each (quirks switched on, see
testing.TINY_ARCHITECTURES) runs through our paged forward with the logits HF computes, decodes
speculatively to HF's greedy output, and trains a head with the unchanged training command."""
from __future__ import annotations

import gzip
import json

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from eagle_serve.core.interfaces import RaggedBatch, ancestor_mask
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.engine import SamplingParams
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.models.checkpoints import load_drafter
from eagle_serve.models.target import ARCHITECTURES, TargetModel, UnsupportedArchitecture
from eagle_serve.testing import (
    TINY_ARCHITECTURES,
    gguf_weight,
    hf_generate_greedy,
    local_engine,
    make_random_head,
    make_tiny_target,
)

ARCHS = list(TINY_ARCHITECTURES)


def model_type(arch: str) -> str:
    return getattr(transformers, TINY_ARCHITECTURES[arch][0]).model_type

# HF's eager attention (Gemma 2's, the only one with soft-capping) takes its softmax in float32
TOLERANCE = {"gemma2": 1e-5}


@pytest.fixture(scope="session")
def arch_models(tmp_path_factory):
    """arch -> (target folder, random EAGLE-3 head folder), built once per session."""
    root, built = tmp_path_factory.mktemp("archs"), {}

    def get(arch: str):
        if arch not in built:
            target = make_tiny_target(root / arch, arch)
            built[arch] = target, make_random_head(root / f"{arch}-head", target, 3, draft_vocab_size=4096)
        return built[arch]
    return get


def hf_model(folder, arch: str):
    """HF's model in float64 (MoE experts by HF's eager loop: its grouped GEMM has no float64)."""
    moe = {"experts_implementation": "eager"} if ARCHITECTURES[model_type(arch)].moe else {}
    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float64, **moe).eval()


def test_every_architecture_of_the_table_has_a_tiny_model():
    assert {model_type(a) for a in ARCHS} == set(ARCHITECTURES)


def rows(pool: PagePool, tables: list[list[int]], new: list[list[int]], starts: list[int],
         parents: list[list[int]] | None = None) -> RaggedBatch:
    """New tokens of each request stored at start .. start + n - 1; with `parents` a draft tree
    per request (RoPE position start + depth - 1), else a chain."""
    for t, n, s in zip(tables, new, starts):
        pool.grow(t, s + len(n))
    cu, positions, slots = [0], [], []
    for b, (n, s) in enumerate(zip(new, starts)):
        cu.append(cu[-1] + len(n))
        depth = list(range(1, len(n) + 1)) if parents is None else _depths(parents[b])
        positions += [s + d - 1 for d in depth]
        slots += [pool.slot(tables[b], s + j) for j in range(len(n))]
    width = max(len(t) for t in tables)
    mask = None
    if parents is not None:
        q = max(len(n) for n in new)
        mask = torch.zeros(len(new), q, q, dtype=torch.bool)
        for b, p in enumerate(parents):
            mask[b, :len(p), :len(p)] = torch.from_numpy(ancestor_mask(p))
    return RaggedBatch(torch.tensor([x for n in new for x in n]), torch.tensor(positions), torch.tensor(cu),
                       torch.tensor([s + len(n) for n, s in zip(new, starts)]),
                       torch.tensor([t + [-1] * (width - len(t)) for t in tables]), torch.tensor(slots),
                       tree_mask=mask)


def _depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def _path(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.mark.parametrize("arch", ARCHS)
@torch.inference_mode()
def test_target_logits_equal_hf_for_prefill_decode_verify_and_tree_rows(arch, arch_models, prompts):
    """float64; prompts longer than the sliding windows. The tree's nodes sit at new slots in
    expansion order while their RoPE positions (and windows) follow their paths."""
    folder, _ = arch_models(arch)
    tol = TOLERANCE.get(arch, 1e-10)
    ours = TargetModel(folder, dtype=torch.float64, num_pages=64, page_size=5)
    hf = hf_model(folder, arch)
    hf_logits: dict[tuple, torch.Tensor] = {}

    def expect(seq: list[int]) -> torch.Tensor:
        if tuple(seq) not in hf_logits:
            hf_logits[tuple(seq)] = hf(torch.tensor([seq])).logits[0]
        return hf_logits[tuple(seq)]
    seqs = [prompts[2], prompts[4], prompts[6]]  # 17, 30, 22 tokens
    pool, tables = PagePool(64, 5), [[] for _ in seqs]

    def check(batch, wanted):  # wanted: per row, (sequence, row of HF's logits)
        got = ours.logits(batch, torch.arange(batch.input_ids.shape[0]))
        for r, (seq, at) in enumerate(wanted):
            assert (got[r] - expect(seq)[at]).abs().max().item() < tol, f"row {r}"

    check(rows(pool, tables, seqs, [0] * 3), [(s, i) for s in seqs for i in range(len(s))])  # prefill
    decoded = [s + [7 + b] for b, s in enumerate(seqs)]
    check(rows(pool, tables, [[7], [8], [9]], [len(s) for s in seqs]), [(d, -1) for d in decoded])
    chains = [[11, 12, 13, 14], [15, 16, 17, 18], [19, 20, 21, 22]]  # verify k + 1 = 4 rows
    check(rows(pool, tables, chains, [len(d) for d in decoded]),
          [(d + c, len(d) + j) for d, c in zip(decoded, chains) for j in range(4)])
    parents = [[-1, 0, 0, 1, 2, 3, 4], [-1, -1, 1, 2, 0], [-1, 0, 1, 2, 3, 4, 5]]
    trees = [[30 + j for j in range(len(p))] for p in parents]
    batch = rows(pool, tables, trees, [len(d) for d in decoded], parents)
    check(batch, [(d + [t[j] for j in _path(p, i)], -1) for d, t, p in zip(decoded, trees, parents)
                  for i in range(len(p))])


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_speculative_output_equals_hf_greedy(arch, arch_models, prompts):
    """Chains (k = 3) and a draft tree, float64, behind a random EAGLE-3 head."""
    folder, head = arch_models(arch)
    hf = hf_model(folder, arch)
    engine = local_engine(folder, head)
    cases = [(prompts[1], SamplingParams(max_tokens=14, num_speculative_tokens=3)),
             (prompts[5], SamplingParams(max_tokens=14, num_speculative_tokens=6, draft_topk=2, draft_depth=3))]
    results = engine.generate([p for p, _ in cases], [sp for _, sp in cases])
    for (prompt, sp), result in zip(cases, results):
        assert result.token_ids == hf_generate_greedy(hf, prompt, sp.max_tokens)
    assert engine.stats.draft_tokens > 0


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedArchitecture, match=r"'gpt2' \(GPT2LMHeadModel\) is not supported; "
                                                      r"supported model types: llama, mistral, qwen2"):
        TargetModel(tmp_path)


@pytest.mark.parametrize("arch", ARCHS)
def test_the_training_command_trains_a_head_for_every_architecture(arch, arch_models, prompts, tmp_path):
    """`python -m eagle_serve.train train` unchanged: a few steps on a two-row corpus, then the
    exported head serves greedy output equal to plain decoding."""
    from eagle_serve.train.__main__ import main

    folder, _ = arch_models(arch)
    engine = local_engine(folder)
    answers = engine.generate(prompts[:2], SamplingParams(max_tokens=10))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    with gzip.open(corpus / "shard-0000.jsonl.gz", "wt") as f:
        for i, (p, a) in enumerate(zip(prompts[:2], answers)):
            f.write(json.dumps({"prompt": str(i), "prompt_ids": p, "output_ids": a.token_ids}) + "\n")
    out = tmp_path / "head"
    main(["train", "--target", str(folder), "--corpus", str(corpus), "--work", str(tmp_path / "work"),
          "--out", str(out), "--steps", "3", "--draft-vocab", "64", "--tokens-per-batch", "32"])
    drafter = load_drafter(out, folder, dtype=torch.float64)
    assert drafter.head.version == 3 and drafter.feature_layers == (2, 2, 1)
    spec = local_engine(folder, out)
    got = spec.generate(prompts[:2], SamplingParams(max_tokens=10, num_speculative_tokens=2))
    assert [r.token_ids for r in got] == [a.token_ids for a in answers]


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float32", marks=pytest.mark.skipif(
    cpu_kernels() is None, reason="fp32 is row-invariant through eagle_serve/kernels/cpu.cpp (AVX2, FMA)"))])
@pytest.mark.parametrize("arch", [a for a in ARCHS if not ARCHITECTURES[model_type(a)].moe])
def test_verify_passes_reproduce_plain_decoding_bitwise(arch, dtype, arch_models, prompts):
    """The CPU paths stay row-invariant for every dense architecture (fused projections,
    windows, soft-caps): bf16 (and, with the C++ CPU kernels, fp32) speculative output (oracle
    drafts, chains and trees, three requests batched) is plain decoding's, token for token."""
    from eagle_serve.testing import TreeOracleDrafter

    folder, _ = arch_models(arch)
    seqs = [prompts[1], prompts[2], prompts[5]]
    plain = [r.token_ids for r in local_engine(folder, dtype=dtype, max_running=1).generate(
        seqs, SamplingParams(max_tokens=9))]
    engine = local_engine(folder, dtype=dtype, max_running=3)
    engine.drafter = TreeOracleDrafter([p + e for p, e in zip(seqs, plain)], engine.target.vocab_size)
    shapes = [SamplingParams(max_tokens=9, num_speculative_tokens=4),  # two verify rounds each
              SamplingParams(max_tokens=9, num_speculative_tokens=6, draft_topk=2, draft_depth=3),
              SamplingParams(max_tokens=9, num_speculative_tokens=3)]
    results = engine.generate(seqs, shapes)
    assert [r.token_ids for r in results] == plain
    assert max(r.acceptance_length for r in results) > 1.5


@pytest.mark.parametrize("arch", [a for a in ARCHS if not ARCHITECTURES[model_type(a)].moe])
@torch.inference_mode()
def test_every_dense_architecture_runs_fused_projections(arch, arch_models, prompts):
    """q/k/v in one linear and gate/up in one (whatever the GQA sizes): four linears per layer
    and the LM head per forward, with HF's logits (float64 linears are aten::linear calls)."""
    from torch.profiler import ProfilerActivity, profile

    folder, _ = arch_models(arch)
    ours = TargetModel(folder, dtype=torch.float64, num_pages=16, page_size=5)
    seq = prompts[3]
    batch = rows(PagePool(16, 5), [[]], [seq], [0])
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = ours.logits(batch, torch.tensor([len(seq) - 1]))
    assert {e.key: e.count for e in prof.key_averages()}["aten::linear"] == 4 * ours.num_layers + 1
    expected = hf_model(folder, arch)(torch.tensor([seq])).logits[0, -1]
    assert (got[0] - expected).abs().max().item() < TOLERANCE.get(arch, 1e-10)


STACKED = {"llama", "mistral", "qwen2", "phi3"}  # model types cpu_stack.CpuDecoderStack takes


@pytest.mark.skipif(cpu_kernels() is None, reason="the layer stack is eagle_serve/kernels/cpu.cpp's (AVX2, FMA)")
@pytest.mark.parametrize("arch", [a for a in ARCHS if not ARCHITECTURES[model_type(a)].moe])
@torch.inference_mode()
def test_the_one_call_cpu_layer_stack_gives_the_python_loops_bits(arch, arch_models, prompts):
    """fp32 on CPU, the layers of Llama-like targets run as one C++ call (cpu_stack.cpp); its
    final hidden states and EAGLE-3 features equal the Python loop's bitwise, for a prefill,
    decode rows beside chain and tree verify rows, on dense and on Q4_1/Q8_0 block weights
    (their 7+ row forwards on the dense ones). Other architectures keep the loop."""
    folder, _ = arch_models(arch)
    models = [TargetModel(folder, dtype=torch.float32, num_pages=32, page_size=5, feature_layers=(0, 2, 3))
              for _ in range(2)]
    loop, stacked = models
    loop.stack = None
    if model_type(arch) not in STACKED:
        assert stacked.stack is None
        return
    assert stacked.stack is not None
    pool, tables = PagePool(32, 5), [[], []]
    a, b = prompts[1][:9], prompts[2][:12]
    batches = [rows(pool, tables, [a, b], [0, 0]),                           # prefills
               rows(pool, tables, [[5], [7, 8, 9, 10]], [9, 12]),           # decode + a chain
               rows(pool, tables, [[3, 4, 5], [6, 7, 8, 9, 1, 2]], [10, 16],  # trees
                    parents=[[-1, 0, 0], [-1, 0, 1, 1, 0, 4]])]
    stacked._layers = lambda *args: pytest.fail("the Python loop ran")
    for weights in ("dense", "blocks"):
        if weights == "blocks":  # GGUF-exact weights: Q4_1 layers, Q8_0 MLP down projections
            for model in models:
                for plan, layer in zip(model.layers, model.hf.model.layers):
                    for m in (plan.qkv, layer.self_attn.o_proj, plan.gate_up, layer.mlp.down_proj):
                        kind = "q8_0" if m is layer.mlp.down_proj else "q4_1"
                        m.weight.copy_(gguf_weight(kind, *m.weight.shape))
                        assert m.find_blocks().kind == kind
            stacked.stack = stacked.cpu_stack()
        for batch in batches:
            assert all(torch.equal(x, y) for x, y in zip(stacked.hidden_states(batch), loop.hidden_states(batch)))
    big = rows(pool, tables, [list(range(1, 9)), [4]], [19, 22])  # 9 rows: the dense weights
    assert all(torch.equal(x, y) for x, y in zip(stacked.hidden_states(big), loop.hidden_states(big)))

"""Small models for tests and for exact-equality server runs: no weights downloaded.

`make_tiny_target` writes a random model of any supported architecture (`make_tiny_llama`: a
Llama with GQA) as an ordinary HF folder with a tokenizer (`write_tiny_tokenizer`'s, built here
without the converted default model, or a given model's), so the same code path serves it;
float64 makes greedy near-ties impossible in practice. `write_head_layout` writes a head the way
each published tool lays it out. `OracleDrafter` proposes the target's true greedy
continuation with injected mistakes, so multi-token acceptance and KV rollback really run in
tests.
"""
from __future__ import annotations

import itertools
import json
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from eagle_serve.core.interfaces import DraftOutput, DraftShapes, RaggedBatch, RowSampling
from eagle_serve.cpu.quant import round_to_q8_0
from eagle_serve.local import build_local_engine
from eagle_serve.models.checkpoints import read_target_tensor, save_head
from eagle_serve.models.heads import EagleHead, random_head
from eagle_serve.models.target import load_target_config
from eagle_serve.settings import model_vocab_size

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # ids 0, 1 (BOS), 2 (EOS)
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                 "'<|im_end|>\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

# Tiny configs of every supported architecture (name -> transformers config class, fields),
# each quirk switched on so that a test notices when it is dropped: windows shorter than the
# test prompts, small soft-caps, partial rotary, routed experts; biases and norm weights are
# drawn at random (HF initialises them to zeros and ones).
GEMMA_TINY = dict(head_dim=16, sliding_window=6, query_pre_attn_scalar=24, tie_word_embeddings=True)
TINY_ARCHITECTURES: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=7)),
    "qwen2": ("Qwen2Config", {}),
    "qwen2-sliding": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=7, max_window_layers=2)),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": ("Gemma2Config", dict(GEMMA_TINY, attn_logit_softcapping=2.0, final_logit_softcapping=5.0)),
    "gemma3": ("Gemma3TextConfig", dict(GEMMA_TINY, layer_types=["sliding_attention", "full_attention"] * 2,
                                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                                         "full_attention": {"rope_type": "default", "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", dict(partial_rotary_factor=0.5, sliding_window=9)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=9)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                         mlp_only_layers=[1], norm_topk_prob=True)),
}


# The tiny models' vocabulary unless they carry a real model's tokenizer: small, since the LM
# head, softmax and sampling over the vocabulary are most of a tiny model's arithmetic, yet
# holding every pair of printable characters (write_tiny_tokenizer: texts have several
# tokenizations, as grammar tests need) and above the random heads' draft vocabularies (4096).
TINY_VOCAB = 12288


def make_tiny_target(dest: str | Path, arch: str = "llama", *, vocab_size: int | None = None,
                     hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                     num_kv_heads: int = 2, seed: int = 0, dtype=torch.float64,
                     tokenizer_from: Path | None = None, random_norms_and_biases: bool = True,
                     **fields) -> Path:
    """A seeded random model of TINY_ARCHITECTURES[arch] saved as an HF folder (kept if there),
    with write_tiny_tokenizer's tokenizer of `vocab_size` (default TINY_VOCAB) ids, or a copy of
    the one in the folder `tokenizer_from` (`vocab_size` default: that model's)."""
    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    if vocab_size is None:
        vocab_size = TINY_VOCAB if tokenizer_from is None else model_vocab_size(tokenizer_from)
    torch.manual_seed(seed)
    config_class, quirks = TINY_ARCHITECTURES[arch]
    config = getattr(transformers, config_class)(**(dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
        pad_token_id=0, tie_word_embeddings=False) | quirks | fields))
    model = AutoModelForCausalLM.from_config(config).to(dtype)
    with torch.no_grad():
        if random_norms_and_biases:
            for name, p in model.named_parameters():
                if p.ndim == 1 and ("norm" in name or name.endswith("bias")):
                    p.add_(torch.empty_like(p).uniform_(-0.5, 0.5))
        model.lm_head.weight.mul_(8.0)  # larger logits than the default init: fewer near-ties
    model.save_pretrained(dest)
    if tokenizer_from is None:
        write_tiny_tokenizer(dest, vocab_size)
    else:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_from) / name).exists():
                shutil.copy2(Path(tokenizer_from) / name, dest / name)
    return dest


def write_tiny_tokenizer(dest: str | Path, vocab_size: int) -> Path:
    """A byte-level BPE tokenizer of `vocab_size` ids (at least 3 + 256) with a ChatML template,
    built here: the special tokens, the 256 byte tokens, then every pair and as many triples of
    printable ASCII characters as fit, so that any id decodes to text (stop strings work on
    it) and any text encodes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = bytes_to_unicode()  # byte -> the character standing for it (space: "Ġ")
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + tuple(chars.values()))}
    text = [chars[b] for b in range(0x20, 0x7f)]
    pairs = ((a, b) for a in text for b in text)
    triples = ((a + b, c) for a in text for b in text for c in text)
    merges = []
    for left, right in itertools.islice(itertools.chain(pairs, triples), max(0, vocab_size - len(vocab))):
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tokenizer = Tokenizer(models.BPE(vocab, merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=SPECIAL_TOKENS[0],
                                      bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2],
                                      pad_token=SPECIAL_TOKENS[2])
    wrapped.chat_template = CHAT_TEMPLATE
    wrapped.save_pretrained(dest)
    return Path(dest)


def hf_generate_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """Exactly `num_tokens` ids of Hugging Face greedy `generate` after `prompt` (EOS ignored):
    what the engine's greedy output must equal."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0,
                             max_new_tokens=num_tokens, min_new_tokens=num_tokens)
    return out[0, len(prompt):].tolist()


def make_tiny_llama(dest: str | Path, *, tie_word_embeddings: bool = False, **kw) -> Path:
    """The tiny Llama of the engine and server tests (HF's initialisation of norms)."""
    return make_tiny_target(dest, "llama", random_norms_and_biases=False,
                            tie_word_embeddings=tie_word_embeddings, **kw)


def make_random_head(dest: str | Path, target_dir: str | Path, version: int, *,
                     draft_vocab_size: int | None = None, fc_bias: bool = False, with_d2t=True,
                     fmt: str = "safetensors", seed: int = 0) -> Path:
    """A random head in the published EAGLE-1/EAGLE-3 layout. For EAGLE-3 with a reduced
    vocabulary the draft ids map to every other target id (a non-trivial d2t)."""
    target_config = load_target_config(target_dir)
    d2t = None
    if draft_vocab_size and draft_vocab_size < target_config.vocab_size:
        d2t = torch.arange(draft_vocab_size, dtype=torch.int64)  # draft i -> target 2i
    head = random_head(target_config, version, draft_vocab_size, fc_bias=fc_bias, seed=seed, d2t=d2t)
    return save_head(head, dest, fmt=fmt, vocab_maps=with_d2t)


# ---- heads as the published tools write them ----

HEAD_LAYOUTS = ("eagle1", "eagle3", "specforge", "speculators")


def write_head_layout(head: EagleHead, dest: str | Path, layout: str, target_dir: str | Path, *,
                      embed: torch.Tensor | None = None, extra_config: dict | None = None) -> Path:
    """Write `head` with exactly the key names and config fields of `layout`:
    eagle1 - yuhuili/EAGLE-* (pytorch_model.bin, `layers.{i}.*`, the target's embed_tokens);
    eagle3 - yuhuili/EAGLE3-* (pytorch_model.bin, `midlayer.*`, d2t, t2d);
    specforge - SpecForge's export (model.safetensors, `midlayer.*`, embed_tokens, d2t, t2d);
    speculators - vLLM speculators (model.safetensors, `layers.{i}.*`, embed_tokens, d2t, t2d,
    `transformer_layer_config`, `speculators_config`).
    embed: the embedding to ship (default: the target's); extra_config: fields to add or
    override (None values remove a field)."""
    dest, target_dir = Path(dest), Path(target_dir)
    dest.mkdir(parents=True, exist_ok=True)
    spec, target = head.spec, load_target_config(target_dir)
    state, _ = head.published()  # EAGLE-3: with t2d
    if embed is None:
        embed = read_target_tensor(target_dir, ["model.embed_tokens.weight"])
    if layout != "eagle3":
        state["embed_tokens.weight"] = embed.to(state["fc.weight"].dtype).contiguous()
    if layout in ("eagle3", "specforge"):
        state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in state.items()}
    layer = dict(hidden_act="silu", hidden_size=spec.hidden_size, intermediate_size=spec.layer.intermediate_size,
                 num_attention_heads=spec.layer.num_attention_heads, head_dim=spec.head_dim,
                 num_key_value_heads=spec.layer.num_key_value_heads, num_hidden_layers=head.num_layers,
                 rms_norm_eps=spec.layer.rms_norm_eps, rope_theta=spec.layer.rope_parameters["rope_theta"],
                 rope_scaling=None, max_position_embeddings=4096, vocab_size=target.vocab_size,
                 attention_bias=spec.o_bias, mlp_bias=spec.mlp_bias, tie_word_embeddings=False,
                 bos_token_id=1, eos_token_id=2, torch_dtype="float16", model_type="llama")
    if layout == "eagle1":
        config = layer | {"architectures": ["LlamaForCausalLM"], "pad_token_id": 0,
                          **({"qkv_bias": True} if spec.qkv_bias else {})}
    elif layout in ("eagle3", "specforge"):
        config = layer | {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": spec.draft_vocab_size}
    else:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.3.0", "draft_vocab_size": spec.draft_vocab_size,
                  "norm_before_residual": spec.norm_before_residual, "norm_before_fc": False,
                  "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
                  "target_hidden_size": spec.target_hidden_size,
                  "eagle_aux_hidden_state_layer_ids": list(spec.feature_layers),
                  "transformer_layer_config": layer | {"model_type": "qwen3" if spec.qk_norm else "llama"},
                  "speculators_config": {
                      "algorithm": "eagle3", "default_proposal_method": "greedy",
                      "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                            "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                      "verifier": {"name_or_path": str(target_dir), "architectures": target.architectures}},
                  "torch_dtype": "float16"}
    for key, value in (extra_config or {}).items():
        config.pop(key) if value is None else config.__setitem__(key, value)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    if layout in ("eagle1", "eagle3"):
        torch.save(state, dest / "pytorch_model.bin")
    else:
        save_file(state, str(dest / "model.safetensors"))
    return dest


class OracleDrafter:
    """Drafts the known greedy continuation, wrong at positions where `wrong(position)` holds.

    sequences: prompt + greedy output of every request it will see; a request is recognised by
    the tokens of its catch-up rows. Greedy requests only.
    """

    def __init__(self, sequences: list[list[int]], vocab_size: int, wrong=lambda pos: pos % 5 == 0):
        self.sequences, self.vocab_size, self.wrong = sequences, vocab_size, wrong
        self.feature_layers = None

    def _find(self, row_tokens: list[int], end: int) -> list[int]:
        n = len(row_tokens)
        for seq in self.sequences:
            if len(seq) > end and seq[end - n + 1:end + 1] == row_tokens:
                return seq
        raise AssertionError("oracle does not know this request")

    def propose(self, batch: RaggedBatch, features: torch.Tensor, shapes: DraftShapes,
                sampling: RowSampling) -> DraftOutput:
        """Chains only (topk and depth are ignored; see TreeOracleDrafter)."""
        assert not bool(sampling.sampled.any()), "the oracle drafts greedy requests only"
        cu, ks = batch.cu_seqlens.tolist(), shapes.num_drafts.tolist()
        tokens = torch.full((len(ks), max(ks, default=0)), -1, dtype=torch.int64)
        for b, k in enumerate(ks):
            end = int(batch.seq_lens[b])  # the last known token sits at position `end`
            seq = self._find(batch.input_ids[cu[b]:cu[b + 1]].tolist(), end)
            for j in range(k):
                pos = end + 1 + j
                true = seq[pos] if pos < len(seq) else 0
                tokens[b, j] = (true + 1) % self.vocab_size if self.wrong(pos) else true
        return DraftOutput(tokens=tokens, probs=torch.zeros((0, self.vocab_size)))


class TreeOracleDrafter(OracleDrafter):
    """Like OracleDrafter, but a request asking for topk > 1 gets a tree whose true branch is
    never the first: every node on the path has topk - 1 decoy children (leaves) before the
    true one, so an accepted path is not stored contiguously and its KV has to move. Nodes in
    depth-first order, cut at num_drafts[b]."""

    def propose(self, batch: RaggedBatch, features: torch.Tensor, shapes: DraftShapes,
                sampling: RowSampling) -> DraftOutput:
        chains = super().propose(batch, features, shapes, sampling)
        if not bool((shapes.topk > 1).any()):
            return chains
        cu, ks = batch.cu_seqlens.tolist(), shapes.num_drafts.tolist()
        tokens = torch.full((len(ks), max(ks, default=0)), -1, dtype=torch.int64)
        parents = torch.full_like(tokens, -1)
        tokens[:, :chains.tokens.shape[1]] = chains.tokens
        parents[:, :chains.tokens.shape[1]] = torch.arange(chains.tokens.shape[1]) - 1
        for b, (k, width, levels) in enumerate(zip(ks, shapes.topk.tolist(), shapes.depth.tolist())):
            if width <= 1:
                continue
            end = int(batch.seq_lens[b])
            seq = self._find(batch.input_ids[cu[b]:cu[b + 1]].tolist(), end)
            nodes: list[tuple[int, int]] = []  # (token, parent)
            parent = -1
            for d in range(1, levels + 1):
                pos = end + d
                true = seq[pos] if pos < len(seq) else 0
                nodes += [((true + 1 + c) % self.vocab_size, parent) for c in range(width - 1)]
                token = (true + width + 7) % self.vocab_size if self.wrong(pos) else true
                nodes.append((token, parent))
                parent = len(nodes) - 1
            nodes = nodes[:k]
            tokens[b, :len(nodes)] = torch.tensor([t for t, _ in nodes])
            parents[b, :len(nodes)] = torch.tensor([p for _, p in nodes])
            tokens[b, len(nodes):] = parents[b, len(nodes):] = -1
        return DraftOutput(tokens=tokens, probs=chains.probs, parents=parents)


# Unit tests pin the engine to chains of k = 4, unpruned, on small caches, whatever the served
# defaults are (tests that mean "as served" use EngineConfig.served / build_local_engine), and
# to the static draft costs (shapes that never depend on timings).
TEST_ENGINE = dict(num_speculative_tokens=4, draft_topk=1, draft_depth=0, max_tree_batch=0,
                   draft_min_prob=0.0, draft_expand_prob=0.0, num_target_pages=256,
                   num_drafter_pages=256, num_draft_slots=128, eos_token_ids=(), lookup_tokens=0, sampled_lookup_tokens=0,
                   sampled_draft_depth=8, draft_call_cost=0.0, draft_step_cost=0.0,
                   measured_draft_costs=False, max_draft_batch=0, max_sampled_draft_batch=0,
                   sampled_verify="rejection")


def tiny_engine(target_dir: str | Path, head_dir: str | Path | None = None, *, dtype="float64",
                **overrides):
    """An in-process engine on a tiny model (float64) with TEST_ENGINE's settings."""
    return build_local_engine(target_dir, head_dir, dtype=dtype, **{**TEST_ENGINE, **overrides})


def local_engine(target_dir: str | Path, head_dir: str | Path | None = None, *, dtype="float64",
                 **overrides):
    """An in-process engine with the served settings (not TEST_ENGINE's), no EOS and 64 KV
    pages, unless `overrides` say otherwise: the default cache (1 GiB, zeroed) costs a tiny
    model more than its run."""
    return build_local_engine(target_dir, head_dir, dtype=dtype,
                              **{"eos_token_ids": (), "num_target_pages": 64, **overrides})


def assert_drafts_verify_to_plain(engine, prompts: list[list[int]], max_tokens: int = 16) -> list:
    """Greedy chains and trees on `engine` give exactly its plain decoding's tokens, and draft
    -> plain decoding's token lists."""
    from eagle_serve.core.requests import SamplingParams

    plain = [r.token_ids for r in engine.generate(prompts, SamplingParams(max_tokens=max_tokens,
                                                                          num_speculative_tokens=0))]
    for shape in (dict(num_speculative_tokens=3), dict(num_speculative_tokens=8, draft_topk=4, draft_depth=3)):
        drafted = engine.stats.draft_tokens
        outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, **shape))
        assert [r.token_ids for r in outputs] == plain, shape
        assert engine.stats.draft_tokens > drafted, shape
    return plain


def q8_0_target(tiny_target: str | Path, folder: str | Path, rounding=round_to_q8_0) -> Path:
    """The tiny target with every linear rounded to Q8_0 (or by `rounding`, e.g.
    round_to_q4_1), in float32 (a GGUF-like target)."""
    folder = Path(folder)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float32)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.copy_(rounding(m.weight))
    model.save_pretrained(folder)
    for f in Path(tiny_target).iterdir():
        if "token" in f.name:
            shutil.copy(f, folder / f.name)
    return folder


def round_to_q4_1(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] fp32 (K a multiple of 32) -> a near Q4_1 weight as fp32, per block of 32:
    m = fp16(min), d = fp16((max - m) / 15), q = round((w - m) / d) in 0..15 with the block's
    smallest weight at 0 and its largest at 15 (as GGUF's quantizer maps them, so that
    cpu_quant.block_form finds the blocks), w = d * q + m."""
    n, k = weight.shape
    b = weight.detach().reshape(n, k // 32, 32)
    m = b.amin(-1, keepdim=True).to(torch.float16).float()
    d = ((b.amax(-1, keepdim=True) - m) / 15).to(torch.float16).float()
    q = ((b - m) / d).round().clamp(0, 15)
    q.scatter_(-1, b.argmin(-1, keepdim=True), 0.0)
    q.scatter_(-1, b.argmax(-1, keepdim=True), 15.0)
    return (d * q + m).reshape(n, k)


def gguf_weight(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """[n, k] fp32 as GGUF's dequantizer makes it: per block of 32, fp16 d (and m), integer q,
    w = d * q (+ m) computed in fp32 (d * q is exact there)."""
    g = torch.Generator().manual_seed(seed)
    blocks = (n, k // 32, 1)
    d = (torch.rand(blocks, generator=g) * 0.02 + 1e-4).to(torch.float16).float()
    if kind == "q8_0":
        q = torch.randint(-127, 128, (n, k // 32, 32), generator=g).float()
        q[..., 0] = 127  # the quantizer maps a block's largest magnitude to +-127
        return (d * q).reshape(n, k)
    m = (-torch.rand(blocks, generator=g) * 0.1).to(torch.float16).float()
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # the quantizer maps a block's min to 0 and its max to 15
    return (d * q + m).reshape(n, k)


def force_gpu_kernels(monkeypatch, use=lambda impl, tensor: impl != "ref") -> None:
    """Every dispatcher runs its Triton kernel (the GPU path), on CPU tensors too, through the
    interpreter (impl "ref" still the reference); the target's layers run fused."""
    from eagle_serve.kernels import layer_ops, paged_attention, rejection, sampling, workspace

    for module in (layer_ops, paged_attention, rejection, sampling, workspace):
        monkeypatch.setattr(module, "use_kernel", use)


@contextmanager
def reference_ops(monkeypatch):
    """Inside, every dispatcher runs its reference op, even under force_gpu_kernels: for a
    test's setup (a prompt's KV), which the interpreter takes seconds to run."""
    with monkeypatch.context() as patch:
        force_gpu_kernels(patch, lambda impl, tensor: False)
        yield


def ragged_prefill(prompts: list[list[int]], pool) -> RaggedBatch:
    """Prefill batch of several prompts; pages handed out interleaved so tables are not trivial."""
    tables = [[] for _ in prompts]
    for n in range(1, max(len(p) for p in prompts) + 1):
        for t, p in zip(tables, prompts):
            if n <= len(p):
                pool.grow(t, n)
    width = max(len(t) for t in tables)
    return RaggedBatch(
        input_ids=torch.tensor([x for p in prompts for x in p]),
        positions=torch.tensor([i for p in prompts for i in range(len(p))]),
        cu_seqlens=torch.tensor([0, *itertools.accumulate(map(len, prompts))]),
        seq_lens=torch.tensor([len(p) for p in prompts]),
        block_tables=torch.tensor([t + [-1] * (width - len(t)) for t in tables]),
        slot_mapping=torch.tensor([pool.slot(t, i) for t, p in zip(tables, prompts) for i in range(len(p))]))


def greedy_rows(rows: int) -> RowSampling:
    """Sampling parameters of `rows` greedy rows (the host knows none is sampled)."""
    return RowSampling(torch.zeros(rows), torch.zeros(rows, dtype=torch.int64), torch.ones(rows),
                       torch.zeros(rows, dtype=torch.int64), sampled_rows=torch.zeros(0, dtype=torch.int64))


ALPHA = 1e-6  # significance level of the statistical tests (fixed seeds: a failure is a bug)


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit over the cells with positive probability."""
    from scipy.stats import chi2

    n = counts.sum()
    support = probs > 0
    assert int(counts[~support].sum()) == 0, "a token with probability 0 was produced"
    expected = probs[support].double() * n
    stat = float(((counts[support].double() - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, int(support.sum()) - 1))


@contextmanager
def other_thread_count():
    """torch's CPU threads changed for the block: 1 where more run, else 2 (a test run with one
    thread per worker), so a result that must not depend on the thread count is compared
    across two counts either way."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        yield
    finally:
        torch.set_num_threads(threads)

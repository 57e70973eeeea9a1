"""Small models for tests and for exact-equality server runs: no weights downloaded.

`make_tiny_llama` writes a random Llama (GQA) as an ordinary HF folder with the default
model's tokenizer, so the same code path serves it; float64 makes greedy near-ties impossible
in practice. `OracleDrafter` proposes the target's true greedy continuation with injected
mistakes, so multi-token acceptance and KV rollback really run in tests.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from eagle_serve import paths
from eagle_serve.checkpoints import random_head, save_head
from eagle_serve.interfaces import DraftOutput, DraftShapes, RaggedBatch, RowSampling

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json", "generation_config.json")


def make_tiny_llama(dest: str | Path, *, vocab_size: int = 49152, hidden_size: int = 64,
                    num_layers: int = 4, num_heads: int = 4, num_kv_heads: int = 2,
                    seed: int = 0, dtype=torch.float64, tokenizer_from: Path | None = None,
                    tie_word_embeddings: bool = False) -> Path:
    dest = Path(dest)
    if (dest / "config.json").exists():
        return dest
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size,
                         intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         max_position_embeddings=4096, rope_theta=10000.0, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=tie_word_embeddings)
    model = LlamaForCausalLM(config).to(dtype)
    with torch.no_grad():  # larger logits than the default init: fewer near-ties, livelier text
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(dest)
    src = Path(tokenizer_from or paths.default_target_dir())
    for name in TOKENIZER_FILES:
        if (src / name).exists() and name != "generation_config.json":
            shutil.copy2(src / name, dest / name)
    return dest


def make_random_head(dest: str | Path, target_dir: str | Path, version: int, *,
                     draft_vocab_size: int | None = None, fc_bias: bool = False, with_d2t=True,
                     fmt: str = "safetensors", seed: int = 0) -> Path:
    """A random head in the published EAGLE-1/EAGLE-3 layout. For EAGLE-3 with a reduced
    vocabulary the draft ids map to every other target id (a non-trivial d2t)."""
    target_config = LlamaConfig.from_pretrained(str(target_dir))
    d2t = None
    if version == 3 and draft_vocab_size and draft_vocab_size < target_config.vocab_size:
        d2t = torch.arange(draft_vocab_size, dtype=torch.int64)  # draft i -> target 2i
    head = random_head(target_config, version, draft_vocab_size, fc_bias=fc_bias, seed=seed, d2t=d2t)
    return save_head(head, dest, fmt=fmt, vocab_maps=with_d2t)


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
# defaults are (tests that mean "as served" use EngineConfig.served / build_local_engine).
TEST_ENGINE = dict(num_speculative_tokens=4, draft_topk=1, draft_depth=0, max_tree_batch=0,
                   draft_min_prob=0.0, draft_expand_prob=0.0, num_target_pages=256,
                   num_drafter_pages=256, num_draft_slots=128, eos_token_ids=())


def tiny_engine(target_dir: str | Path, head_dir: str | Path | None = None, *, dtype="float64",
                **overrides):
    """An in-process engine on a tiny model (float64) with TEST_ENGINE's settings."""
    from eagle_serve.local import build_local_engine

    return build_local_engine(target_dir, head_dir, dtype=dtype, **{**TEST_ENGINE, **overrides})

"""Acceptance of a drafter on held-out prompts: with the real engine (greedy chains), and
teacher-forced (the unrolled training objective's per-step accuracy on held-out answers)."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from eagle_serve.core.requests import SamplingParams, acceptance_length
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.local import build_local_engine
from eagle_serve.models.dtypes import torch_dtype


def evaluate(head_dir: Path, target_dir: Path, prompts: list[str], k: int = 4,
             max_tokens: int = 96, batch: int = 1, dtype: str = "auto") -> dict:
    """-> tau (the acceptance length), per-position acceptance (the share of rounds that kept a
    chain's j-th draft, and so every draft before it), tokens/s of k and of k=0.
    dtype: of target and head (auto = what the server runs)."""
    # the head's own acceptance per chain position: unpruned chains of k every round, no lookup
    # branches, no cost rule (the served policy would draft less, or from the lookups instead)
    engine = build_local_engine(target_dir, head_dir, max_running=batch, dtype=dtype, corpus=None,
                                draft_min_prob=0.0, draft_expand_prob=0.0, lookup_tokens=0,
                                sampled_lookup_tokens=0, draft_call_cost=0.0, draft_step_cost=0.0,
                                measured_draft_costs=False, max_draft_batch=0)
    ids = [encode_prompt(engine.tokenizer, p) for p in prompts]
    timings = {}
    for kk in (0, k):
        start = time.perf_counter()
        results = engine.generate(ids, SamplingParams(max_tokens=max_tokens, num_speculative_tokens=kk,
                                                      draft_topk=1, draft_depth=kk or None))  # chains of k
        seconds = time.perf_counter() - start
        timings[kk] = sum(len(r.token_ids) for r in results) / seconds
        if kk == k:
            accepted = sum(r.last.num_accepted_tokens for r in results)
            rounds = sum(r.last.num_rounds for r in results)
    s = engine.stats
    per_position = [a / d if d else None for a, d in zip(s.accepted_per_position, s.drafted_per_position)][:k]
    return {"k": k, "tau": acceptance_length(accepted, rounds), "acceptance_per_position": per_position,
            "tokens_per_s": timings[k], "tokens_per_s_k0": timings[0],
            "speedup_in_process": timings[k] / timings[0], "prompts": len(prompts), "dtype": dtype,
            "drafts_by_source": dict(s.draft_tokens_by_source)}


@torch.inference_mode()
def teacher_forced_accuracy(head_dir: Path, target_dir: Path, prompts: list[str], work: Path,
                            max_tokens: int = 128, unroll: int = 3, dtype: str = "auto") -> dict:
    """Per-step accuracy of the unrolled head against the target's argmax along the target's own
    greedy answers to `prompts` in `dtype` (auto: what the server runs for this target; answers
    and features cached in `work`, one per dtype); a target token outside the draft vocabulary
    counts as a miss."""
    if dtype == "auto":
        dtype = str(torch_dtype("auto", target_dir=Path(target_dir))).removeprefix("torch.")
    from eagle_serve.models.checkpoints import load_head
    from eagle_serve.models.target import TargetModel
    from eagle_serve.train import trainer as T
    from eagle_serve.train.corpus import generate_corpus, read_corpus

    generate_corpus(work / "answers", target_dir, prompts, max_tokens=max_tokens, dtype=dtype)
    seqs = T.sequences(read_corpus(work / "answers"))
    head = load_head(head_dir, target_dir).float().eval()
    layers = head.spec.feature_layers
    data = T.compute_features(seqs, target_dir, work / f"features-{'-'.join(map(str, layers))}",
                              layers, dtype=dtype)
    target = TargetModel(target_dir, num_pages=1, page_size=16)
    t2d = T.target_to_draft(head.d2t.to(torch.int64), target.vocab_size)
    embed = target.embed_tokens.weight.detach().float()
    cfg = T.TrainConfig(unroll=unroll, noise=0.0)
    offsets = np.cumsum([0] + [len(s) for s, _ in seqs])
    hits, scored = np.zeros(unroll), np.zeros(unroll)
    for i, (seq, plen) in enumerate(seqs):
        rows = slice(offsets[i], offsets[i] + len(seq))
        f = torch.from_numpy(np.asarray(data.features[rows], dtype=np.float32))[None]  # [1, L, 3H]
        ids = torch.full((1, len(seq) + unroll + 1), -1, dtype=torch.int64)
        ids[0, :len(seq)] = torch.tensor(seq)
        argmax = torch.full_like(ids, -1)
        argmax[0, :len(seq)] = torch.from_numpy(np.asarray(data.labels[rows], dtype=np.int64))
        mask = torch.zeros(1, len(seq), dtype=torch.bool)
        mask[0, max(0, plen - 2):len(seq) - 2] = True
        _, accs = T.unrolled_loss(head, embed, f, ids, argmax, mask, t2d, cfg)
        hits += [h for h, _ in accs]
        scored += [n for _, n in accs]
    return {"rows": len(seqs), "positions": int(scored[0]), "dtype": dtype,
            "step_accuracy": [round(float(h / n), 4) for h, n in zip(hits, scored)]}

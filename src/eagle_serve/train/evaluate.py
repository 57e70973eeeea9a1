"""Acceptance of a drafter on held-out prompts, measured with the real engine (greedy chains)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from eagle_serve.engine import SamplingParams
from eagle_serve.local import build_local_engine
from eagle_serve.tokenization import encode_prompt


def heldout_prompts(path: Path) -> list[str]:
    return [json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()]


def evaluate(head_dir: Path, target_dir: Path, prompts: list[str], k: int = 4,
             max_tokens: int = 96, batch: int = 1) -> dict:
    """-> tau, per-position acceptance (given all earlier accepted), tokens/s of k and of k=0."""
    engine = build_local_engine(target_dir, head_dir, max_running=batch)
    ids = [encode_prompt(engine.tokenizer, p) for p in prompts]
    timings = {}
    for kk in (0, k):
        start = time.perf_counter()
        results = engine.generate(ids, SamplingParams(max_tokens=max_tokens, num_speculative_tokens=kk))
        seconds = time.perf_counter() - start
        timings[kk] = sum(len(r.token_ids) for r in results) / seconds
        if kk == k:
            tokens = sum(len(r.token_ids) for r in results)
            rounds = sum(r.last.num_rounds for r in results)
    s = engine.stats
    per_position = [a / d if d else None for a, d in zip(s.accepted_per_position, s.drafted_per_position)][:k]
    return {"k": k, "tau": tokens / rounds, "acceptance_per_position": per_position,
            "tokens_per_s": timings[k], "tokens_per_s_k0": timings[0],
            "speedup_in_process": timings[k] / timings[0], "prompts": len(prompts)}

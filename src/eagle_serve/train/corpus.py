"""Self-distillation corpus: the target's own answers (greedy, or sampled at a temperature with a
per-prompt seed) to the instruction set.

Generated with the project's engine (continuous batching, plain decoding) and written in
shards of gzip JSON lines {"prompt", "prompt_ids", "output_ids"}; a shard is written whole or
not at all, and prompts already in a shard are skipped, so an interrupted run resumes. The
token ids are small enough to commit; features are recomputed from them (trainer.compute_features).
"""
from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

from tqdm import tqdm

from eagle_serve.core.requests import SamplingParams
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.local import build_local_engine


def read_corpus(folder: Path) -> list[dict]:
    rows = []
    for shard in sorted(Path(folder).glob("shard-*.jsonl.gz")):
        with gzip.open(shard, "rt") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    return rows


def generate_corpus(folder: Path, target_dir: Path, prompts: list[str], *, max_tokens: int = 128,
                    batch: int = 32, shard_size: int = 128, limit: int | None = None,
                    temperature: float = 0.0, seed: int = 0, dtype: str = "float32") -> int:
    """Generate answers for prompts not yet in `folder`; -> number of new rows."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    done = {row["prompt"] for row in read_corpus(folder)}
    todo = [p for p in prompts if p not in done][:limit]
    if not todo:
        return 0
    engine = build_local_engine(target_dir, None, dtype=dtype, max_running=batch, num_target_pages=2048,
                                num_drafter_pages=1, max_model_len=1024, max_waiting=100_000)
    shard_id = len(list(folder.glob("shard-*.jsonl.gz")))
    bar = tqdm(total=len(todo), desc="self-distillation", unit="prompt")
    for start in range(0, len(todo), shard_size):
        chunk = todo[start:start + shard_size]
        ids = [encode_prompt(engine.tokenizer, p) for p in chunk]
        keep = [i for i, x in enumerate(ids) if len(x) + max_tokens <= 1024]
        params = [SamplingParams(max_tokens=max_tokens, num_speculative_tokens=0,
                                 temperature=temperature, seed=_seed(seed, chunk[i])) for i in keep]
        results = _run(engine, [ids[i] for i in keep], params, bar)
        rows = [{"prompt": chunk[i], "prompt_ids": ids[i], "output_ids": out}
                | ({"temperature": temperature, "seed": _seed(seed, chunk[i])} if temperature > 0 else {})
                for i, out in zip(keep, results)]
        tmp = folder / f".shard-{shard_id:04d}.tmp"
        with gzip.open(tmp, "wt") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        tmp.rename(folder / f"shard-{shard_id:04d}.jsonl.gz")
        shard_id += 1
        bar.set_postfix(tokens=engine.stats.rounds, shard=shard_id)
    bar.close()
    return len(todo)


def _seed(seed: int, prompt: str) -> int:
    """A sampled answer's seed: fixed by the run's seed and the prompt text."""
    return int.from_bytes(hashlib.sha1(f"{seed}:{prompt}".encode()).digest()[:4], "little")


def _run(engine, prompts, params, bar) -> list[list[int]]:
    """Generate with continuous batching (params: one per prompt), ticking the bar as requests finish."""
    index = {engine.add_request(p, q): i for i, (p, q) in enumerate(zip(prompts, params))}
    out: list[list[int]] = [[] for _ in prompts]
    while engine.has_work():
        for o in engine.step():
            out[index[o.request_id]] += o.new_token_ids
            bar.update(int(o.finished))
    return out

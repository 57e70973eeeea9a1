"""Self-distillation corpus: greedy answers are the target's, sampled ones are seeded per prompt."""
from __future__ import annotations

from eagle_serve.core.requests import SamplingParams
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.testing import local_engine
from eagle_serve.train.corpus import generate_corpus, read_corpus

PROMPTS = ["Why is the sky blue?", "Write a haiku about tea.", "What is 2 + 2?"]


def test_greedy_corpus_rows_are_the_engines_greedy_answers_and_a_rerun_resumes(tmp_path, tiny_target):
    assert generate_corpus(tmp_path / "c", tiny_target, PROMPTS[:2], max_tokens=8, batch=2, dtype="float64") == 2
    assert generate_corpus(tmp_path / "c", tiny_target, PROMPTS, max_tokens=8, batch=2, dtype="float64") == 1
    rows = {r["prompt"]: r for r in read_corpus(tmp_path / "c")}
    assert sorted(rows) == sorted(PROMPTS) and all("seed" not in r for r in rows.values())
    engine = local_engine(tiny_target)
    for p in PROMPTS:
        ids = encode_prompt(engine.tokenizer, p)
        assert rows[p]["prompt_ids"] == ids
        out = engine.generate([ids], SamplingParams(max_tokens=8, num_speculative_tokens=0))[0].token_ids
        assert rows[p]["output_ids"] == out[:len(rows[p]["output_ids"])]


def test_sampled_corpus_is_reproducible_for_a_seed_and_differs_across_seeds(tmp_path, tiny_target):
    def sample(folder, seed):
        generate_corpus(tmp_path / folder, tiny_target, PROMPTS, max_tokens=12, batch=3,
                        temperature=1.0, seed=seed, dtype="float64")
        return {r["prompt"]: (r["seed"], r["output_ids"]) for r in read_corpus(tmp_path / folder)}

    first, again, other = sample("a", 0), sample("b", 0), sample("c", 1)
    assert first == again
    assert all(first[p][0] != other[p][0] for p in PROMPTS)
    assert any(first[p][1] != other[p][1] for p in PROMPTS)

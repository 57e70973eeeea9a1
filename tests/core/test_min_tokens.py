"""min_tokens: EOS is masked in the target's logits on rows below a request's min_tokens, so the
output is exactly the target's with that mask, speculative or not: greedy equals plain
decoding and HF generate(min_new_tokens=...); sampled output follows the masked law."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_serve.core.requests import SamplingParams
from eagle_serve.kernels.sampling import compute_probs_ref
from eagle_serve.testing import (
    ALPHA,
    OracleDrafter,
    TreeOracleDrafter,
    chi2_pvalue,
    make_random_head,
    make_tiny_llama,
    tiny_engine,
)

MAX_TOKENS, MIN_TOKENS = 16, 6


class EosDecoyOracle(OracleDrafter):
    """Drafts the known output, but an EOS id wherever `wrong(position)` holds: a drafted EOS
    below min_tokens must be rejected."""

    def __init__(self, sequences, vocab_size, eos: int):
        super().__init__(sequences, vocab_size, wrong=lambda pos: pos % 3 == 0)
        self.eos = eos

    def propose(self, batch, features, shapes, sampling):
        out = super().propose(batch, features, shapes, sampling)
        for b, k in enumerate(shapes.num_drafts.tolist()):
            end = int(batch.seq_lens[b])
            for j in range(k):
                if self.wrong(end + 1 + j):
                    out.tokens[b, j] = self.eos
        return out


@pytest.fixture(scope="module")
def eos_ids(tiny_target, prompts):
    """EOS ids the plain greedy outputs of three prompts emit early (at outputs 2, 4 and 1)."""
    plain = tiny_engine(tiny_target).generate(prompts[:3], SamplingParams(max_tokens=8, num_speculative_tokens=0))
    ids = (plain[0].token_ids[2], plain[1].token_ids[4], plain[2].token_ids[1])
    assert len(set(ids)) == 3
    return ids


@pytest.fixture(scope="module")
def hf_min_new_tokens(tiny_target, eos_ids):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()

    def run(prompt: list[int], min_new_tokens: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=MAX_TOKENS, min_new_tokens=min_new_tokens,
                             eos_token_id=list(eos_ids), pad_token_id=0)
        return out[0, len(prompt):].tolist()
    return run


def greedy(k=0, min_tokens=MIN_TOKENS, **shape):
    return SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, min_tokens=min_tokens, **shape)


def test_eos_ends_the_unconstrained_output_before_min_tokens(tiny_target, prompts, eos_ids,
                                                             hf_min_new_tokens):
    engine = tiny_engine(tiny_target, eos_token_ids=eos_ids)
    results = engine.generate(prompts[:3], greedy(min_tokens=0))
    for prompt, r in zip(prompts, results):
        assert r.finish_reason == "stop" and len(r.token_ids) <= MIN_TOKENS
        assert r.token_ids[-1] in eos_ids
        assert r.token_ids == hf_min_new_tokens(prompt, 0)


def test_plain_greedy_with_min_tokens_equals_hf_generate_min_new_tokens(tiny_target, prompts, eos_ids,
                                                                        hf_min_new_tokens):
    engine = tiny_engine(tiny_target, eos_token_ids=eos_ids)
    results = engine.generate(prompts, greedy())
    for prompt, r in zip(prompts, results):
        assert r.token_ids == hf_min_new_tokens(prompt, MIN_TOKENS)
        assert not set(r.token_ids[:MIN_TOKENS]) & set(eos_ids)
        assert len(r.token_ids) > MIN_TOKENS
    assert any(r.finish_reason == "stop" for r in results)  # EOS still ends an output after min_tokens


@pytest.mark.parametrize("head_name", ["eagle1_head", "eagle3_head"])
@pytest.mark.parametrize("shape", [dict(k=1), dict(k=4), dict(k=6, draft_topk=2, draft_depth=3)],
                         ids=["chain-1", "chain-4", "tree-2x3"])
def test_speculative_greedy_with_min_tokens_equals_plain_decoding(request, tiny_target, prompts, eos_ids,
                                                                  head_name, shape):
    plain = tiny_engine(tiny_target, eos_token_ids=eos_ids).generate(prompts, greedy())
    engine = tiny_engine(tiny_target, request.getfixturevalue(head_name), eos_token_ids=eos_ids,
                         max_running=3)
    results = engine.generate(prompts, greedy(**shape))
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert engine.stats.draft_tokens > 0


@pytest.mark.parametrize("oracle", ["eos-decoys", "tree"])
def test_drafts_that_are_mostly_right_keep_min_tokens_exact(tiny_target, prompts, eos_ids, oracle):
    """Multi-token acceptance runs; the chain oracle drafts EOS every third position, which the
    masked target must reject below min_tokens."""
    expected = [r.token_ids for r in tiny_engine(tiny_target, eos_token_ids=eos_ids).generate(prompts, greedy())]
    engine = tiny_engine(tiny_target, eos_token_ids=eos_ids, max_running=4)
    sequences = [p + e for p, e in zip(prompts, expected)]
    if oracle == "tree":
        engine.drafter = TreeOracleDrafter(sequences, engine.target.vocab_size)
        params = greedy(k=6, draft_topk=2, draft_depth=3)
    else:
        engine.drafter = EosDecoyOracle(sequences, engine.target.vocab_size, eos_ids[0])
        params = greedy(k=4)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert max(r.acceptance_length for r in results) > 1.5


def test_min_tokens_above_max_tokens_is_refused(tiny_target):
    engine = tiny_engine(tiny_target)
    with pytest.raises(ValueError, match=r"min_tokens must be in \[0, max_tokens = 4\], got 5"):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, min_tokens=5))


def test_a_stop_string_inside_the_first_min_tokens_does_not_end_the_output(tiny_target, prompts):
    """The first output token's text as a stop string: without min_tokens the output is cut to
    nothing; with min_tokens = 3 the match is ignored and a later one may still stop it."""
    engine = tiny_engine(tiny_target)
    plain = engine.generate([prompts[0]], SamplingParams(max_tokens=8, num_speculative_tokens=0))[0]
    stop = engine.tokenizer.decode(plain.token_ids[:1])
    assert stop.strip(), "the first token must have visible text"
    cut = engine.generate([prompts[0]], SamplingParams(max_tokens=8, stop=(stop,)))[0]
    kept = engine.generate([prompts[0]], SamplingParams(max_tokens=8, stop=(stop,), min_tokens=3))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == []
    assert len(kept.token_ids) >= 3 and kept.token_ids[:3] == plain.token_ids[:3]


# ---- sampled requests: the masked target law, exactly ----

@pytest.mark.slow
def test_sampled_output_with_min_tokens_follows_the_target_law_with_eos_masked(tmp_path):
    """A 6-token vocabulary (drafts are often accepted, and often EOS): the four tokens of n
    seeded requests with min_tokens = 3 (EOS banned on the rows of a round's first two drafts
    too) against the exact joint law with EOS masked at the first three positions. Without
    min_tokens EOS ends outputs early (so the test can fail)."""
    target_dir = make_tiny_llama(tmp_path / "t6", vocab_size=6, seed=3)
    head_dir = make_random_head(tmp_path / "h6", target_dir, 1, seed=4)
    temperature, top_k, n, prompt, length = 3.0, 3, 3000, [1, 4, 2, 5], 4
    eos = 2  # among the target's top 3 after the prompt, and among the head's drafts
    assert exact_step_probs(target_dir, [prompt], temperature, top_k, eos=None)[0, eos] > 0.2

    def run(min_tokens, n):
        engine = tiny_engine(target_dir, head_dir, max_running=64, max_waiting=n,
                             num_draft_slots=512, eos_token_ids=(eos,))
        drafted = count_banned_eos_drafts(engine, eos, len(prompt), min_tokens)
        params = [SamplingParams(max_tokens=length, min_tokens=min_tokens, temperature=temperature,
                                 top_k=top_k, seed=i, num_speculative_tokens=2) for i in range(n)]
        return engine, engine.generate([prompt] * n, params), drafted

    _, free, _ = run(0, n // 10)  # a tenth of the requests shows it
    assert sum(len(r.token_ids) < length for r in free) > len(free) / 10  # EOS often comes first unmasked
    engine, results, drafted = run(3, n)
    assert all(len(r.token_ids) == length and eos not in r.token_ids[:3] for r in results)
    assert drafted[0] > 50  # the drafter proposed EOS below min_tokens; all were rejected
    s = engine.stats
    assert s.accepted_tokens > 0.1 * s.draft_tokens > 0 and s.accepted_tokens < s.draft_tokens
    counts = torch.zeros(6 ** length)
    for r in results:
        counts[sum(t * 6 ** (length - 1 - i) for i, t in enumerate(r.token_ids))] += 1
    joint = masked_joint(target_dir, prompt, temperature, top_k, eos, length, min_tokens=3)
    assert chi2_pvalue(counts, joint) > ALPHA  # nothing outside its support


def count_banned_eos_drafts(engine, eos: int, prompt_len: int, min_tokens: int) -> list[int]:
    """Wrap the drafter: -> [drafted EOS tokens whose output position is below min_tokens]."""
    count, propose = [0], engine.drafter.propose

    def wrapped(batch, features, shapes, sampling):
        out = propose(batch, features, shapes, sampling)
        for b, k in enumerate(shapes.num_drafts.tolist()):
            first = int(batch.seq_lens[b]) + 1 - prompt_len  # output position of draft 0
            count[0] += sum(int(out.tokens[b, j]) == eos and first + j < min_tokens for j in range(k))
        return out
    engine.drafter.propose = wrapped
    return count


def exact_step_probs(target_dir, seqs, temperature, top_k, eos: int | None) -> torch.Tensor:
    """[len(seqs), 6] next-token law after each sequence; EOS masked unless eos is None."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor(seqs)).logits[:, -1].clone()
    if eos is not None:
        logits[:, eos] = float("-inf")
    r = logits.shape[0]
    return compute_probs_ref(logits, torch.full((r,), temperature), torch.full((r,), top_k),
                             torch.ones(r)).double()


def masked_joint(target_dir, prompt, temperature, top_k, eos, length, min_tokens) -> torch.Tensor:
    """[6^length] P(t1 .. t_length), EOS masked at the first min_tokens positions (prefix-major
    order: index = sum t_i 6^(length-1-i))."""
    joint, prefixes = torch.ones(1, dtype=torch.float64), [[]]
    for pos in range(length):
        p = exact_step_probs(target_dir, [prompt + x for x in prefixes], temperature, top_k,
                             eos if pos < min_tokens else None)  # [6^pos, 6]
        joint = (joint.unsqueeze(1) * p).flatten()
        prefixes = [x + [t] for x in prefixes for t in range(6)]
    return joint

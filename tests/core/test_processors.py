"""Logits processors and logprobs are exact under speculation: a verify row sees the prompt, the
output and the drafts before it, as plain decoding does at that position. Greedy output with
each processor equals plain greedy output with it (chains, trees, drafts that are mostly
right), sampled output follows the processed target law (chi-square), and logprobs are plain
decoding's whatever was drafted."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_serve.core.processors import banned_words
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

MAX_TOKENS = 16


def processor_cases(plain_output: list[int]) -> dict[str, dict]:
    """Each processor, set so that it changes the tiny model's greedy output."""
    return {"repetition": dict(repetition_penalty=1.8),
            "frequency+presence": dict(frequency_penalty=1.5, presence_penalty=0.7),
            "logit_bias": dict(logit_bias=((plain_output[3], -50.0), (7, 3.0))),
            "stop_token_ids": dict(stop_token_ids=(plain_output[5],)),
            "min_tokens+stop_token_ids": dict(stop_token_ids=(plain_output[1],), min_tokens=4)}


@pytest.fixture(scope="module")
def unprocessed(tiny_target, prompts):
    return [r.token_ids for r in tiny_engine(tiny_target).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=0))]


def greedy(k=0, **kw):
    return SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, **kw)


@pytest.fixture(scope="module")
def processed(tiny_target, prompts, unprocessed):
    """case -> plain greedy decoding with that case's processors (each decoded once)."""
    cache: dict[str, list[list[int]]] = {}

    def get(case: str) -> list[list[int]]:
        if case not in cache:
            kw = processor_cases(unprocessed[0])[case]
            cache[case] = [r.token_ids for r in tiny_engine(tiny_target).generate(prompts, greedy(**kw))]
        return cache[case]
    return get


CASES = ["repetition", "frequency+presence", "logit_bias", "stop_token_ids", "min_tokens+stop_token_ids"]


@pytest.mark.parametrize("case", CASES)
def test_each_processor_gives_speculative_greedy_output_equal_to_plain(tiny_target, eagle1_head, prompts,
                                                                       unprocessed, processed, case):
    kw = processor_cases(unprocessed[0])[case]
    plain = processed(case)
    assert plain[0] != unprocessed[0]  # the processor acts
    engine = tiny_engine(tiny_target, eagle1_head, max_running=3)
    for shape in (dict(k=4), dict(k=6, draft_topk=2, draft_depth=3)):
        assert [r.token_ids for r in engine.generate(prompts, greedy(**shape, **kw))] == plain, shape
    assert engine.stats.draft_tokens > 0


@pytest.mark.parametrize("oracle", ["chain", "tree"])
@pytest.mark.parametrize("case", ["repetition", "frequency+presence"])
def test_penalties_see_the_drafts_before_each_row(tiny_target, prompts, unprocessed, processed, case, oracle):
    """Drafts that are mostly right get long runs accepted, each row penalising the drafts
    before it: exact only if every row sees its own path."""
    kw = processor_cases(unprocessed[0])[case]
    expected = processed(case)
    engine = tiny_engine(tiny_target, max_running=4)
    sequences = [p + e for p, e in zip(prompts, expected)]
    if oracle == "tree":
        engine.drafter = TreeOracleDrafter(sequences, engine.target.vocab_size)
        params = greedy(k=6, draft_topk=2, draft_depth=3, **kw)
    else:
        engine.drafter = OracleDrafter(sequences, engine.target.vocab_size)
        params = greedy(k=4, **kw)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert max(r.acceptance_length for r in results) > 1.5


def test_plain_repetition_penalty_equals_hf_generate(tiny_target, prompts):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    engine = tiny_engine(tiny_target)
    for prompt in prompts[:3]:
        ids = torch.tensor([prompt])
        hf = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_TOKENS,
                            min_new_tokens=MAX_TOKENS, repetition_penalty=1.8, pad_token_id=0)[0, len(prompt):]
        ours = engine.generate([prompt], greedy(repetition_penalty=1.8, ignore_eos=True))[0]
        assert ours.token_ids == hf.tolist()


def test_a_stop_token_id_ends_the_output_and_is_left_out(tiny_target, prompts, unprocessed):
    stop = unprocessed[0][5]
    first = unprocessed[0].index(stop)
    r = tiny_engine(tiny_target).generate([prompts[0]], greedy(stop_token_ids=(stop,)))[0]
    assert r.finish_reason == "stop" and r.token_ids == unprocessed[0][:first]


def test_bad_words_are_never_generated_and_speculation_keeps_them_exact(tiny_target, eagle1_head, prompts,
                                                                       unprocessed):
    engine = tiny_engine(tiny_target)
    tok = engine.tokenizer
    word, ids = next((w, out[i:i + 2]) for out in unprocessed for i in range(2, len(out) - 1)
                     if tok.encode(w := tok.decode(out[i:i + 2]), add_special_tokens=False) == out[i:i + 2])
    plain = engine.generate(prompts, greedy(bad_words=(word,)))
    assert [r.token_ids for r in plain] != unprocessed
    for r in plain:
        assert all(r.token_ids[i:i + len(ids)] != ids for i in range(len(r.token_ids)))
    spec = tiny_engine(tiny_target, eagle1_head).generate(prompts, greedy(k=4, bad_words=(word,)))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]


def test_a_bad_words_last_token_is_banned_only_after_its_other_tokens():
    words = ((5,), (1, 2, 3))
    assert banned_words(words, [9, 1], [2]) == [5, 3]    # the output and the row's drafts
    assert banned_words(words, [1, 2], []) == [5, 3]
    assert banned_words(words, [1], [9]) == [5]
    assert banned_words(words, [], [1]) == [5]            # too short


# ---- logprobs ----

def reference_logprobs(model, prompt: list[int], output: list[int], **kw) -> torch.Tensor:
    """[len(output), V] log-softmax of HF's logits before each output token, repetition
    penalty applied as HF does."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1:-1].clone()
    penalty = kw.get("repetition_penalty", 1.0)
    for i in range(len(output)):
        seen = torch.tensor(sorted(set(prompt + output[:i])))
        score = logits[i, seen]
        logits[i, seen] = torch.where(score > 0, score / penalty, score * penalty)
    return torch.log_softmax(logits, dim=-1)


@pytest.mark.parametrize("kw", [{}, dict(repetition_penalty=1.8)], ids=["plain", "repetition"])
def test_logprobs_are_the_targets_with_and_without_speculation(tiny_target, eagle1_head, prompts, kw):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    plain = tiny_engine(tiny_target).generate(prompts[:3], greedy(logprobs=5, **kw))
    engine = tiny_engine(tiny_target, max_running=3)
    sequences = [p + r.token_ids for p, r in zip(prompts, plain)]
    engine.drafter = OracleDrafter(sequences, engine.target.vocab_size)
    spec = engine.generate(prompts[:3], greedy(k=4, logprobs=5, **kw))
    assert max(r.acceptance_length for r in spec) > 1.5
    for prompt, a, b in zip(prompts, plain, spec):
        assert a.token_ids == b.token_ids
        la, lb = a.logprobs, b.logprobs
        assert len(la) == len(lb) == len(a.token_ids)
        ref = reference_logprobs(model, prompt, a.token_ids, **kw)
        for i, (x, y) in enumerate(zip(la, lb)):
            assert x.token_id == y.token_id == a.token_ids[i]
            assert x.logprob == pytest.approx(y.logprob, abs=1e-9)
            assert x.logprob == pytest.approx(float(ref[i, x.token_id]), abs=1e-6)
            assert [t for t, _ in x.top] == [t for t, _ in y.top] == ref[i].topk(5).indices.tolist()
            assert x.top[0] == (x.token_id, pytest.approx(x.logprob))  # greedy: the argmax


def test_logprobs_are_cut_with_the_output(tiny_target, prompts, unprocessed):
    stop = unprocessed[0][5]
    r = tiny_engine(tiny_target).generate([prompts[0]], greedy(stop_token_ids=(stop,), logprobs=0))[0]
    assert len(r.logprobs) == len(r.token_ids) and all(not x.top for x in r.logprobs)


@pytest.mark.parametrize("bad, message", [
    (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
    (dict(logit_bias=tuple((i, 1.0) for i in range(2000))), "at most 1024 entries"),
    (dict(logit_bias=((10 ** 6, 1.0),)), "logit_bias token ids must be in"),
    (dict(stop_token_ids=(-1,)), "stop_token_ids must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(bad_words=tuple(f"w{i}" for i in range(100))), "at most 64 bad_words")])
def test_out_of_range_processor_parameters_are_refused(tiny_target, bad, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine(tiny_target).add_request([5, 6, 7], SamplingParams(max_tokens=4, **bad))


# ---- sampled requests: the processed target law, exactly ----

@pytest.mark.parametrize("rule", ["coupled", "rejection"])
def test_sampled_output_with_penalties_and_min_p_follows_the_processed_law(tmp_path, rule):
    """A 6-token vocabulary: three tokens of n seeded requests with penalties, logit_bias and
    min_p against the exact joint law under the same processors (written here, after vLLM's
    formulas); the drafts are often accepted."""
    target_dir = make_tiny_llama(tmp_path / "t6", vocab_size=6, seed=3)
    head_dir = make_random_head(tmp_path / "h6", target_dir, 1, seed=4)
    kw = dict(repetition_penalty=1.6, frequency_penalty=0.6, presence_penalty=0.3, min_p=0.08,
              logit_bias=((4, 1.0),))
    temperature, n, prompt, length = 2.0, 3000, [1, 4, 2, 5], 3
    engine = tiny_engine(target_dir, head_dir, max_running=64, max_waiting=n, num_draft_slots=512,
                         sampled_verify=rule)
    params = [SamplingParams(max_tokens=length, temperature=temperature, seed=i, num_speculative_tokens=2,
                             ignore_eos=True, **kw) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    s = engine.stats
    assert s.accepted_tokens > 0.1 * s.draft_tokens > 0
    counts = torch.zeros(6 ** length)
    for r in results:
        counts[sum(t * 6 ** (length - 1 - i) for i, t in enumerate(r.token_ids))] += 1
    joint = processed_joint(target_dir, prompt, temperature, length, **kw)
    unprocessed = processed_joint(target_dir, prompt, temperature, length, repetition_penalty=1.0,
                                  frequency_penalty=0.0, presence_penalty=0.0, min_p=0.0, logit_bias=())
    assert (joint - unprocessed).abs().sum() > 0.2  # the processors change the law
    assert chi2_pvalue(counts, joint) > ALPHA  # nothing outside its support


def processed_joint(target_dir, prompt, temperature, length, *, repetition_penalty, frequency_penalty,
                    presence_penalty, min_p, logit_bias) -> torch.Tensor:
    """[6^length] P(t1 .. t_length) (prefix-major) under the processors."""
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    joint = torch.ones(1, dtype=torch.float64)
    seqs = [[]]
    for _ in range(length):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + s for s in seqs])).logits[:, -1].clone()
        for b, s in enumerate(seqs):
            for tok, bias in logit_bias:
                logits[b, tok] += bias
            for tok in set(prompt + s):
                v = logits[b, tok]
                logits[b, tok] = v / repetition_penalty if v > 0 else v * repetition_penalty
            for tok in set(s):
                logits[b, tok] -= frequency_penalty * s.count(tok) + presence_penalty
            if min_p:
                scaled = torch.softmax(logits[b] / temperature, dim=-1)
                logits[b, scaled < min_p * scaled.max()] = float("-inf")
        r = logits.shape[0]
        probs = compute_probs_ref(logits, torch.full((r,), temperature), torch.zeros(r, dtype=torch.int64),
                                  torch.ones(r)).double()
        joint = (joint.unsqueeze(1) * probs).reshape(-1)
        seqs = [s + [t] for s in seqs for t in range(6)]
    return joint


@pytest.mark.parametrize("chunking", [0, 5], ids=["whole-prompt", "budget-5"])
def test_prompt_logprobs_are_the_targets_raw_logprobs_of_each_prompt_token(tiny_target, eagle1_head, prompts,
                                                                           chunking):
    """Every prompt token but the first, from its position's raw logits, chunked or not; the
    prompt is computed even where the prefix cache holds it."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    engine = tiny_engine(tiny_target, eagle1_head, max_num_batched_tokens=chunking)
    long_prompt = prompts[1] * 6
    engine.generate([long_prompt], greedy(k=4))  # cached now
    r = engine.generate([long_prompt], greedy(k=4, prompt_logprobs=3))[0]
    assert r.last.num_cached_tokens == 0 and len(r.prompt_logprobs) == len(long_prompt) - 1
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([long_prompt])).logits[0, :-1], dim=-1)
    for i, x in enumerate(r.prompt_logprobs):
        assert x.token_id == long_prompt[i + 1]
        assert x.logprob == pytest.approx(float(ref[i, x.token_id]), abs=1e-6)
        assert [t for t, _ in x.top] == ref[i].topk(3).indices.tolist()

"""Scheduling: preemption, seeded sampling, stops, cancellation, refusals, no leaks."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_serve.core.requests import SamplingParams
from eagle_serve.engine import EngineBusy
from eagle_serve.testing import OracleDrafter, tiny_engine

MAX_TOKENS = 24


engine_for = tiny_engine


def sampled(seed, k=3, **kw):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, top_k=50,
                          seed=seed, num_speculative_tokens=k, **kw)


def test_too_few_pages_preempts_and_every_request_still_matches_its_solo_run(
        tiny_target, eagle3_head, prompts, hf_greedy):
    # 6 pages of 8 = 48 positions: the longest request alone needs ~45 + 24 + k.
    params = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k)
              for k in (3, 0, 2, 4, 1, 3, 0, 2)]
    solo = [engine_for(tiny_target, eagle3_head).generate([p], [sp])[0].token_ids
            for p, sp in zip(prompts, params)]
    engine = engine_for(tiny_target, eagle3_head, page_size=8, num_target_pages=12,
                        num_drafter_pages=12)
    results = engine.generate(prompts, params)
    assert engine.stats.preemptions > 0
    assert [r.token_ids for r in results] == solo == [hf_greedy(p, MAX_TOKENS) for p in prompts]
    assert engine.idle_counts() == {"target_pages_free": 12, "drafter_pages_free": 12,
                                    "draft_slots_free": 128}


def test_seeded_sampling_repeats_alone_batched_and_preempted(tiny_target, eagle3_head, prompts):
    params = [sampled(seed=100 + i, k=(i % 4)) for i in range(len(prompts))]
    alone = [engine_for(tiny_target, eagle3_head).generate([p], [sp])[0].token_ids
             for p, sp in zip(prompts, params)]
    batched = engine_for(tiny_target, eagle3_head).generate(prompts, params)
    assert [r.token_ids for r in batched] == alone
    tight = engine_for(tiny_target, eagle3_head, page_size=8, num_target_pages=12,
                       num_drafter_pages=12)
    preempted = tight.generate(prompts, params)
    assert tight.stats.preemptions > 0
    assert [r.token_ids for r in preempted] == alone
    other_seed = engine_for(tiny_target, eagle3_head).generate([prompts[0]], [sampled(seed=999)])
    assert other_seed[0].token_ids != alone[0]


def test_stop_string_is_cut_out_and_never_streamed(tiny_target, prompts, hf_greedy):
    engine = engine_for(tiny_target)
    full = hf_greedy(prompts[1], MAX_TOKENS)
    text = engine.tokenizer.decode(full, skip_special_tokens=True)
    stop = text[len(text) // 2: len(text) // 2 + 3]
    rid = engine.add_request(prompts[1], SamplingParams(max_tokens=MAX_TOKENS, stop=(stop,),
                                                        num_speculative_tokens=0))
    streamed, last = [], None
    while last is None or not last.finished:
        for out in engine.step():
            assert out.request_id == rid
            streamed += out.new_token_ids
            last = out
            assert stop not in engine.tokenizer.decode(streamed, skip_special_tokens=True)
    assert last.finish_reason == "stop"
    out_text = engine.tokenizer.decode(streamed, skip_special_tokens=True)
    assert text.startswith(out_text) and len(out_text) <= text.find(stop)
    assert full[:len(streamed)] == streamed


def test_eos_stops_unless_ignored(tiny_target, prompts, hf_greedy):
    full = hf_greedy(prompts[2], MAX_TOKENS)
    eos = full[5]
    engine = engine_for(tiny_target, eos_token_ids=(eos,))
    stopped = engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=0))
    assert stopped[0].finish_reason == "stop"
    assert stopped[0].token_ids == full[:full.index(eos) + 1]
    ignored = engine.generate([prompts[2]], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    assert ignored[0].token_ids == full and ignored[0].finish_reason == "length"


def test_cancel_mid_stream_frees_pages_and_slots(tiny_target, eagle3_head, prompts):
    engine = engine_for(tiny_target, eagle3_head)
    ids = [engine.add_request(p, sampled(seed=i)) for i, p in enumerate(prompts)]
    engine.step(), engine.step()
    engine.abort(ids[2])
    finals = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out.finish_reason
    assert finals[ids[2]] == "cancelled"
    assert sum(r == "length" for r in finals.values()) == len(prompts) - 1
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


def test_a_deferred_draft_streams_the_round_first_and_changes_no_token(
        tiny_target, eagle3_head, prompts, hf_greedy):
    # What spec_decode does: step(defer_draft=True), stream the outputs, then draft() (in
    # another thread there). Chains, a tree, sampling, a cancel and preemption (tight cache).
    params = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k)
              for k in (3, 0, 2, 4)]
    params += [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=4, draft_topk=3,
                              draft_depth=2), sampled(seed=7), sampled(seed=8, k=1), sampled(seed=9)]
    tight = dict(page_size=8, num_target_pages=12, num_drafter_pages=12)
    at_once = engine_for(tiny_target, eagle3_head, **tight).generate(prompts, params)
    engine = engine_for(tiny_target, eagle3_head, **tight)
    calls = []
    propose = engine.drafter.propose
    engine.drafter.propose = lambda *a, **kw: calls.append(1) or propose(*a, **kw)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    tokens = {i: [] for i in ids}
    finals, drafted_late = {}, 0
    while engine.has_work():
        before = len(calls)
        for out in engine.step(defer_draft=True):
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out.finish_reason
        assert len(calls) == before  # the round's tokens are out before any drafting
        engine.draft()
        drafted_late += len(calls) > before
        if len(finals) == 2 and ids[6] not in finals:
            engine.abort(ids[6])
    assert drafted_late > 0 and engine.stats.preemptions > 0
    assert finals[ids[6]] == "cancelled"
    for i, rid in enumerate(ids):
        if i != 6:
            assert tokens[rid] == at_once[i].token_ids
    assert [tokens[ids[i]] for i in range(5)] == [hf_greedy(p, MAX_TOKENS) for p in prompts[:5]]
    assert engine.idle_counts() == {"target_pages_free": 12, "drafter_pages_free": 12,
                                    "draft_slots_free": 128}


@pytest.mark.parametrize("params, message", [
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(temperature=-1), "temperature"),
    (SamplingParams(top_p=0), "top_p"),
    (SamplingParams(top_p=1.5), "top_p"),
    (SamplingParams(top_k=-2), "top_k"),
    (SamplingParams(num_speculative_tokens=99), "num_speculative_tokens"),
    (SamplingParams(max_tokens=5000), "max_model_len"),
])
def test_bad_requests_are_refused_with_a_clear_message(tiny_target, eagle3_head, params, message):
    engine = engine_for(tiny_target, eagle3_head)
    with pytest.raises(ValueError, match=message):
        engine.add_request([5, 6, 7], params)
    assert not engine.has_work()


def test_a_request_that_can_never_fit_the_cache_is_refused(tiny_target):
    engine = engine_for(tiny_target, page_size=8, num_target_pages=4, num_drafter_pages=4)
    with pytest.raises(ValueError, match="KV positions"):
        engine.add_request(list(range(10, 40)), SamplingParams(max_tokens=10))


def test_a_full_waiting_queue_says_busy(tiny_target):
    engine = engine_for(tiny_target, max_waiting=2)
    engine.add_request([5, 6], SamplingParams()), engine.add_request([5, 6], SamplingParams())
    with pytest.raises(EngineBusy, match="busy"):
        engine.add_request([5, 6], SamplingParams())


@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "abort"]), st.integers(0, 7),
                              st.integers(0, 4)), min_size=1, max_size=25))
def test_any_mix_of_finish_cancel_and_preempt_leaks_nothing(tiny_target, prompts, hf_greedy, ops):
    expected = [hf_greedy(p, MAX_TOKENS) for p in prompts]
    engine = engine_for(tiny_target, page_size=8, num_target_pages=10, num_drafter_pages=10,
                        num_draft_slots=12, max_running=4)
    engine.drafter = OracleDrafter([p + e for p, e in zip(prompts, expected)],
                                   engine.target.vocab_size)
    ids = []
    for op, which, k in ops:
        if op == "add":
            ids.append(engine.add_request(prompts[which], SamplingParams(
                max_tokens=8 + which, num_speculative_tokens=k)))
        elif op == "abort" and ids:
            engine.abort(ids[which % len(ids)])
        else:
            engine.step()
    while engine.has_work():
        engine.step()
    assert engine.idle_counts() == {"target_pages_free": 10, "drafter_pages_free": 10,
                                    "draft_slots_free": 12}


def test_max_tokens_minus_one_runs_to_the_end_of_the_context_or_of_the_cache(tiny_target, eagle3_head):
    from eagle_serve.core.requests import TO_THE_END
    prompt = [5, 6, 7, 8, 9]
    context = tiny_engine(tiny_target, eagle3_head, max_model_len=40)
    result = context.generate([prompt], SamplingParams(max_tokens=TO_THE_END, ignore_eos=True,
                                                       num_speculative_tokens=3))[0]
    assert len(result.token_ids) == 40 - len(prompt) and result.finish_reason == "length"
    small = tiny_engine(tiny_target, eagle3_head, num_target_pages=4, num_drafter_pages=4)  # 64 tokens
    result = small.generate([prompt], SamplingParams(max_tokens=TO_THE_END, ignore_eos=True,
                                                     num_speculative_tokens=3))[0]
    assert len(prompt) + len(result.token_ids) == 64 - (3 + 1)  # the pool less one round's drafts
    with pytest.raises(ValueError, match="max_model_len"):  # no room left for output
        context.add_request(list(range(3, 43)), SamplingParams(max_tokens=TO_THE_END))


def test_a_failure_only_batches_bring_about_ends_its_requests_after_a_few_isolations(
        tiny_target, eagle3_head, prompts):
    """A target call that fails whenever two requests verify drafts together (each passes
    alone): the batch is isolated, each request verifies its drafts alone and rejoins, and
    after MAX_ISOLATIONS such failures its requests fail with an internal error instead of
    looping; nothing leaks, and what did finish equals plain decoding."""
    from eagle_serve.engine import MAX_ISOLATIONS
    engine = tiny_engine(tiny_target, eagle3_head, max_running=4)
    idle = engine.idle_counts()
    plain = [r.token_ids for r in engine.generate(prompts[:3], SamplingParams(max_tokens=40, num_speculative_tokens=0))]
    forward, failures = engine.target.forward, []

    def flaky(batch, logit_rows, sampling, **kw):
        requests = len(batch.cu_seqlens) - 1
        if requests > 1 and logit_rows.numel() > requests:  # drafts of several requests
            failures.append(requests)
            raise RuntimeError("a kernel that breaks on this batch shape")
        return forward(batch, logit_rows, sampling, **kw)
    engine.target.forward = flaky
    params = SamplingParams(max_tokens=40, num_speculative_tokens=3, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    tokens, errors = {i: [] for i in ids}, {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.error:
                errors[out.request_id] = out.error
    assert 0 < len(failures) <= MAX_ISOLATIONS + 1
    assert errors and all("internal error" in e for e in errors.values())
    for i, want in zip(ids, plain):  # what was streamed is plain decoding's
        assert tokens[i] == want[:len(tokens[i])] and (i in errors or tokens[i] == want)
    assert engine.idle_counts() == idle

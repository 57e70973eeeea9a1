"""The draft policy follows each request's measured acceptance: a sampled chain takes the length
its acceptance pays for, a request whose drafts do not pay drafts nothing (and skips the drafter
call) until a probe round, and sampled chains can stop on a low-confidence q. Whatever it
chooses, the output stays the target's: greedy token for token, sampled in distribution, and
a seeded request independent of the batch and of preemption."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from eagle_serve.core.requests import AcceptanceRecord, Request, SamplingParams
from eagle_serve.settings import EngineConfig
from eagle_serve.spec import policy as drafting
from eagle_serve.spec.lookup import CONTEXT
from eagle_serve.spec.policy import MAX_PROBE_WAIT, PROBE_BUDGET, PROBE_EVERY, DraftPolicy, best_chain
from eagle_serve.testing import ALPHA, chi2_pvalue, make_random_head, make_tiny_llama, tiny_engine

MAX_TOKENS = 24


def record_drafter_calls(engine) -> list[list[int]]:
    """Wrap the drafter's propose: -> per call, the drafts asked of each row."""
    calls, propose = [], engine.drafter.propose

    def wrapped(batch, features, shapes, sampling):
        calls.append(shapes.num_drafts.tolist())
        return propose(batch, features, shapes, sampling)
    engine.drafter.propose = wrapped
    return calls


def test_the_best_chain_has_the_most_expected_tokens_per_unit_of_cost():
    for rate, call, step, depth in itertools.product((0.0, 0.2, 0.45, 0.7, 0.95), (0.0, 0.1, 0.5),
                                                     (0.05, 0.16, 0.4), (1, 2, 4)):
        def gain(d):
            return sum(rate ** i for i in range(d + 1)) / (1 + (call + d * step if d else 0))
        best = best_chain(rate, depth, call, step)
        assert gain(best) == max(gain(d) for d in range(depth + 1))
    assert best_chain(0.0, 4, 0.1, 0.16) == 0
    assert best_chain(0.99, 4, 0.0, 0.01) == 4
    assert best_chain(0.45, 1, 0.2, 0.2) == 1 and best_chain(0.45, 1, 0.2, 0.2, margin=0.1) == 0


def test_acceptance_estimates_follow_the_recent_rounds():
    record = AcceptanceRecord()
    assert record.rate(0.5, 4) == 0.5
    for _ in range(40):
        record.observe(offered=2, accepted=2)   # both drafts reached and accepted
    assert record.rate(0.5, 4) > 0.9
    for _ in range(40):
        record.observe(offered=2, accepted=0)   # only the first reached, rejected
    assert record.rate(0.5, 4) < 0.2   # the prior still counts 4 of ~14
    record.observe(offered=3, accepted=1)
    assert record.idle_rounds == 0


def policy_request(policy: DraftPolicy, params: SamplingParams) -> Request:
    k = policy.default_k(params, True)
    req = Request("r", 4, params, k, 0, None, [1, 2, 3, 4])
    policy.setup_request(req)
    return req


def test_a_sampled_chain_shortens_and_stops_as_its_acceptance_falls_and_probes_again():
    policy = DraftPolicy(EngineConfig.served(sampled_draft_depth=3, draft_call_cost=0.1,
                                             draft_step_cost=0.16, sampled_verify="rejection"))
    req = policy_request(policy, SamplingParams(temperature=0.7))

    def round_(accepted: int) -> int:
        nodes = policy.round_shape(req, 100, 1).nodes
        if nodes:
            req.acceptance.observe(nodes, min(accepted, nodes))
        else:
            req.acceptance.idle_rounds += 1
        return nodes
    lengths = [round_(3) for _ in range(4)]
    assert lengths[0] == 2 and lengths[-1] == 3        # the prior's length, then longer
    while lengths[-1] and len(lengths) < 40:
        lengths.append(round_(0))
    falling = lengths[3:]
    assert falling == sorted(falling, reverse=True) and falling[-1] == 0 and 1 in falling
    wait = math.ceil((0.1 + 0.16) / PROBE_BUDGET)  # a probe costs a call and a row
    waited = [round_(0) for _ in range(wait)]
    assert waited == [0] * (wait - 1) + [1]      # then one probe draft
    fixed = policy_request(policy, SamplingParams(temperature=0.7, draft_depth=2))
    fixed.acceptance = req.acceptance
    assert policy.round_shape(fixed, 100, 1).nodes == 2  # an explicit depth is kept


def probe_waits(policy: DraftPolicy, rounds: int) -> list[int]:
    """Rounds between the probes of a sampled request whose drafts never pay (a rejection-sampled
    chain under the policy's sampled_verify)."""
    req = policy_request(policy, SamplingParams(temperature=0.7))
    probed = []
    for round_ in range(1, rounds):
        if policy.round_shape(req, 1000, 1).nodes:
            probed.append(round_)
            req.acceptance.observe(offered=1, accepted=0)
        else:
            req.acceptance.idle_rounds += 1
    return [b - a for a, b in zip([0] + probed, probed)]


def test_probes_of_a_request_whose_drafts_never_pay_come_ever_less_often(monkeypatch):
    monkeypatch.setattr(drafting, "PROBE_BUDGET", 10.0)  # probes cheap enough for any wait
    waits = probe_waits(DraftPolicy(EngineConfig.served(draft_call_cost=1.2, draft_step_cost=0.1,
                                                         sampled_verify="rejection")), 160)
    assert waits[:4] == [PROBE_EVERY + 1, 2 * PROBE_EVERY + 1, 4 * PROBE_EVERY + 1, 8 * PROBE_EVERY + 1]
    assert set(waits[4:]) == {MAX_PROBE_WAIT + 1}


def test_a_costly_probe_waits_until_its_cost_is_a_small_share_of_the_rounds():
    """A probe that costs 1.3 plain rounds (a drafter call of 1.2, a verify row of 0.1) comes at
    most once in 1.3 / PROBE_BUDGET rounds, far beyond MAX_PROBE_WAIT."""
    waits = probe_waits(DraftPolicy(EngineConfig.served(draft_call_cost=1.2, draft_step_cost=0.1,
                                                         sampled_verify="rejection")), 400)
    assert len(waits) >= 3 and set(waits) == {math.ceil(1.3 / PROBE_BUDGET) + 1}


def test_a_request_never_probes_where_its_drafts_would_not_pay_even_if_nearly_always_accepted():
    """A chain of 2 accepted PROBE_RATE of the time gains 2.71 tokens a round: at a drafter call
    of 1.2 plain rounds (and 0.1 a row) that pays, at 2.0 it does not, and no probe is sent."""
    rate = drafting.PROBE_RATE
    assert best_chain(rate, 2, 1.2, 0.1) == 2 and best_chain(rate, 2, 2.0, 0.1) == 0
    assert probe_waits(DraftPolicy(EngineConfig.served(draft_call_cost=2.0, draft_step_cost=0.1,
                                                       sampled_verify="rejection")), 400) == []


def test_requests_that_share_a_drafter_call_draft_where_one_alone_would_not():
    """The drafter call's cost is split among the running requests: with cheap verify rows
    (no batch cost), a rate too low to pay for a call alone pays for a share of one."""
    policy = DraftPolicy(EngineConfig.served(draft_call_cost=0.2, draft_step_cost=0.05,
                                             draft_batch_cost=0.0, max_draft_batch=0))
    req = policy_request(policy, SamplingParams())  # a tree alone, chains in a batch
    req.acceptance = AcceptanceRecord(reached=100, accepted=20)  # rate ~0.2
    assert best_chain(0.2, 3, 0.2, 0.05) == 0 and best_chain(0.2, 3, 0.1, 0.05) == 1
    assert [policy.round_shape(req, 100, b).nodes for b in (1, 2, 4)] == [0, 1, 1]


def test_a_fuller_batch_drafts_shorter_chains_except_for_seeded_rejection_sampled_requests():
    """A seeded request verified by rejection sampling drafts as if alone (its output depends
    on its drafts, which must not depend on other traffic); under the served "auto" a seeded
    request is coupled instead (its output never depends on its drafts) and drafts by the load."""
    costs = dict(draft_call_cost=0.2, draft_step_cost=0.05, draft_batch_cost=0.08,
                 sampled_draft_depth=3, max_draft_batch=0, max_sampled_draft_batch=0)
    policy = DraftPolicy(EngineConfig.served(sampled_verify="rejection", **costs))
    greedy = policy_request(policy, SamplingParams())
    unseeded = policy_request(policy, SamplingParams(temperature=0.7))
    seeded = policy_request(policy, SamplingParams(temperature=0.7, seed=5))
    for req in (greedy, unseeded, seeded):
        req.acceptance = AcceptanceRecord(reached=100, accepted=40)
    chains = {b: [policy.round_shape(r, 100, b).nodes for r in (greedy, unseeded, seeded)]
              for b in (1, 2, 4, 8)}
    assert chains[1][0] == 8 and chains[2][0] == 2           # a tree alone, then chains
    sampled = [chains[b][1] for b in (1, 2, 4, 8)]
    assert sampled == sorted(sampled, reverse=True)          # dearer rows: shorter chains,
    assert sampled[0] > sampled[2] > sampled[3] == 0         # then none
    assert chains[8][0] == 0
    assert chains[1][2] == chains[8][2] == sampled[0]        # seeded: costed as if alone
    policy.config = EngineConfig.served(max_draft_batch=4, max_sampled_draft_batch=1,
                                        sampled_draft_depth=3, sampled_verify="rejection")
    assert [policy.round_shape(r, 100, 5).nodes for r in (greedy, unseeded, seeded)] == [0, 0, 3]
    assert [policy.round_shape(r, 100, 2).nodes for r in (greedy, unseeded, seeded)][1:] == [0, 3]
    assert policy.round_shape(greedy, 100, 4).nodes > 0

    assert EngineConfig.served().drafting.sampled_verify == "coupled"
    assert policy_request(DraftPolicy(EngineConfig.served(**costs)),
                          SamplingParams(temperature=0.7)).coupled  # with a random seed
    auto = DraftPolicy(EngineConfig.served(sampled_verify="auto", **costs))
    coupled = policy_request(auto, SamplingParams(temperature=0.7, seed=5))
    assert coupled.coupled and not policy_request(auto, SamplingParams(temperature=0.7)).coupled
    coupled.acceptance = AcceptanceRecord(reached=100, accepted=40)
    assert auto.round_shape(coupled, 100, 1).nodes > 0 == auto.round_shape(coupled, 100, 8).nodes
    auto.config = EngineConfig.served(sampled_verify="auto", max_sampled_draft_batch=1)
    assert auto.round_shape(coupled, 100, 2).nodes == 0      # beyond max_sampled_draft_batch


@pytest.mark.parametrize("lookup_tokens", [0, 4])
def test_a_request_whose_drafts_do_not_pay_skips_the_drafter_between_probes_and_stays_exact(
        tiny_target, eagle3_head, prompts, hf_greedy, lookup_tokens, monkeypatch):
    """Its head is probed again even where its context lookups draft every round (prompts
    that repeat themselves): the policy follows the head's own drafts."""
    # A drafter call costs two plain rounds here: one draft can never pay, so only probes draft
    # (made cheap enough to come every PROBE_EVERY rounds).
    monkeypatch.setattr(drafting, "PROBE_BUDGET", 10.0)
    engine = tiny_engine(tiny_target, eagle3_head, draft_call_cost=2.0, draft_step_cost=0.1,
                         max_running=4, lookup_tokens=lookup_tokens)
    calls = record_drafter_calls(engine)
    params = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=4)] * 4
    prompts = [p[:6] * 3 for p in prompts[:4]] if lookup_tokens else prompts[:4]
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in prompts]
    assert (engine.stats.draft_tokens_by_source[CONTEXT] > 0) == (lookup_tokens > 0)
    rounds = max(r.last.num_rounds for r in results)
    assert 0 < len(calls) <= rounds // PROBE_EVERY + 1   # probes only
    assert all(n == 1 for call in calls for n in call), calls   # a probe drafts one
    head_rounds = sum(len(call) for call in calls)   # lookups alone draft in the other rounds
    assert engine.stats.drafts == head_rounds if not lookup_tokens else engine.stats.drafts > head_rounds
    assert engine.idle_counts() == {"target_pages_free": 256, "drafter_pages_free": 256,
                                    "draft_slots_free": 128}


def test_adaptive_greedy_requests_with_preemption_stay_exact(tiny_target, eagle3_head, prompts,
                                                             hf_greedy):
    engine = tiny_engine(tiny_target, eagle3_head, draft_call_cost=0.3, draft_step_cost=0.2,
                         page_size=8, num_target_pages=12, num_drafter_pages=12)
    params = [SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k) for k in (3, 2, 4, 1)]
    results = engine.generate(prompts[:4], params)
    assert engine.stats.preemptions > 0
    assert [r.token_ids for r in results] == [hf_greedy(p, MAX_TOKENS) for p in prompts[:4]]


def sampled(seed, temperature=0.9, **kw):
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, top_p=0.95, top_k=50, seed=seed,
                          num_speculative_tokens=3, **kw)


ADAPTIVE = dict(draft_call_cost=0.1, draft_step_cost=0.16, sampled_draft_depth=3,
                sampled_draft_min_prob=0.13)


@pytest.mark.parametrize("lookup_tokens", [0, 4])
def test_adaptive_seeded_sampling_repeats_alone_batched_and_preempted(tiny_target, eagle3_head,
                                                                      prompts, lookup_tokens):
    # Prompts that repeat themselves, and a low temperature, so that context lookups fire.
    params = [sampled(seed=300 + i, temperature=0.05 if lookup_tokens else 0.9) for i in range(6)]
    prompts = [p[:6] * 3 for p in prompts[:6]]
    config = dict(ADAPTIVE, sampled_lookup_tokens=lookup_tokens)
    alone = [tiny_engine(tiny_target, eagle3_head, **config).generate([p], [sp])[0].token_ids
             for p, sp in zip(prompts, params)]
    together = tiny_engine(tiny_target, eagle3_head, **config)
    batched = together.generate(prompts, params)
    assert [r.token_ids for r in batched] == alone
    assert (together.stats.draft_tokens_by_source[CONTEXT] > 0) == (lookup_tokens > 0)
    tight = tiny_engine(tiny_target, eagle3_head, page_size=8, num_target_pages=12,
                        num_drafter_pages=12, **config)
    preempted = tight.generate(prompts, params)
    assert tight.stats.preemptions > 0
    assert [r.token_ids for r in preempted] == alone


@pytest.mark.parametrize("mode", ["coupled", "auto"])
def test_coupled_sampled_requests_give_plain_seeded_sampling_tokens_whatever_they_draft(tmp_path, mode):
    """Coupled verification keeps a draft only while it equals the target's seeded sample, so
    every seeded request's tokens are those of plain sampling (k = 0), token for token: with
    head chains, with head trees and lookup branches (accepted off the first path too), batched
    and preempted. A 6-token vocabulary and a looping prompt so that drafts are accepted.
    "auto" (served) couples the requests that give a seed, and only those."""
    target_dir = make_tiny_llama(tmp_path / "t6", vocab_size=6, seed=3)
    head_dir = make_random_head(tmp_path / "h6", target_dir, 1, seed=4)
    n, prompt = 48, [5, 0, 4, 5, 0, 4, 5, 0]

    def run(k: int, tree: dict | None = None, **config):
        engine = tiny_engine(target_dir, head_dir, sampled_verify=mode, max_running=16,
                             max_waiting=n, num_draft_slots=1024, **config)
        params = [SamplingParams(max_tokens=12, temperature=1.5, top_k=4, seed=i,
                                 num_speculative_tokens=k, **(tree or {})) for i in range(n)]
        return [r.token_ids for r in engine.generate([prompt] * n, params)], engine.stats

    plain, _ = run(0)
    assert len({tuple(t) for t in plain}) > n // 2  # sampled, not one greedy answer
    chains, s = run(3)
    assert chains == plain and s.accepted_tokens > 0.1 * s.draft_tokens > 0
    tree = dict(draft_topk=2, draft_depth=2)
    trees, s = run(4, tree, sampled_lookup_tokens=3)
    assert trees == plain and s.kv_moves > 0 and s.accepted_tokens_by_source[CONTEXT] > 0
    tight, s = run(4, tree, sampled_lookup_tokens=3, page_size=8, num_target_pages=12,
                   num_drafter_pages=12)
    assert tight == plain and s.preemptions > 0
    engine = tiny_engine(target_dir, head_dir, sampled_verify=mode)
    for params in (SamplingParams(temperature=1.5), SamplingParams(), SamplingParams(temperature=1.5, seed=1)):
        engine.add_request(prompt, params)
    engine.step()
    assert [r.coupled for r in engine.running] == [mode == "coupled", False, True]


def exact_law(target_dir, prompt: list[int], temperature: float, top_k: int, length: int
              ) -> torch.Tensor:
    """[6^length] the target's probability of each continuation of `length` tokens (6-token
    vocabulary, with temperature and top-k), in base-6 order."""
    from transformers import AutoModelForCausalLM

    from eagle_serve.kernels.sampling import compute_probs_ref

    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float64).eval()
    heads = list(itertools.product(range(6), repeat=length - 1))
    with torch.no_grad():
        logits = model(torch.tensor([prompt + list(h) for h in heads])).logits
    law = torch.ones(6 ** length, dtype=torch.float64)
    for i, seq in enumerate(itertools.product(range(6), repeat=length)):
        row = heads.index(seq[:-1]) if length > 1 else 0
        for j in range(length):
            probs = compute_probs_ref(logits[row:row + 1, len(prompt) - 1 + j], torch.tensor([temperature]),
                                      torch.tensor([top_k]), torch.ones(1)).double()[0]
            law[i] *= probs[seq[j]]
    return law


def assert_follows_exact_law(results, target_dir, prompt: list[int], temperature: float,
                             top_k: int) -> None:
    """The 4 tokens of each result (6-token vocabulary) against the target's exact joint law:
    nothing outside its support, and a chi-square p-value above 1e-6."""
    counts = torch.zeros(6 ** 4)
    for r in results:
        counts[sum(t * 6 ** (3 - j) for j, t in enumerate(r.token_ids))] += 1
    law = exact_law(target_dir, prompt, temperature, top_k, 4)
    assert chi2_pvalue(counts, law) > ALPHA  # nothing outside its support


@pytest.mark.slow
def test_sampled_chains_sized_by_acceptance_and_cut_by_confidence_follow_the_target_distribution(
        tmp_path):
    """A 6-token vocabulary so that draft and target overlap: the first four tokens of n
    seeded requests (a prompt round, then chains of up to 2) against the target's exact joint
    law, with chains sized by the request's acceptance and cut where q's top probability is
    low."""
    target_dir = make_tiny_llama(tmp_path / "t6", vocab_size=6, seed=3)
    head_dir = make_random_head(tmp_path / "h6", target_dir, 1, seed=4)
    temperature, top_k, n, prompt = 3.0, 3, 4000, [1, 4, 2, 5]
    engine = tiny_engine(target_dir, head_dir, max_running=64, max_waiting=n, num_draft_slots=512,
                         draft_call_cost=0.05, draft_step_cost=0.1, sampled_draft_depth=2,
                         sampled_draft_min_prob=0.13)
    calls = record_drafter_calls(engine)
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, seed=i,
                             num_speculative_tokens=2) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    s = engine.stats
    asked = sum(n for call in calls for n in call)
    assert {n for call in calls for n in call} == {1, 2}   # acceptance sized the chains
    assert 0 < s.draft_tokens < asked                      # q's top probability cut some
    assert s.accepted_tokens > 0.2 * s.draft_tokens > 0    # acceptance and rejection both ran
    assert_follows_exact_law(results, target_dir, prompt, temperature, top_k)


@pytest.mark.slow
def test_sampled_chains_with_lookup_branches_follow_the_target_distribution(tmp_path):
    """As above, with context lookups beside the head's chain (a prompt that repeats itself, so
    they fire): a tree whose lookup nodes are one-hot proposals, verified by recursive rejection
    sampling. The first four tokens of n seeded requests against the target's exact law."""
    target_dir = make_tiny_llama(tmp_path / "t6", vocab_size=6, seed=3)
    head_dir = make_random_head(tmp_path / "h6", target_dir, 1, seed=4)
    temperature, top_k, n, prompt = 3.0, 3, 4000, [5, 0, 4, 5, 0, 4, 5, 0]
    engine = tiny_engine(target_dir, head_dir, max_running=64, max_waiting=n, num_draft_slots=1024,
                         sampled_draft_depth=2, sampled_lookup_tokens=3)
    params = [SamplingParams(max_tokens=4, temperature=temperature, top_k=top_k, seed=i,
                             num_speculative_tokens=2) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    s = engine.stats
    assert s.accepted_tokens_by_source[CONTEXT] > 0.1 * s.draft_tokens_by_source[CONTEXT] > 0
    assert s.accepted_tokens_by_source["eagle"] > 0 and s.kv_moves > 0  # off the first path too
    assert_follows_exact_law(results, target_dir, prompt, temperature, top_k)

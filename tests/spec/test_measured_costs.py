"""Draft costs measured on the running machine (eagle_serve.spec.costs): the target's time as a line in
its row count and the drafter call's time become the policy's shares of a plain round, so dear
verify rows stop a busy batch from drafting and cheap ones let it draft; seeded rejection-sampled
requests keep the static costs; the engine records its calls, and its output stays exact."""
from __future__ import annotations

import pytest

from eagle_serve.core.requests import AcceptanceRecord, Request, SamplingParams
from eagle_serve.settings import EngineConfig
from eagle_serve.spec.costs import DECAY, FORGET, MIN_CALLS, MeasuredCosts
from eagle_serve.spec.lookup import CONTEXT, CORPUS, HEAD
from eagle_serve.spec.lookup_scores import MAX_PLACE, LookupKey, LookupScores
from eagle_serve.spec.policy import BATCH_MARGIN, MEASURED_MARGIN, DraftPolicy
from eagle_serve.testing import tiny_engine


def measured(intercept: float, slope: float, drafter: float, rows=range(1, 10)) -> MeasuredCosts:
    costs = MeasuredCosts()
    for _ in range(3):
        for r in rows:
            costs.record_target(r, intercept + slope * r)
    for _ in range(MIN_CALLS):
        costs.record_drafter(drafter)
    return costs


def test_rows_are_measured_once_two_row_counts_ran_and_the_drafter_call_once_enough_calls_did():
    costs = MeasuredCosts()
    for _ in range(20):
        costs.record_target(4, 0.04)
    for _ in range(MIN_CALLS):
        costs.record_drafter(0.01)
    assert costs.shares(4) is None  # one row count: no slope
    costs.record_target(6, 0.05)
    assert costs.shares(4) is not None
    assert measured(0.03, 0.002, 0.01, rows=[1, 2]).shares(1).call is not None
    few = MeasuredCosts()
    few.record_target(1, 0.03)
    few.record_target(2, 0.032)
    assert few.shares(1).call is None and few.shares(1).step == pytest.approx(0.002 / 0.03)
    few.record_drafter(0.01)
    assert few.shares(1).call is None  # one drafter call


def test_the_shares_are_the_drafter_call_and_a_row_of_every_request_against_the_plain_round():
    costs = measured(0.030, 0.002, 0.009)
    intercept, slope = costs.line()
    assert intercept == pytest.approx(0.030) and slope == pytest.approx(0.002)
    plain = 0.030 + 0.002 * 4
    shares = costs.shares(4)
    assert shares.call == pytest.approx(0.009 / plain)
    assert shares.step == pytest.approx(0.002 * 4 / plain)
    assert costs.shares(12).call == pytest.approx(0.009 / (0.030 + 0.002 * 12))  # off the line


def test_the_line_follows_the_row_counts_the_server_runs_not_a_few_slow_calls_of_many_rows():
    costs = measured(0.013, 0.0017, 0.005, rows=range(1, 4))
    for _ in range(100):  # a long run: 180 rounds of 1-3 rows for each one of 7-10 rows
        for _ in range(60):
            for r in range(1, 4):
                costs.record_target(r, 0.013 + 0.0017 * r)
        for r in range(7, 11):  # many rows, on a slower kernel
            costs.record_target(r, 0.043)
    intercept, slope = costs.line()
    assert slope == pytest.approx(0.0017)  # every row count alike: ~0.0038
    assert costs.shares(1).step == pytest.approx(slope / (0.013 + 0.0017))
    for _ in range(40):  # as often as the others: now they count
        for r in range(7, 11):
            costs.record_target(r, 0.043)
    assert costs.line()[1] > 0.003


def test_a_row_count_unseen_for_a_thousand_calls_is_forgotten_so_a_policy_that_stopped_drafting_measures_again():
    costs = measured(0.013, 0.009, 0.005, rows=range(1, 4))  # rows measured dear (a slow spell)
    assert costs.shares(1).step == pytest.approx(0.009 / 0.022)
    for _ in range(500):  # drafting nothing: one-row calls only
        costs.record_target(1, 0.013)
    assert costs.shares(1) is not None  # still within the last few hundred calls
    for _ in range(1000):
        costs.record_target(1, 0.013)
    assert costs.shares(1) is None  # stale: the static costs again, until rows are measured anew
    costs.record_target(2, 0.0145)
    assert costs.shares(1).step == pytest.approx(0.0015 / 0.013)


def test_a_row_count_back_on_the_call_it_would_be_forgotten_keeps_its_new_time_and_is_forgotten_later_cleanly():
    costs = MeasuredCosts()
    costs.record_target(1, 0.013)
    costs.record_target(2, 0.020)  # stale: a slow spell
    weight, calls = 1.0, 0
    while weight * DECAY >= FORGET:  # the one-row calls after which the next call forgets 2 rows
        weight, calls = weight * DECAY, calls + 1
    for _ in range(calls):
        costs.record_target(1, 0.013)
    costs.record_target(2, 0.0145)  # back on that very call: measured anew, not dropped
    assert costs.shares(1).step == pytest.approx(0.0015 / 0.013)
    for _ in range(calls + 1):
        costs.record_target(1, 0.013)
    assert costs.shares(1) is None  # unseen again for as long: forgotten


def request(policy: DraftPolicy, params: SamplingParams, rate_in_100: int) -> Request:
    k = policy.default_k(params, True)
    req = Request("r", 4, params, k, 0, None, [1, 2, 3, 4])
    policy.setup_request(req)
    req.acceptance = AcceptanceRecord(reached=100, accepted=rate_in_100)
    return req


def test_dear_verify_rows_stop_a_busy_batch_drafting_where_the_static_costs_would_draft():
    policy = DraftPolicy(EngineConfig.served(max_draft_batch=0))
    greedy = request(policy, SamplingParams(), 42)  # chains in a batch of 4
    assert policy.round_shape(greedy, 100, 4).nodes == 1  # static: one draft pays
    policy.costs = measured(0.032, 0.0023, 0.010)  # fp32 on a 2-core AVX2 CPU, roughly
    assert policy.round_shape(greedy, 100, 4).nodes == 0
    policy.costs = measured(0.032, 0.0001, 0.001)  # rows and drafter nearly free
    assert policy.round_shape(greedy, 100, 4).nodes >= 2
    policy.config = EngineConfig.served(max_draft_batch=0, measured_draft_costs=False)
    assert policy.round_shape(greedy, 100, 4).nodes == 1  # switched off: static again


def looping_request(policy: DraftPolicy) -> Request:
    req = Request("r", 2, SamplingParams(), k=8, seed=0, stop=None,
                  tokens=[7, 1, 2, 3, 4, 5, 6, 9, 1, 2])   # (1, 2) went on 3 4 5 6 before
    policy.setup_lookup(req)
    return req


def score(policy: DraftPolicy, rate_in_10: int, drafts: int = 200) -> None:
    """The process has verified `drafts` reached context drafts of a 2-token match at each
    place, rate_in_10 in 10 of them accepted."""
    for place in range(1, MAX_PLACE + 1):
        for i in range(drafts):
            policy.lookup_scores.record(LookupKey("greedy", CONTEXT, 2, place), i % 10 < rate_in_10)


def test_dear_rows_stop_lookups_before_any_drafter_call_is_measured():
    policy = DraftPolicy(EngineConfig.served(max_draft_batch=0, lookup_tokens=4))
    req = looping_request(policy)
    score(policy, 4)
    assert policy.lookups(req, left=10, batch_size=4)  # static costs: a looked-up draft pays
    for _ in range(3):
        for r in range(4, 9):  # fp32 on the AVX-512 build, in process, roughly; no drafter call
            policy.costs.record_target(r, 0.004 + 0.0012 * r)
    assert policy.costs.shares(4).call is None
    assert policy.lookups(req, left=10, batch_size=4) == []
    assert policy._costs(req, 4)[0] == pytest.approx(policy.config.drafting.draft_call_cost / 4)


def test_a_chain_alone_drafts_what_its_measured_costs_pay_for_and_a_tree_or_a_batch_needs_a_margin():
    policy = DraftPolicy(EngineConfig.served(max_draft_batch=0, max_sampled_draft_batch=0,
                                             sampled_verify="rejection"))
    sampled = request(policy, SamplingParams(temperature=0.7), 40)  # a chain of 2
    policy.costs = measured(0.035, 0.003, 0.011)  # alone: 2 drafts gain ~1.08x, short of 1 + margin
    share = policy.costs.shares(1)
    gain = (1 + 0.4 + 0.4 ** 2) / (1 + share.call + 2 * share.step)
    assert 1.0 < gain < 1 + MEASURED_MARGIN
    assert policy.round_shape(sampled, 100, 1).nodes == 2
    tree = request(policy, SamplingParams(), 45)  # a tree, costed as one draft, keeps the margin
    assert 1.0 < (1 + 0.45) / (1 + share.call + share.step) < 1 + MEASURED_MARGIN
    assert policy.round_shape(tree, 100, 1).nodes == 0
    policy.costs = measured(0.034, 0.003, 0.004)  # two running: a chain of 2 gains ~1.18x
    share = policy.costs.shares(2)
    sampled = request(policy, SamplingParams(temperature=0.7), 45)
    gain = (1 + 0.45 + 0.45 ** 2) / (1 + share.call + 2 * share.step)
    assert 1 + MEASURED_MARGIN < gain < 1 + BATCH_MARGIN
    assert policy.round_shape(sampled, 100, 2).nodes == 0
    assert policy.round_shape(sampled, 100, 1).nodes == 2  # alone (no margin): it pays


@pytest.mark.parametrize("mode", ["rejection", "auto"])
def test_a_seeded_request_drafts_the_same_whatever_the_timings_where_rejection_sampled(mode):
    """Under "auto" a seeded request is coupled (its output never depends on its drafts), so it
    follows the timings as an unseeded one does."""
    policy = DraftPolicy(EngineConfig.served(max_draft_batch=0, max_sampled_draft_batch=0,
                                             sampled_verify=mode))
    seeded = request(policy, SamplingParams(temperature=0.7, seed=3), 42)
    unseeded = request(policy, SamplingParams(temperature=0.7), 42)
    shapes = []
    for costs in (MeasuredCosts(), measured(0.032, 0.0023, 0.010), measured(0.032, 0.0001, 0.001)):
        policy.costs = costs
        shapes.append([policy.round_shape(r, 100, b).nodes for r in (seeded, unseeded) for b in (1, 4)])
    fixed = len({s[0] for s in shapes}) == 1 and len({s[1] for s in shapes}) == 1
    assert fixed == (mode == "rejection") and seeded.coupled == (mode == "auto")
    assert len({s[3] for s in shapes}) > 1  # an unseeded one follows the timings


def test_the_engine_measures_its_calls_and_greedy_output_stays_exact(tiny_target, eagle3_head,
                                                                      prompts, hf_greedy):
    engine = tiny_engine(tiny_target, eagle3_head, measured_draft_costs=True, draft_call_cost=0.2,
                         draft_step_cost=0.05, max_running=4)
    params = [SamplingParams(max_tokens=24, num_speculative_tokens=4)] * 4
    results = engine.generate(prompts[:4], params)
    assert [r.token_ids for r in results] == [hf_greedy(p, 24) for p in prompts[:4]]
    costs = engine.policy.costs
    assert len(costs.target) >= 2 and costs.drafter_calls > 0
    assert all(seconds > 0 for seconds in costs.target.values())


def test_a_lookup_branch_ends_at_its_last_token_likely_enough_to_pay_for_its_row():
    """A lookup draft costs one verify row and no drafter call: its chance of acceptance is the
    product of the measured rates of its key and its predecessors' (LookupScores)."""
    def branch(rate_in_10: int) -> list[int]:
        policy.lookup_scores = LookupScores()
        score(policy, rate_in_10)
        found = policy.lookups(req, left=10, batch_size=1)
        return found[0].tokens if found else []

    policy = DraftPolicy(EngineConfig.served(lookup_tokens=4))
    req = looping_request(policy)
    policy.costs = measured(0.020, 0.0035, 0.007)  # alone: a row is ~15% of a plain round
    assert branch(9) == [3, 4, 5, 6]   # 0.9 ** 4 = 0.66
    assert branch(3) == [3]            # 0.3, then 0.09
    assert branch(1) == []
    policy.config = EngineConfig.served(lookup_tokens=4, draft_call_cost=0.0, draft_step_cost=0.0,
                                        draft_min_prob=0.0)
    assert branch(1) == [3, 4, 5, 6]  # costs and confidence limits off: every lookup in full


def test_verification_counts_each_reached_lookup_draft_by_its_key_accepted_or_not():
    from eagle_serve.spec.verify import _observe_lookups

    req = Request("r", 2, SamplingParams(), k=8, seed=0, stop=None, tokens=[1, 2])
    req.lookup_scores = LookupScores()
    context = [LookupKey("greedy", CONTEXT, 5, place) for place in (1, 2)]
    corpus = LookupKey("greedy", CORPUS, 8, 1)
    # head chain 0 -> 1; a context branch 2 -> 3 from the root; a corpus draft 4 below head node 0
    req.parents, req.draft_keys = [-1, 0, -1, 2, 0], [None, None, context[0], context[1], corpus]
    _observe_lookups(req, path=[0, 4])  # kept: head 0, then the corpus draft below it
    assert req.lookup_scores.counts == {context[0]: (1.0, 0.0), corpus: (1.0, 1.0)}  # 3: not reached
    assert req.draft_sources == [HEAD, HEAD, CONTEXT, CONTEXT, CORPUS]

"""Structured output is exact under speculation: the grammar's mask applies at every verify row
on the matcher advanced along that row's path, so constrained speculative output equals
constrained plain decoding (greedy: chains, trees, batches, preemption) and follows the masked
target law (sampled); no output ever leaves its grammar; drafts the grammar refuses are pruned,
and the tokens it forces are drafted as a source of their own."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from eagle_serve.core.requests import SamplingParams
from eagle_serve.spec.lookup import GRAMMAR
from eagle_serve.testing import OracleDrafter, TreeOracleDrafter, tiny_engine

MAX_TOKENS = 24
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
GUIDES = {"json_schema": ("json_schema", json.dumps(SCHEMA)), "json": ("json", ""),
          "regex": ("regex", r"(yes|no), [a-z]{2,5}[0-9]+"), "choice": ("choice", json.dumps(["red", "green", "blue"])),
          "ebnf_grammar": ("ebnf_grammar", 'root ::= "(" [a-c]+ ")" | "<" [0-9]* ">"'),
          "lark": ("lark", 'start: "(" LETTERS ")" | "<" DIGIT* ">"\nLETTERS: /[a-c]+/\n%import common.DIGIT')}


def greedy(k=0, guide=None, **kw):
    return SamplingParams(max_tokens=MAX_TOKENS, num_speculative_tokens=k, guide=guide, **kw)


def fresh_matcher(engine, guide):
    state = engine.guides().matcher(engine.guides().compile(guide).result())
    return state.m


def assert_in_grammar(engine, guide, tokens: list[int], finished: str) -> None:
    m = fresh_matcher(engine, guide)
    for tok in tokens:
        assert m.accept_token(tok), (engine.tokenizer.decode(tokens), tok)
    if finished == "stop":
        assert m.is_terminated()


@pytest.fixture(scope="module")
def plain_engine(tiny_target):
    return tiny_engine(tiny_target)


@pytest.fixture(scope="module")
def unconstrained(plain_engine, prompts) -> list[list[int]]:
    return [r.token_ids for r in plain_engine.generate(prompts, greedy())]


@pytest.fixture(scope="module")
def chain_and_tree_engine(tiny_target, eagle1_head):
    return tiny_engine(tiny_target, eagle1_head, max_running=3)


@pytest.mark.parametrize("name", list(GUIDES))
def test_constrained_speculative_greedy_output_equals_constrained_plain(plain_engine, unconstrained,
                                                                        chain_and_tree_engine, prompts, name):
    guide = GUIDES[name]
    plain = plain_engine.generate(prompts, greedy(guide=guide))
    assert [r.token_ids for r in plain] != unconstrained
    for r in plain:
        assert_in_grammar(plain_engine, guide, r.token_ids, r.finish_reason)
    engine = chain_and_tree_engine
    for shape in (dict(k=4), dict(k=6, draft_topk=2, draft_depth=3)):
        got = engine.generate(prompts, greedy(guide=guide, **shape))
        assert [r.token_ids for r in got] == [r.token_ids for r in plain], shape


def test_json_object_output_parses(tiny_target, prompts):
    engine = tiny_engine(tiny_target)
    results = engine.generate(prompts, SamplingParams(max_tokens=200, guide=GUIDES["json_schema"]))
    finished = [r for r in results if r.finish_reason == "stop"]
    assert finished
    for r in finished:
        value = json.loads(engine.tokenizer.decode(r.token_ids, skip_special_tokens=True))
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)


@pytest.mark.parametrize("oracle", ["chain", "tree"])
def test_drafts_that_are_mostly_right_keep_constrained_output_exact(tiny_target, prompts, oracle):
    guide = GUIDES["regex"]
    expected = [r.token_ids for r in tiny_engine(tiny_target).generate(prompts, greedy(guide=guide))]
    engine = tiny_engine(tiny_target, max_running=4)
    sequences = [p + e for p, e in zip(prompts, expected)]
    if oracle == "tree":
        engine.drafter = TreeOracleDrafter(sequences, engine.target.vocab_size)
        params = greedy(k=6, draft_topk=2, draft_depth=3, guide=guide)
    else:
        engine.drafter = OracleDrafter(sequences, engine.target.vocab_size)
        params = greedy(k=4, guide=guide)
    results = engine.generate(prompts, params)
    assert [r.token_ids for r in results] == expected
    assert max(r.acceptance_length for r in results) > 1.5


def test_preemption_keeps_constrained_output_exact(tiny_target, eagle1_head, prompts):
    guide = GUIDES["json"]
    expected = [r.token_ids for r in tiny_engine(tiny_target).generate(prompts, greedy(guide=guide))]
    engine = tiny_engine(tiny_target, eagle1_head, page_size=8, num_target_pages=12, num_drafter_pages=12, max_running=4)
    results = engine.generate(prompts, greedy(k=4, guide=guide))
    assert [r.token_ids for r in results] == expected
    assert engine.stats.preemptions > 0


def test_forced_tokens_are_drafted_for_free_and_counted_by_source(tiny_target, prompts):
    """A choice whose words share no prefix: after the first token the rest of the word is
    forced, and drafted as the grammar tokenizes it (the target may pick another tokenization
    the mask allows, so not every forced draft is kept), while the head drafts nothing right."""
    guide = ("choice", json.dumps(["supercalifragilistic", "antidisestablishment"]))
    engine = tiny_engine(tiny_target, max_running=4)
    plain = engine.generate(prompts[:4], greedy(guide=guide))
    assert engine.stats.draft_tokens_by_source[GRAMMAR] == 0
    engine.drafter = OracleDrafter([p + r.token_ids for p, r in zip(prompts, plain)], engine.target.vocab_size,
                                   wrong=lambda pos: True)  # the head is always wrong
    spec = engine.generate(prompts[:4], greedy(k=4, guide=guide))
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    s = engine.stats
    assert s.accepted_tokens_by_source[GRAMMAR] > 0 and s.accepted_tokens_by_source["eagle"] == 0
    assert sum(r.last.num_rounds for r in spec) < sum(len(r.token_ids) for r in spec)


def test_drafts_the_grammar_refuses_are_pruned_before_verification(tiny_target, eagle1_head, prompts):
    guide = GUIDES["regex"]
    engine = tiny_engine(tiny_target, eagle1_head, lookup_tokens=0)
    verified = []
    forward = engine.target.forward

    def spy(batch, logit_rows, sampling, **kw):
        ids, positions, cu = (t.tolist() for t in (batch.input_ids, batch.positions, batch.cu_seqlens))
        for b in range(len(cu) - 1):  # a verified request: its last token, then its drafts
            if positions[cu[b]] > 0:  # not a prompt (a request's grammar compiles in its own time:
                verified.extend(ids[cu[b] + 1:cu[b + 1]])  # the prompts may come in different steps)
        return forward(batch, logit_rows, sampling, **kw)
    engine.target.forward = spy
    engine.generate(prompts[:2], greedy(k=4, guide=guide))
    # every verified draft is a token the regex allows somewhere: the random head's other
    # proposals (almost all of the vocabulary) were pruned
    allowed = set()
    tok = engine.tokenizer
    for i in range(engine.target.vocab_size):
        text = tok.decode([i])
        if text and all(c in "yesno, abcdefghijklmnopqrstuvwxyz0123456789" for c in text):
            allowed.add(i)
    drafted = engine.stats.draft_tokens
    assert drafted < 4 * engine.stats.rounds  # pruned rounds verify fewer than k drafts
    assert len(verified) == drafted and all(t in allowed for t in verified)


@pytest.mark.parametrize("guide, message", [
    (("xml", "<a/>"), "guided_decoding_guide_type must be one of"),
    (("json_schema", "{not json"), "not valid JSON"),
    (("choice", "[]"), "a JSON list of 1 to"),
    (("json_schema", "x" * 70000), "at most 65536 bytes"),
    (("json_schema", json.dumps({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})),
     "keyword 'not' is not supported"),
    (("json_schema", json.dumps({"type": "string", "pattern": "^(?=a)b$"})), "lookaround or backreference"),
    (("regex", r"(a)\1"), "lookaround or backreference")])
def test_bad_guides_are_refused_at_once(tiny_target, guide, message):
    with pytest.raises(ValueError, match=message):
        tiny_engine(tiny_target).add_request([5, 6, 7], greedy(guide=guide))


def test_a_guide_that_does_not_compile_fails_its_request_alone(tiny_target, prompts):
    engine = tiny_engine(tiny_target)
    bad = engine.add_request(prompts[0], greedy(guide=("regex", "(unclosed")))
    good = engine.add_request(prompts[1], greedy(guide=GUIDES["json"]))
    outs = {}
    while engine.has_work():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    assert outs[bad][-1].error and "does not compile" in outs[bad][-1].error
    assert outs[good][-1].finished and not outs[good][-1].error
    assert engine.target_pool.num_free == engine.target_pool.num_pages


def test_sampled_constrained_output_follows_the_masked_law(tiny_target):
    """A regex of two letters from {a, b, c}: every output is in the grammar, and the first
    token's frequencies follow the target's law masked to the tokens the grammar allows there
    (chi-square), with drafts often accepted (coupled verification)."""
    from scipy.stats import chi2
    guide = ("regex", "[abc][abc]")
    n, prompt, temperature = 1500, [5, 9, 22], 1.5
    engine = tiny_engine(tiny_target, max_running=64, max_waiting=n, num_draft_slots=512)
    params = [SamplingParams(max_tokens=4, temperature=temperature, seed=i, guide=guide) for i in range(n)]
    results = engine.generate([prompt] * n, params)
    m = fresh_matcher(engine, guide)
    import xgrammar as xgr
    mask = xgr.allocate_token_bitmask(1, engine.target.vocab_size)
    m.fill_next_token_bitmask(mask)
    allowed = torch.tensor([bool((int(mask[0, t // 32]) >> (t % 32)) & 1) for t in range(engine.target.vocab_size)])
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, -1] / temperature
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    support = allowed.nonzero().squeeze(1).tolist()
    counts = torch.zeros(len(support))
    for r in results:
        assert_in_grammar(engine, guide, r.token_ids, r.finish_reason)
        counts[support.index(r.token_ids[0])] += 1
    expected = probs[support] * n
    keep = expected >= 5
    stat = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
                 + (counts[~keep].sum() - expected[~keep].sum()) ** 2 / max(expected[~keep].sum(), 1e-9))
    assert chi2.sf(stat, int(keep.sum())) > 1e-6


@pytest.mark.slow
def test_forced_text_is_drafted_in_every_tokenization_and_sampled_output_keeps_its_law(tiny_target, eagle1_head):
    """Forced text is drafted as a tree of its tokenizations (siblings proposed with certainty),
    since a masked target picks its own: rejection-sampled output still follows the masked
    target's law over the tokenizations (two-sample chi-square against plain sampling, the
    first three tokens), and speculative rounds are fewer than tokens."""
    from scipy.stats import chi2_contingency
    guide = ("choice", json.dumps(["supercalifragilistic", "antidisestablishment"]))
    n, prompt = 200, [5, 9, 22]
    engine = tiny_engine(tiny_target, eagle1_head, max_running=64, max_waiting=n, num_draft_slots=1024,
                         sampled_verify="rejection")
    tree = engine.guides().matcher(engine.guides().compile(guide).result())
    assert tree.m.accept_token(engine.tokenizer.encode("s", add_special_tokens=False)[0])
    tokens, parents = tree.forced_tree(8)
    texts = [engine.tokenizer.decode([t]) for t in tokens]
    for i, p in enumerate(parents):  # every path spells the start of the forced text
        path, node = [], i
        while node >= 0:
            path.insert(0, texts[node])
            node = parents[node]
        assert "s" + "".join(path) == "supercalifragilistic"[:1 + len("".join(path))]
    assert sum(p == -1 for p in parents) > 1 and parents == sorted(parents)

    def law(k: int) -> dict:
        params = [SamplingParams(max_tokens=8, temperature=1.5, seed=i, num_speculative_tokens=k, guide=guide)
                  for i in range(n)]
        out = engine.generate([prompt] * n, params)
        for r in out:
            assert_in_grammar(engine, guide, r.token_ids, r.finish_reason)
        counts: dict = {}
        for r in out:
            counts[tuple(r.token_ids[:3])] = counts.get(tuple(r.token_ids[:3]), 0) + 1
        return counts, sum(r.last.num_rounds for r in out), sum(len(r.token_ids) for r in out)
    plain, _, _ = law(0)
    spec, rounds, emitted = law(4)
    cells = sorted(set(plain) | set(spec), key=lambda c: -(plain.get(c, 0) + spec.get(c, 0)))
    big = [c for c in cells if plain.get(c, 0) + spec.get(c, 0) >= 10]
    rest = [c for c in cells if c not in big]
    table = [[d.get(c, 0) for c in big] + [sum(d.get(c, 0) for c in rest)] for d in (plain, spec)]
    if not rest:
        table = [row[:-1] for row in table]
    assert chi2_contingency(table).pvalue > 1e-6
    assert engine.stats.accepted_tokens_by_source[GRAMMAR] > 0 and rounds < emitted


@pytest.fixture(scope="module")
def guided_engine(tiny_target, eagle1_head):
    return tiny_engine(tiny_target, eagle1_head, max_running=4)


def regexes():
    from hypothesis import strategies as st
    atom = st.sampled_from(["[a-c]", "[0-9]", "(yes|no)", "x", " ", "[{}:,]", '"[a-z]*"'])
    piece = st.tuples(atom, st.sampled_from(["", "?", "+", "*", "{1,3}"])).map("".join)
    return st.lists(piece, min_size=1, max_size=5).map("".join)


def test_no_output_ever_leaves_its_grammar(guided_engine, prompts):
    """Property: whatever the regex, temperature, seed and draft shape, every output token is
    one the grammar allows, and an output that stopped is one the grammar completes."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(regex=regexes(), temperature=st.sampled_from([0.0, 0.8, 2.0]), seed=st.integers(0, 2 ** 31),
           shape=st.sampled_from([dict(num_speculative_tokens=0), dict(num_speculative_tokens=3),
                                  dict(num_speculative_tokens=6, draft_topk=2, draft_depth=3)]))
    def check(regex, temperature, seed, shape):
        guide = ("regex", regex)
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=seed, guide=guide,
                                **(shape if temperature == 0 else {"num_speculative_tokens": shape["num_speculative_tokens"]}))
        for r in guided_engine.generate(prompts[:3], params):
            assert_in_grammar(guided_engine, guide, r.token_ids, r.finish_reason)
    check()

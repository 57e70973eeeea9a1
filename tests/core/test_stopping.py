"""The stop-string matcher against a brute-force reference, on the default tokenizer."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eagle_serve import paths
from eagle_serve.core.stopping import StopAutomaton, StopChecker
from eagle_serve.core.tokenization import decode, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(paths.default_target_dir())


@pytest.fixture(scope="module")
def ascii_ids(tokenizer):
    """Ids of tokens that decode to short ASCII text (every id a whole character)."""
    ids = [i for i in range(200, 6000) if decode(tokenizer, [i]).isascii()
           and 0 < len(decode(tokenizer, [i])) <= 4]
    return ids[:400]


def reference(tokenizer, ids: list[int], stops: tuple[str, ...]) -> tuple[bool, int]:
    """Append one token at a time and search the whole text: the first match to complete (ties:
    the longest) -> (stopped, tokens kept: those whose text ends at or before its start)."""
    for i in range(len(ids)):
        text = decode(tokenizer, ids[:i + 1])
        found = [(text.find(s) + len(s), -len(s)) for s in stops if s in text]
        if found:
            end, neg_len = min(found)
            start = end + neg_len
            keep = max(m for m in range(i + 1) if len(decode(tokenizer, ids[:m])) <= start)
            return True, keep
    return False, len(ids)


def run(checker: StopChecker, ids: list[int], chunks: list[int]) -> tuple[bool, int]:
    """Feed `ids` in rounds of the given sizes, as the engine does."""
    upto = 0
    for size in chunks + [len(ids)]:
        upto = min(len(ids), upto + max(1, size))
        if checker.check(ids[:upto]):
            return True, checker.keep
        if upto == len(ids):
            break
    return False, len(ids)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_the_matcher_stops_where_a_brute_force_search_does_whatever_the_round_sizes(
        tokenizer, ascii_ids, data):
    ids = data.draw(st.lists(st.sampled_from(ascii_ids), min_size=1, max_size=40))
    text = decode(tokenizer, ids)
    picks = data.draw(st.lists(st.tuples(st.integers(0, len(text)), st.integers(1, 6)), max_size=4))
    stops = tuple(text[a:a + n] for a, n in picks if text[a:a + n])
    stops += tuple(data.draw(st.lists(st.text("abe \n", min_size=1, max_size=4), max_size=3)))
    if not stops:
        stops = ("\x00",)
    chunks = data.draw(st.lists(st.integers(1, 9), max_size=12))
    assert run(StopChecker(tokenizer, stops), ids, chunks) == reference(tokenizer, ids, stops)


def test_held_back_text_is_never_streamed_and_a_split_character_is_cut_whole(tokenizer):
    ids = tokenizer("Price: 5€ now, 6€ later.", add_special_tokens=False)["input_ids"]
    checker = StopChecker(tokenizer, ("6€",))
    streamed = 0
    for n in range(1, len(ids) + 1):
        if checker.check(ids[:n]):
            kept = decode(tokenizer, ids[:checker.keep])
            assert kept == "Price: 5€ now, " or kept == "Price: 5€ now,", kept
            assert streamed <= checker.keep
            return
        streamed = checker.safe_upto(ids[:n])
        assert "6" not in decode(tokenizer, ids[:streamed])[len("Price: 5€ now,"):]
        assert "\ufffd" not in decode(tokenizer, ids[:streamed])
    raise AssertionError("the stop string was not found")


def test_the_automaton_reports_the_longest_match_and_the_longest_open_prefix():
    automaton = StopAutomaton(("abcd", "bc", "c"))
    state, matches, depths = 0, [], []
    for ch in "xabcd":
        state = automaton.step(state, ch)
        matches.append(automaton.match[state])
        depths.append(automaton.depth[state])
    assert matches == [0, 0, 0, 2, 4]  # "bc" ends at c (longer than "c"), then "abcd"
    assert depths == [0, 1, 2, 3, 4]


def test_each_new_character_is_read_once_whatever_the_number_of_stop_strings(tokenizer, ascii_ids):
    """What bounds the cost of one request's stop strings for every other request: the
    automaton takes one step per new output character, rounds and strings notwithstanding."""
    steps = {}
    for stops in ([f"{i:03d}" + "z" * 125 for i in range(32)], ["zz"]):
        checker = StopChecker(tokenizer, tuple(stops))
        count, step = [0], checker.automaton.step
        checker.automaton.step = lambda state, ch: (count.__setitem__(0, count[0] + 1), step(state, ch))[1]
        ids = ascii_ids[:120]
        for upto in range(1, len(ids) + 1):
            assert not checker.check(ids[:upto])
        steps[len(stops)] = count[0]
    assert steps[32] == steps[1] == len(decode(tokenizer, ascii_ids[:120]))

"""Stop strings over token ids: where to cut, and how much to hold back while streaming.

Text is the tokenizer's decode of the output ids (special tokens skipped), built incrementally:
each new token adds the text delta `tokenization.split_delta` gives it (a character whose bytes
are not complete yet is held back and added with the token that completes it). One Aho-Corasick
automaton over all stop strings reads each new character once, so a round costs the same
whatever the number of stop strings; its state also says how much of the text's end could be the
start of a stop string (the longest suffix that is a prefix of one), which is held back from
streaming until later tokens decide.

The first match to complete wins (among those ending at the same character, the longest); it is
excluded from the output, which is cut to the tokens whose text ends at or before the match
starts (a token that straddles the start of a stop string is dropped with it). A match that
would leave fewer than `min_tokens` tokens does not count (the text goes on). Scanning in text
order makes the result independent of how many tokens a round adds, so speculative decoding
stops exactly where plain decoding does.
"""
from __future__ import annotations

import bisect
from collections import deque

from eagle_serve.core.tokenization import WINDOW, split_delta


class StopAutomaton:
    """Aho-Corasick over a set of strings. A state is an int; `step(state, ch)` -> next state;
    `match[state]` = length of the longest string ending at this position (0 = none);
    `depth[state]` = length of the longest suffix read so far that is a prefix of a string."""

    def __init__(self, patterns: tuple[str, ...]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth, self.match, self.fail = [0], [0], [0]
        for pattern in patterns:
            state = 0
            for ch in pattern:
                if ch not in self.goto[state]:
                    self.goto.append({})
                    self.depth.append(self.depth[state] + 1)
                    self.match.append(0)
                    self.fail.append(0)
                    self.goto[state][ch] = len(self.goto) - 1
                state = self.goto[state][ch]
            self.match[state] = max(self.match[state], len(pattern))
        queue = deque(self.goto[0].values())
        while queue:  # breadth first: a state's fail link is shallower, so already final
            state = queue.popleft()
            for ch, child in self.goto[state].items():
                queue.append(child)
                self.fail[child] = self.step(self.fail[state], ch) if state else 0
                self.match[child] = max(self.match[child], self.match[self.fail[child]])

    def step(self, state: int, ch: str) -> int:
        while state and ch not in self.goto[state]:
            state = self.fail[state]
        return self.goto[state].get(ch, 0)


class StopChecker:
    """Per request: feed it the output ids after each round (`check`), ask what is safe to send
    (`safe_upto`)."""

    def __init__(self, tokenizer, stop: tuple[str, ...], min_tokens: int = 0):
        if tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        self.tokenizer, self.stop, self.min_tokens = tokenizer, tuple(stop), min_tokens
        self.automaton = StopAutomaton(self.stop)
        self.state = 0
        self.num_chars = 0            # characters read so far
        self.ends: list[float] = []   # per output token: text length once its text is complete
        self.pending: list[int] = []  # tokens whose text is held back (an incomplete character)
        self.keep = 0                 # after check() found a match: output tokens to keep

    def check(self, ids: list[int]) -> bool:
        """Read the tokens of `ids` (the whole output so far) not read yet -> whether a stop
        string completed (then `keep` is set)."""
        for i in range(len(self.ends), len(ids)):
            text, held = split_delta(self.tokenizer, ids[max(0, i - WINDOW):i], ids[i:i + 1])
            for n, ch in enumerate(text):
                self.state = self.automaton.step(self.state, ch)
                self.num_chars += 1
                if n == 0:  # the first character completes what earlier tokens held back
                    for j in self.pending:
                        self.ends[j] = self.num_chars
                    self.pending = []
                length = self.automaton.match[self.state]
                if length:
                    keep = bisect.bisect_right(self.ends, self.num_chars - length)
                    if keep >= self.min_tokens:
                        self.keep = keep
                        return True
            self.ends.append(self.num_chars if not held else float("inf"))
            if held:
                self.pending.append(i)
        return False

    def safe_upto(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` (read by `check`) can be sent without revealing a
        possible start of a stop string."""
        held = self.automaton.depth[self.state]
        return min(len(ids), bisect.bisect_right(self.ends, self.num_chars - held))

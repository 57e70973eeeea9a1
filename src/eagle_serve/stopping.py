"""Stop strings over token ids: where to cut, and how much to hold back while streaming.

Text is the tokenizer's decode of the output ids (special tokens skipped). A stop string is
excluded from the output, so the output is cut to the longest token prefix whose text ends at
or before the match. While streaming, tokens whose text could be the start of a stop string are
held back until the next tokens decide. Cuts happen at token boundaries: a token that straddles
the start of a stop string is dropped with it.
"""
from __future__ import annotations


class StopChecker:
    def __init__(self, tokenizer, stop: tuple[str, ...]):
        if tokenizer is None:
            raise ValueError("stop strings need the engine's tokenizer")
        self.tokenizer, self.stop = tokenizer, tuple(stop)
        self.keep = 0  # after check() found a match: output tokens to keep

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tokens_within(self, ids: list[int], num_chars: int) -> int:
        """The most leading tokens whose text is at most num_chars long."""
        for m in range(len(ids), -1, -1):
            if len(self._text(ids[:m])) <= num_chars:
                return m
        return 0

    def check(self, ids: list[int]) -> bool:
        text = self._text(ids)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.keep = self._tokens_within(ids, min(hits))
        return True

    def safe_upto(self, ids: list[int]) -> int:
        """How many leading tokens can be sent without revealing a possible stop string start."""
        text = self._text(ids)
        held = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    held = max(held, n)
                    break
        return len(ids) if held == 0 else self._tokens_within(ids, len(text) - held)

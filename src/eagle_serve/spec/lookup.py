"""Model-free draft sources: continuations looked up instead of predicted.

- `ContextIndex` (one per request): where the request's last n tokens (n = 8 down to 2) occurred
  before in its own prompt + output, and what followed them there. Small models repeat
  themselves (lists, code, restated questions), so this often predicts several tokens at once.
  Updated incrementally as tokens are accepted, never rebuilt.
- `CorpusIndex` (one per process): a suffix array of the target's own answers (the corpus the
  head was trained on, prompts included): the longest suffix of the request's tokens (up to 32)
  that occurs there, and the tokens its occurrences most often continue with. Built once by a
  command (`python -m eagle_serve.spec.lookup build`), stored as a .npz beside the head, tied to the
  tokenizer it was built with; `python -m eagle_serve.spec.lookup eval` measures both sources along
  held-out answers.

Both only propose: verification decides, so output is unchanged whatever they propose.
"""
from __future__ import annotations

import argparse
import bisect
import functools
import gzip
import hashlib
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pydivsufsort

HEAD = "eagle"                         # the drafter's own drafts
CONTEXT = "context"
CORPUS = "corpus"
GRAMMAR = "grammar"                    # tokens a request's grammar forces (eagle_serve.core.grammar)
SOURCES = (HEAD, CONTEXT, CORPUS, GRAMMAR)  # every draft node has one


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]          # the proposed continuation, first token first
    source: str
    strengths: tuple[int, ...]  # of each token: the context match's length (tokens), or the
    #                            corpus step's corpus_strength (match, agreement, evidence)


class ContextIndex:
    """Every n-gram of a token stream (min_n <= n <= max_n) -> the index just past its latest
    occurrence that has a following token."""

    def __init__(self, min_n: int = 2, max_n: int = 8):
        self.orders = range(max_n, min_n - 1, -1)   # longest first
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.orders}
        self.indexed = 0   # n-grams ending before this index are in the maps

    def update(self, tokens: list[int]) -> None:
        """Index the n-grams that gained a following token since the last call."""
        for end in range(self.indexed, len(tokens) - 1):   # n-gram tokens[end-n+1 .. end]
            for n in self.orders:
                if end + 1 >= n:
                    self.maps[n][tuple(tokens[end + 1 - n:end + 1])] = end + 1
        self.indexed = max(self.indexed, len(tokens) - 1)

    def propose(self, tokens: list[int], limit: int, after: list[int] = ()) -> Proposal | None:
        """The continuation of tokens + after (`after`: drafted, not indexed) after the latest
        earlier occurrence in `tokens` of its longest matching suffix. A match that overlaps the
        suffix continues periodically (a repetition loop)."""
        self.update(tokens)
        seq = list(tokens) + list(after) if after else tokens
        for n in self.orders:
            if len(seq) <= n:
                continue
            start = self.maps[n].get(tuple(seq[-n:]))
            if start is not None:
                out = _continue(seq, start, limit)
                return Proposal(out, CONTEXT, (n,) * len(out))
        return None


def _continue(tokens: list[int], start: int, limit: int) -> list[int]:
    period = len(tokens) - start
    out: list[int] = []
    for i in range(limit):
        out.append(tokens[start + i] if start + i < len(tokens) else out[i - period])
    return out


def tokenizer_fingerprint(tokenizer) -> str:
    """Identifies a vocabulary: the same token ids mean the same strings."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()[:16]


SEPARATOR = -1        # between the corpus's records: no match crosses it
MAX_MATCH = 32        # the longest suffix of a request's tokens a corpus lookup matches
VOTE_CAP = 64        # occurrences a step's vote reads at most (evenly spaced in the range)
# What the server drafts from: a corpus continuation while the product of its steps' shares
# stays at least CORPUS_MIN_PROB; a context match of at least CONTEXT_MIN_MATCH tokens.
CORPUS_MIN_PROB = 0.2
CONTEXT_MIN_MATCH = 2


def corpus_strength(match: int, agreeing: int, total: int) -> int:
    """A corpus step's strength (LookupKey.strength), three digits: the band of its context's
    match length (1-2, 3-5, 6-11, 12+ tokens: 0-3), of the share of the occurrences that go on
    with its token (under 0.3, 0.6, 1, all: 0-3) and of how many do (1, 2-4, 5+: 0-2). Along
    held-out answers each tells accepted steps apart: matched on 6-11 tokens, 55% of the steps
    that one occurrence went on with were right, 95% of those that five or more went on with
    unanimously; 22% of the steps matched on one token, 90% of those matched on 12 or more."""
    band = 0 if match <= 2 else 1 if match <= 5 else 2 if match <= 11 else 3
    share = agreeing / total
    agreement = 3 if agreeing == total else 0 if share < 0.3 else 1 if share < 0.6 else 2
    evidence = 0 if agreeing == 1 else 1 if agreeing < 5 else 2
    return 100 * band + 10 * agreement + evidence


class CorpusIndex:
    """Every suffix of the corpus read backwards, sorted (a suffix array): the occurrences of a
    run of tokens, wherever it ends in the corpus, are one range of it, and those of the run one
    token longer to the left a sub-range, found by two binary searches on that token. So a
    lookup finds, from the last token back, the longest suffix of a request's tokens (up to
    MAX_MATCH) that occurs in the corpus, and proposes what most of its occurrences continue
    with (an "infini-gram" over the corpus)."""

    def __init__(self, reverse: np.ndarray, fingerprint: str):
        """reverse: [N] the corpus's tokens read backwards (records between SEPARATORs); the
        suffix array is built here (what the .npz holds is the tokens alone)."""
        self.reverse, self.fingerprint = reverse, fingerprint
        self.suffixes = _suffix_array(reverse)  # [N] starts of the suffixes of `reverse`, sorted
        self._rev, self._sa = _scalars(reverse), _scalars(self.suffixes)  # fast reads of one item
        self.max_match = MAX_MATCH

    @classmethod
    def build(cls, sequences: list[tuple[list[int], list[int]]], vocab_size: int,
              fingerprint: str) -> "CorpusIndex":
        """sequences: (prompt ids, answer ids); each record is its prompt + answer."""
        parts = [np.asarray([SEPARATOR])]
        for prompt, answer in sequences:
            parts += [np.asarray(prompt + answer, dtype=np.int64), np.asarray([SEPARATOR])]
        dtype = np.int16 if vocab_size <= np.iinfo(np.int16).max else np.int32
        reverse = np.ascontiguousarray(np.concatenate(parts)[::-1]).astype(dtype)
        return cls(reverse, fingerprint)

    def propose(self, tokens: list[int], limit: int, min_prob: float) -> Proposal | None:
        """What the occurrences of the longest matching suffix of `tokens` continue with, token
        by token: the most frequent next token of the occurrences still on the path (ties to
        the lowest id), while the product of the steps' shares stays >= min_prob."""
        ctx, kernel = tokens[-self.max_match:], self._kernel
        walk = kernel(ctx, limit, min_prob, VOTE_CAP) if kernel else self.walk(ctx, limit, min_prob)
        match, out, agreeing, totals = walk
        if not out:
            return None
        return Proposal(out, CORPUS, tuple(corpus_strength(match + i, a, t)
                                           for i, (a, t) in enumerate(zip(agreeing, totals))))

    @functools.cached_property
    def _kernel(self):
        """The same walk in C++ (eagle_serve/kernels/cpu_lookup.cpp) over this index, or None where the CPU
        kernels do not run. Imported here: clients read corpora without torch."""
        from eagle_serve.kernels.cpu import cpu_kernels
        kernels = cpu_kernels()
        if kernels is None:
            return None
        import torch
        reverse = torch.from_numpy(np.ascontiguousarray(self.reverse))
        suffixes = torch.from_numpy(self.suffixes.astype(np.int32, copy=False))
        return functools.partial(kernels.corpus_walk, reverse, suffixes)

    def walk(self, ctx: list[int], limit: int, min_prob: float) -> tuple[int, list, list, list]:
        """propose's reference -> (match length, tokens, agreeing occurrences of each step, its
        occurrences)."""
        match, lo, hi = self._match(ctx)
        if match == 0:
            return 0, [], [], []
        rev = self._rev
        # the token after the occurrence that suffix s starts is reverse[s - 1], the next one
        # reverse[s - 2], ...: a record's first token is never a suffix's start (SEPARATOR is)
        places = [s - 1 for s in self._sa[lo:hi:-(-(hi - lo) // VOTE_CAP)]]
        out, agreeing, totals, prob = [], [], [], 1.0
        while len(out) < limit:
            nexts = [rev[r] for r in places]
            counts = Counter(t for t in nexts if t != SEPARATOR)
            if not counts:
                break
            token, votes = max(counts.items(), key=lambda kv: (kv[1], -kv[0]))
            total = sum(counts.values())
            prob *= votes / total
            if prob < min_prob:
                break
            out.append(token)
            agreeing.append(votes)
            totals.append(total)
            places = [r - 1 for r, t in zip(places, nexts) if t == token]
        return match, out, agreeing, totals

    def _match(self, ctx: list[int]) -> tuple[int, int, int]:
        """-> (n, lo, hi): the longest suffix of ctx that occurs in the corpus is n tokens long
        and its occurrences are suffixes[lo:hi] (n = 0: none)."""
        rev, sa, lo, hi = self._rev, self._sa, 0, len(self._sa)
        for n in range(len(ctx)):
            token, key = ctx[-1 - n], (lambda s, n=n: rev[s + n])
            a = bisect.bisect_left(sa, token, lo, hi, key=key)
            b = bisect.bisect_right(sa, token, a, hi, key=key)
            if a == b:
                return n, lo, hi
            lo, hi = a, b
        return len(ctx), lo, hi

    def save(self, path: Path) -> None:
        np.savez_compressed(path, reverse=self.reverse, fingerprint=self.fingerprint)

    @classmethod
    def load(cls, path: Path, fingerprint: str) -> "CorpusIndex":
        """ValueError if the index was built with another tokenizer or by an older version."""
        with np.load(path) as f:
            built_with = str(f["fingerprint"])
            if built_with != fingerprint:
                raise ValueError(f"corpus index {path} was built with another tokenizer "
                                 f"(fingerprint {built_with}, the target's is {fingerprint}): "
                                 "rebuild it with `python -m eagle_serve.spec.lookup build`")
            if "reverse" not in f.files:
                raise ValueError(f"corpus index {path} is an n-gram table of an older version: "
                                 "rebuild it with `python -m eagle_serve.spec.lookup build`")
            return cls(f["reverse"], built_with)


def load_corpus_index(path: Path, tokenizer) -> CorpusIndex:
    """The index at path, checked against the target's tokenizer (ValueError if another)."""
    return CorpusIndex.load(path, tokenizer_fingerprint(tokenizer))


def _scalars(array: np.ndarray) -> memoryview:
    """A 1-d integer array's items as Python ints (what bisect reads: numpy scalars are slower)."""
    return memoryview(np.ascontiguousarray(array)).cast("B").cast(array.dtype.char)


def _suffix_array(tokens: np.ndarray) -> np.ndarray:
    """[N] the starts of the suffixes of `tokens` (ids >= SEPARATOR) in sorted order, a suffix
    before its extensions (libdivsufsort: 0.3 s for the default corpus's 2.6M tokens, where
    numpy's prefix doubling took 5 s)."""
    return pydivsufsort.divsufsort((tokens.astype(np.int64) - SEPARATOR).astype(np.int32))


@dataclass(frozen=True)
class CorpusRecord:
    prompt: str | None        # the prompt's text, when the record has it
    prompt_ids: list[int]     # as the target saw it (chat template applied)
    output_ids: list[int]     # the target's answer


def read_corpus(folder: Path) -> list[CorpusRecord]:
    """The records of folder/**/*.jsonl[.gz] ({"prompt", "prompt_ids", "output_ids"}: what
    `eagle_serve.train` writes)."""
    records = []
    files = sorted(folder.rglob("*.jsonl.gz")) + sorted(folder.rglob("*.jsonl"))
    for path in files:
        with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
            for line in f:
                r = json.loads(line)
                records.append(CorpusRecord(r.get("prompt"), r["prompt_ids"], r["output_ids"]))
    if not records:
        raise ValueError(f"no records with prompt_ids/output_ids under {folder}")
    return records


def check_corpus_tokenizer(records: list[CorpusRecord], tokenizer, sample: int = 200) -> None:
    """ValueError unless the corpus was tokenized with this tokenizer: every id is in its
    vocabulary and most prompts' texts encode to token runs found in their prompt_ids."""
    records = records[:sample]
    if any(not 0 <= t < len(tokenizer) for r in records for t in r.prompt_ids + r.output_ids):
        raise ValueError("the corpus has token ids outside the tokenizer's vocabulary: "
                         "it was built with another tokenizer")
    texts = [r for r in records if r.prompt]
    found = sum(_contains(r.prompt_ids, tokenizer.encode(r.prompt, add_special_tokens=False))
                for r in texts)
    if texts and found < 0.5 * len(texts):
        raise ValueError(f"only {found} of {len(texts)} corpus prompts encode to their prompt_ids "
                         "with this tokenizer: the corpus was built with another tokenizer")


def _contains(seq: list[int], part: list[int]) -> bool:
    return any(seq[i:i + len(part)] == part for i in range(len(seq) - len(part) + 1))


def lookup_accuracy(records: list[CorpusRecord], corpus: CorpusIndex | None, limit: int,
                    min_prob: float) -> dict[str, dict[str, float]]:
    """How each source drafts along the target's own answers, as a request sees them token by
    token: per source, the share of answer positions it proposes at and the tokens of its
    proposal (at most `limit`) that the answer continues with, per position."""
    counts = {CONTEXT: [0, 0], CORPUS: [0, 0]}  # source -> [positions proposed, tokens right]
    positions = 0
    for r in records:
        context = ContextIndex()
        for i in range(len(r.output_ids)):
            tokens, truth = r.prompt_ids + r.output_ids[:i], r.output_ids[i:i + limit]
            found = {CONTEXT: context.propose(tokens, limit)}
            if corpus is not None:
                found[CORPUS] = corpus.propose(tokens, limit, min_prob)
            for source, p in found.items():
                if p is not None:
                    right = next((k for k, (a, b) in enumerate(zip(p.tokens, truth)) if a != b),
                                 min(len(p.tokens), len(truth)))
                    counts[source][0] += 1
                    counts[source][1] += right
            positions += 1
    return {source: {"proposes_at": round(n / max(positions, 1), 4),
                     "tokens_right_per_position": round(right / max(positions, 1), 4)}
            for source, (n, right) in counts.items() if source == CONTEXT or corpus is not None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle_serve.spec.lookup",
                                     description="Build the corpus index of a target's answers; "
                                                 "measure the lookups along held-out answers.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build")
    build.add_argument("--corpus", type=Path, nargs="+", required=True,
                       help="folders of .jsonl[.gz] records with prompt_ids and output_ids")
    build.add_argument("--target", default="default", help="the target model (its tokenizer)")
    build.add_argument("--out", type=Path, required=True)
    ev = sub.add_parser("eval", help="the lookups along answers the index was not built from")
    ev.add_argument("--answers", type=Path, required=True,
                    help="a corpus folder of the target's answers to held-out prompts (e.g. the "
                         "answers/ of `python -m eagle_serve.train eval --teacher-forced WORK`)")
    ev.add_argument("--index", type=Path, default=None, help="a corpus index (none: the context alone)")
    ev.add_argument("--target", default="default", help="the target model (its tokenizer)")
    ev.add_argument("--limit", type=int, default=4, help="tokens per proposal")
    args = parser.parse_args(argv)
    from eagle_serve import paths
    from eagle_serve.core.tokenization import load_tokenizer
    tokenizer = load_tokenizer(paths.resolve_model_path(args.target, Path.cwd()))
    if args.command == "eval":
        corpus = load_corpus_index(args.index, tokenizer) if args.index else None
        report = lookup_accuracy(read_corpus(args.answers), corpus, args.limit, CORPUS_MIN_PROB)
        print(json.dumps(report, indent=2))
        return
    records = [r for folder in args.corpus for r in read_corpus(folder)]
    check_corpus_tokenizer(records, tokenizer)
    index = CorpusIndex.build([(r.prompt_ids, r.output_ids) for r in records], len(tokenizer),
                              tokenizer_fingerprint(tokenizer))
    index.save(args.out)
    print(f"{args.out}: {len(records)} records, {len(index.reverse)} tokens")


if __name__ == "__main__":
    main()

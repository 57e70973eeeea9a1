"""Model-free draft sources: continuations looked up instead of predicted.

- `ContextIndex` (one per request): where the request's last n tokens (n = 8 down to 2) occurred
  before in its own prompt + output, and what followed them there. Small models repeat
  themselves (lists, code, restated questions), so this often predicts several tokens at once.
  Updated incrementally as tokens are accepted, never rebuilt.
- `CorpusIndex` (one per process): an n-gram table of the target's own answers (the corpus the
  head was trained on): for each context of 1-3 tokens, the most frequent next token and how
  often it followed. Built once by a command (`python -m eagle_serve.lookup build`), stored as a
  .npz beside the head, tied to the tokenizer it was built with; `python -m eagle_serve.lookup
  eval` measures both along held-out answers.

Both only propose: verification decides, so output is unchanged whatever they propose.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HEAD = "eagle"                         # the drafter's own drafts
CONTEXT = "context"
CORPUS = "corpus"
SOURCES = (HEAD, CONTEXT, CORPUS)      # every draft node has one


@dataclass(frozen=True)
class Proposal:
    tokens: list[int]          # the proposed continuation, first token first
    source: str
    strengths: tuple[int, ...]  # of each token: the context match's length (tokens), or the
    #                            corpus step's share of what followed its context, in tenths


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


@dataclass
class NgramTable:
    """Contexts of one length n, packed into int64 keys (sorted), with their most frequent next
    token and its share of what followed them."""
    keys: np.ndarray       # [M] int64
    next_ids: np.ndarray   # [M] int32
    probs: np.ndarray      # [M] float32


class CorpusIndex:
    def __init__(self, tables: dict[int, NgramTable], bits: int, fingerprint: str):
        self.tables, self.bits, self.fingerprint = tables, bits, fingerprint
        self.max_n = max(tables, default=0)

    @classmethod
    def build(cls, sequences: list[tuple[list[int], list[int]]], vocab_size: int, fingerprint: str,
              max_n: int = 3, min_count: int = 2) -> "CorpusIndex":
        """sequences: (prompt ids, answer ids); next tokens are counted at answer positions."""
        bits = max(1, int(vocab_size - 1).bit_length())
        max_n = min(max_n, 63 // bits)
        tables = {}
        for n in range(1, max_n + 1):
            keys, nexts = [], []
            for prompt, answer in sequences:
                seq = np.asarray(prompt + answer, dtype=np.int64)
                pos = np.arange(max(len(prompt), n), len(seq))
                if len(pos):
                    keys.append(_pack(np.stack([seq[pos - n + i] for i in range(n)], 1), bits))
                    nexts.append(seq[pos])
            if keys:
                tables[n] = _most_frequent(np.concatenate(keys), np.concatenate(nexts), min_count)
        return cls(tables, bits, fingerprint)

    def propose(self, tokens: list[int], limit: int, min_prob: float) -> Proposal | None:
        """A greedy walk of the n-gram table (longest known context first) while the product of
        the steps' shares stays >= min_prob."""
        ctx = list(tokens[-self.max_n:]) if self.max_n else []
        out, strengths, prob = [], [], 1.0
        while len(out) < limit:
            found = self._lookup(ctx)
            if found is None:
                break
            _, token, share = found
            prob *= share
            if prob < min_prob:
                break
            out.append(token)
            strengths.append(int(share * 10))
            ctx = (ctx + [token])[-self.max_n:]
        return Proposal(out, CORPUS, tuple(strengths)) if out else None

    def _lookup(self, ctx: list[int]) -> tuple[int, int, float] | None:
        for n in range(min(len(ctx), self.max_n), 0, -1):
            table = self.tables.get(n)
            if table is None:
                continue
            key = int(_pack(np.asarray([ctx[-n:]], dtype=np.int64), self.bits)[0])
            i = int(np.searchsorted(table.keys, key))
            if i < len(table.keys) and table.keys[i] == key:
                return n, int(table.next_ids[i]), float(table.probs[i])
        return None

    def save(self, path: Path) -> None:
        arrays = {f"{name}_{n}": getattr(t, name) for n, t in self.tables.items()
                  for name in ("keys", "next_ids", "probs")}
        np.savez_compressed(path, bits=self.bits, fingerprint=self.fingerprint, **arrays)

    @classmethod
    def load(cls, path: Path, fingerprint: str) -> "CorpusIndex":
        """ValueError if the index was built with another tokenizer."""
        with np.load(path) as f:
            built_with = str(f["fingerprint"])
            if built_with != fingerprint:
                raise ValueError(f"corpus index {path} was built with another tokenizer "
                                 f"(fingerprint {built_with}, the target's is {fingerprint}): "
                                 "rebuild it with `python -m eagle_serve.lookup build`")
            orders = sorted({int(k.split("_")[-1]) for k in f.files if k.startswith("keys_")})
            tables = {n: NgramTable(f[f"keys_{n}"], f[f"next_ids_{n}"], f[f"probs_{n}"]) for n in orders}
            return cls(tables, int(f["bits"]), built_with)


def load_corpus_index(path: Path, tokenizer) -> CorpusIndex:
    """The index at path, checked against the target's tokenizer (ValueError if another)."""
    return CorpusIndex.load(path, tokenizer_fingerprint(tokenizer))


def _pack(ctx: np.ndarray, bits: int) -> np.ndarray:
    """[M, n] token ids -> [M] int64 keys (exact: n * bits <= 63)."""
    key = np.zeros(ctx.shape[0], dtype=np.int64)
    for i in range(ctx.shape[1]):
        key = (key << bits) | ctx[:, i]
    return key


def _most_frequent(keys: np.ndarray, nexts: np.ndarray, min_count: int) -> NgramTable:
    order = np.lexsort((nexts, keys))
    k, x = keys[order], nexts[order]
    new_pair = np.r_[True, (k[1:] != k[:-1]) | (x[1:] != x[:-1])]
    starts = np.flatnonzero(new_pair)
    pk, px, count = k[starts], x[starts], np.diff(np.r_[starts, len(k)])
    group = np.cumsum(np.r_[True, pk[1:] != pk[:-1]]) - 1
    total = np.bincount(group, weights=count)
    best = np.lexsort((-count, group))
    best = best[np.r_[True, group[best][1:] != group[best][:-1]]]   # first of each group
    keep = best[count[best] >= min_count]
    return NgramTable(pk[keep], px[keep].astype(np.int32),
                      (count[keep] / total[group[keep]]).astype(np.float32))


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
                found[CORPUS] = corpus.propose(tokens[-corpus.max_n:], limit, min_prob)
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
    parser = argparse.ArgumentParser(prog="python -m eagle_serve.lookup",
                                     description="Build the corpus index of a target's answers; "
                                                 "measure the lookups along held-out answers.")
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build")
    build.add_argument("--corpus", type=Path, nargs="+", required=True,
                       help="folders of .jsonl[.gz] records with prompt_ids and output_ids")
    build.add_argument("--target", default="default", help="the target model (its tokenizer)")
    build.add_argument("--out", type=Path, required=True)
    build.add_argument("--max-n", type=int, default=3)
    ev = sub.add_parser("eval", help="the lookups along answers the index was not built from")
    ev.add_argument("--answers", type=Path, required=True,
                    help="a corpus folder of the target's answers to held-out prompts (e.g. the "
                         "answers/ of `python -m eagle_serve.train eval --teacher-forced WORK`)")
    ev.add_argument("--index", type=Path, default=None, help="a corpus index (none: the context alone)")
    ev.add_argument("--target", default="default", help="the target model (its tokenizer)")
    ev.add_argument("--limit", type=int, default=4, help="tokens per proposal")
    args = parser.parse_args(argv)
    from eagle_serve import paths
    from eagle_serve.tokenization import load_tokenizer
    tokenizer = load_tokenizer(paths.resolve_model_path(args.target, Path.cwd()))
    if args.command == "eval":
        from eagle_serve.drafting import CORPUS_MIN_PROB
        corpus = load_corpus_index(args.index, tokenizer) if args.index else None
        report = lookup_accuracy(read_corpus(args.answers), corpus, args.limit, CORPUS_MIN_PROB)
        print(json.dumps(report, indent=2))
        return
    records = [r for folder in args.corpus for r in read_corpus(folder)]
    check_corpus_tokenizer(records, tokenizer)
    index = CorpusIndex.build([(r.prompt_ids, r.output_ids) for r in records], len(tokenizer),
                              tokenizer_fingerprint(tokenizer), args.max_n)
    index.save(args.out)
    sizes = {n: len(t.keys) for n, t in index.tables.items()}
    print(f"{args.out}: {len(records)} answers, contexts per order {sizes}")


if __name__ == "__main__":
    main()

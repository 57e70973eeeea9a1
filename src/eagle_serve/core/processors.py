"""Logits processors: what a request's parameters do to the target's logits at a scored row,
before the argmax, the sampling probabilities and the logprobs are taken from them.

One home for all of them, applied by the target to every scored row alike, so that a verify
row sees exactly what plain decoding sees at that position: the prompt, the output so far,
and the drafts on the row's own path (its ancestors in a draft tree). Hence greedy output with
processors equals plain greedy output with them, and sampled output is distributed as plain
decoding's. In vLLM's order (v1 sampler), per row:
  1. bans and biases: bad words (-inf where the output ends in a bad word's first tokens),
     EOS and stop_token_ids below min_tokens (-inf), logit_bias (added);
  2. penalties: repetition (prompt and output tokens: a positive logit divided by it, a
     negative one multiplied), then frequency (x its count in the output) and presence (once)
     subtracted;
  -- logprobs are the log-softmax here: the model's own distribution under the request's
     processors, independent of temperature and truncation (OpenAI's meaning);
  3. min_p (sampled rows): tokens below min_p x the most likely one's probability after
     temperature are dropped, then temperature, top-k and top-p (kernels.sampling).

The host (`ProcessorRows`) lists per row what the processors need as flat index arrays, so
the target applies them in a few vectorised ops whatever the batch holds. Requests without
processors or logprobs add nothing, and keep the target's fast path (screened argmax).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from eagle_serve.core import staging
from eagle_serve.core.requests import MAX_BAD_WORD_TOKENS, TokenLogprob


@dataclass
class LogitsProcessors:
    """A verify batch's processors; rows index the R scored rows. Absent parts are empty."""
    edit_rows: torch.Tensor        # [M] int64
    edit_ids: torch.Tensor         # [M] int64
    edit_values: torch.Tensor      # [M] float32: added (accumulating); -inf bans
    penalty_rows: torch.Tensor     # [P] int64: rows with a penalty
    repetition: torch.Tensor       # [P] float32 (1 = off)
    frequency: torch.Tensor        # [P] float32 (0 = off)
    presence: torch.Tensor         # [P] float32 (0 = off)
    seen_rows: torch.Tensor        # [S] int64: indices into penalty_rows
    seen_ids: torch.Tensor         # [S] int64: a token of the row's prompt or output
    seen_output: torch.Tensor      # [S] float32: 1 for an output occurrence (counted), 0 for a
    #                                prompt token (seen only)
    min_p: torch.Tensor            # [R] float32, or [0]: no row has min_p
    logprob_rows: torch.Tensor     # [L] int64: rows whose log-softmax is returned
    mask_rows: torch.Tensor        # [G] int64: rows a grammar constrains (eagle_serve.core.grammar)
    mask_words: torch.Tensor       # [G, W/2] int64: their allowed tokens, xgrammar's int32
    #                                bitmask (bit t % 32 of word t // 32) two words to an int64

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @staticmethod
    def dtype(name: str) -> torch.dtype:
        return torch.int64 if name.endswith(("rows", "ids", "words")) else torch.float32

    @classmethod
    def staged(cls, staged: dict[str, torch.Tensor]) -> "LogitsProcessors":
        return cls(*(staged["proc_" + name] for name in cls.names()))

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in self.names()}


def apply_processors(logits: torch.Tensor, procs: LogitsProcessors) -> torch.Tensor | None:
    """Steps 1 and 2 in place on logits [R, V] -> the log-softmax [L, V] of the logprob rows
    (None without any). Step 3 is `min_p_mask`."""
    dev = logits.device
    if procs.mask_rows.numel():
        rows = procs.mask_rows.to(dev)
        logits[rows] = logits[rows].masked_fill(~allowed_tokens(procs.mask_words.to(dev), logits.shape[1]),
                                                float("-inf"))
    if procs.edit_rows.numel():
        rows, ids = procs.edit_rows.to(dev), procs.edit_ids.to(dev)
        logits.index_put_((rows, ids), procs.edit_values.to(dev, logits.dtype), accumulate=True)
    if procs.penalty_rows.numel():
        _penalise(logits, procs)
    if not procs.logprob_rows.numel():
        return None
    rows = logits[procs.logprob_rows.to(dev)]
    return torch.log_softmax(rows if rows.dtype == torch.float64 else rows.float(), dim=-1)


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, W/2] int64 bitmask words -> [G, V] bool."""
    w32 = words.contiguous().view(torch.int32)                                  # [G, W]
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (w32.unsqueeze(-1) >> shifts) & 1                                    # [G, W, 32]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def _penalise(logits: torch.Tensor, procs: LogitsProcessors) -> None:
    """vLLM's apply_penalties over the penalty rows (dense [P, V]: P is a few rows), in float32
    at least (a bfloat16 count is exact only up to 256)."""
    dev = logits.device
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    prows = procs.penalty_rows.to(dev)
    x = logits[prows].to(dtype)                              # [P, V]
    where = (procs.seen_rows.to(dev), procs.seen_ids.to(dev))
    counts = torch.zeros_like(x).index_put_(where, procs.seen_output.to(dev, dtype), accumulate=True)
    seen = torch.zeros(x.shape, dtype=torch.bool, device=dev).index_put_(
        where, torch.ones((), dtype=torch.bool, device=dev))
    rep = torch.where(seen, procs.repetition.to(dev, dtype).unsqueeze(1), torch.ones((), dtype=dtype, device=dev))
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - procs.frequency.to(dev, dtype).unsqueeze(1) * counts
    x = x - procs.presence.to(dev, dtype).unsqueeze(1) * (counts > 0).to(dtype)
    logits[prows] = x.to(logits.dtype)


def min_p_mask(logits: torch.Tensor, min_p: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """Step 3 on sampled rows' logits [S, V] (their min_p, temperature [S]) -> masked logits:
    p_i < min_p p_max after temperature is l_i < l_max + T log(min_p), so the cut is taken on
    the logits (temperature and top-k/top-p then run as without min_p)."""
    on = min_p > 0
    if not bool(on.any()):
        return logits
    cut = logits.max(dim=-1, keepdim=True).values + (temperature * torch.log(min_p.clamp(min=1e-30))).unsqueeze(1).to(logits.dtype)
    return logits.masked_fill((logits < cut) & on.unsqueeze(1), float("-inf"))


def request_processors(req) -> bool:
    """Whether the request needs any of steps 1-2 beyond min_tokens (which `ProcessorRows`
    handles for every request)."""
    p = req.params
    return bool(p.logit_bias or req.bad_word_ids or p.repetition_penalty != 1
                or p.frequency_penalty or p.presence_penalty)


class ProcessorRows:
    """Collects the processors of a verify batch's scored rows on the host -> staging fields."""

    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos = eos_token_ids
        self.num_rows = 0
        self.edit_rows, self.edit_ids, self.edit_values = [], [], []
        self.penalty_rows, self.repetition, self.frequency, self.presence = [], [], [], []
        self.seen_rows, self.seen_ids, self.seen_output = [], [], []
        self.min_p: list[float] = []
        self.logprob_rows: list[int] = []
        self.mask_rows: list[int] = []
        self.masks: list[np.ndarray] = []  # [rows, W] int32 each

    def add(self, req, paths: list[list[int]], depths: list[int]) -> None:
        """The request's scored rows, in order: paths[j] = the drafts before row j (row 0: [],
        the last real token's row), depths[j] = how far past the last token it predicts."""
        p, first = req.params, self.num_rows
        self.num_rows += len(paths)
        self.min_p += [p.min_p] * len(paths)
        if p.logprobs is not None:
            self.logprob_rows += range(first, first + len(paths))
        if req.grammar is not None:
            self.mask_rows += range(first, first + len(paths))
            self.masks.append(req.grammar.masks(req.drafts, req.parents))
        stops = self.eos + p.stop_token_ids
        for j, d in enumerate(depths):  # below min_tokens: no EOS, no stop token id
            if req.eos_banned(d):
                self._edit(first + j, stops, -math.inf)
        if not request_processors(req):
            return
        output = req.output
        for j, path in enumerate(paths):
            row = first + j
            if p.logit_bias:
                self._edit(row, [t for t, _ in p.logit_bias], [b for _, b in p.logit_bias])
            if req.bad_word_ids:
                self._edit(row, banned_words(req.bad_word_ids, output, path), -math.inf)
        if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
            self._penalties(req, paths)

    def add_prompt_rows(self, n: int) -> None:
        """n rows after every scored one, for prompt logprobs: raw logits (no processors)."""
        self.logprob_rows += range(self.num_rows, self.num_rows + n)
        self.min_p += [0.0] * n
        self.num_rows += n

    def _edit(self, row: int, ids, values) -> None:
        ids = list(ids)
        self.edit_rows += [row] * len(ids)
        self.edit_ids += ids
        self.edit_values += list(values) if isinstance(values, (list, tuple)) else [values] * len(ids)

    def _penalties(self, req, paths: list[list[int]]) -> None:
        p = req.params
        prompt = req.prompt_set() if p.repetition_penalty != 1 else np.zeros(0, dtype=np.int64)
        output = np.asarray(req.output, dtype=np.int64)
        first = self.num_rows - len(paths)
        for j, path in enumerate(paths):
            k = len(self.penalty_rows)
            self.penalty_rows.append(first + j)
            self.repetition.append(p.repetition_penalty)
            self.frequency.append(p.frequency_penalty)
            self.presence.append(p.presence_penalty)
            ids = np.concatenate([prompt, output, np.asarray(path, dtype=np.int64)])
            self.seen_ids.append(ids)
            self.seen_rows.append(np.full(len(ids), k, dtype=np.int64))
            self.seen_output.append(np.concatenate([np.zeros(len(prompt), np.float32),
                                                    np.ones(len(ids) - len(prompt), np.float32)]))

    def fields(self) -> dict[str, np.ndarray]:
        cat = lambda parts, dtype: (np.concatenate(parts).astype(dtype) if parts  # noqa: E731
                                    else np.zeros(0, dtype))
        return {"proc_edit_rows": staging.int64(self.edit_rows),
                "proc_edit_ids": staging.int64(self.edit_ids),
                "proc_edit_values": staging.float32(self.edit_values),
                "proc_penalty_rows": staging.int64(self.penalty_rows),
                "proc_repetition": staging.float32(self.repetition),
                "proc_frequency": staging.float32(self.frequency),
                "proc_presence": staging.float32(self.presence),
                "proc_seen_rows": cat(self.seen_rows, np.int64),
                "proc_seen_ids": cat(self.seen_ids, np.int64),
                "proc_seen_output": cat(self.seen_output, np.float32),
                "proc_min_p": staging.float32(self.min_p if any(self.min_p) else []),
                "proc_logprob_rows": staging.int64(self.logprob_rows),
                "proc_mask_rows": staging.int64(self.mask_rows),
                "proc_mask_words": _as_int64_words(self.masks)}

    @property
    def empty(self) -> bool:
        return not (self.edit_rows or self.penalty_rows or any(self.min_p) or self.logprob_rows
                    or self.mask_rows)


def _as_int64_words(masks: list[np.ndarray]) -> np.ndarray:
    """[rows, W] int32 bitmasks -> [rows, ceil(W / 2)] int64 (staging moves int64)."""
    if not masks:
        return np.zeros((0, 0), dtype=np.int64)
    words = np.concatenate(masks)
    if words.shape[1] % 2:
        words = np.concatenate([words, np.zeros((words.shape[0], 1), dtype=np.int32)], axis=1)
    return np.ascontiguousarray(words).view(np.int64)


def banned_words(words: tuple[tuple[int, ...], ...], output: list[int], path: list[int]) -> list[int]:
    """vLLM's bad words: a one-token word is always banned; a longer one's last token is banned
    where the output (with the row's drafts) ends in its other tokens."""
    banned = []
    for word in words:
        n = len(word) - 1
        if n == 0:
            banned.append(word[0])
            continue
        tail = (output[-n:] + path)[-n:]
        if len(tail) == n and tuple(tail) == word[:n]:
            banned.append(word[-1])
    return banned


def bad_word_ids(tokenizer, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as it would follow text and start it (vLLM's: with and without a
    leading space, when the spaced form is another token sequence of the same length)."""
    out: list[tuple[int, ...]] = []
    for word in words:
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (bare, spaced):
            if ids and ids not in out and len(ids) <= MAX_BAD_WORD_TOKENS:
                out.append(ids)
    return tuple(out)


def token_logprobs(logprobs: torch.Tensor, picks: list[tuple[int, int, int]]) -> list[TokenLogprob]:
    """logprobs [L, V]; picks: (row of logprobs, token id, top count) per emitted token -> the
    token's logprob and its top alternatives, read to the host in one go."""
    if not picks:
        return []
    rows = torch.tensor([r for r, _, _ in picks], dtype=torch.int64, device=logprobs.device)
    ids = torch.tensor([t for _, t, _ in picks], dtype=torch.int64, device=logprobs.device)
    chosen = logprobs[rows, ids].tolist()
    width = max(n for _, _, n in picks)
    top_v, top_i = (logprobs[rows].topk(width, dim=-1) if width
                    else (logprobs.new_zeros((len(picks), 0)), rows.new_zeros((len(picks), 0))))
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, c, list(zip(top_i[i][:n], top_v[i][:n])))
            for i, ((_, t, n), c) in enumerate(zip(picks, chosen))]

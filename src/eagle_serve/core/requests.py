"""One request inside the engine: what the client asked for (`SamplingParams`), the state the
engine keeps for it (`Request`), and what a round hands back (`RequestOutput`)."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from eagle_serve.core.grammar import GrammarState, check_guide
from eagle_serve.core.stopping import StopChecker
from eagle_serve.settings import MAX_DRAFT_DEPTH, MAX_DRAFT_TOPK, EngineConfig
from eagle_serve.spec.lookup import HEAD, ContextIndex
from eagle_serve.spec.lookup_scores import LookupKey, LookupScores

if TYPE_CHECKING:
    import torch


def acceptance_length(accepted_tokens: int, rounds: int) -> float:
    """Tokens a request gains per verify round: its accepted drafts plus the target's own token
    each round, over the rounds (1.0 for plain decoding)."""
    return (accepted_tokens + rounds) / rounds if rounds else 0.0


@dataclass
class AcceptanceRecord:
    """A request's recent drafting: decayed counts of the draft positions its rounds reached
    (a position is reached when every draft before it was accepted) and of those accepted."""
    reached: float = 0.0
    accepted: float = 0.0
    idle_rounds: int = 0            # verified rounds in a row without drafts
    probes: int = 0                 # probe drafts since its drafts last paid (drafting._probe)

    DECAY = 0.9                     # per drafting round: recent rounds count most

    def observe(self, offered: int, accepted: int) -> None:
        """offered: the deepest draft of the round (a chain: its length); accepted: drafts kept."""
        self.record(min(accepted + 1, offered), accepted)

    def record(self, reached: int, accepted: int) -> None:
        """A drafting round: `reached` drafts whose parent was accepted, `accepted` of them kept."""
        self.reached = self.DECAY * self.reached + reached
        self.accepted = self.DECAY * self.accepted + accepted
        self.idle_rounds = 0

    def rate(self, prior: float, weight: float) -> float:
        """Estimated chance that a reached draft is accepted (`prior` counted `weight` times)."""
        return (self.accepted + prior * weight) / (self.reached + weight)


MAX_CACHE_SALT_BYTES = 256
MAX_TOP_LOGPROBS = 20        # OpenAI's bound on top_logprobs
MAX_LOGIT_BIAS = 1024        # entries of one request's logit_bias
MAX_BAD_WORDS = 64           # bad words of one request, each at most MAX_BAD_WORD_TOKENS long
MAX_BAD_WORD_TOKENS = 32
MAX_STOP_TOKEN_IDS = 64
MAX_STOP_STRINGS = 32        # stop strings of one request,
MAX_STOP_BYTES = 4096        # and their total UTF-8 size


@dataclass
class TokenLogprob:
    """One token's logprob and the most likely alternatives at its position (eagle_serve.core.processors)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]] | None  # (token id, logprob), most likely first (None: no
    #                                      logprob, the first prompt token of an echo)


TO_THE_END = -1  # max_tokens: as many as the context holds (vLLM's unset max_tokens, llama.cpp's -1)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = off
    seed: int | None = None           # None = a random seed
    num_speculative_tokens: int | None = None  # None = the engine's default; 0 = plain decoding
    stop: tuple[str, ...] = ()        # stop strings, excluded from the output
    ignore_eos: bool = False
    draft_topk: int | None = None     # children per tree node; None = the engine's; 1 = chain
    draft_depth: int | None = None    # tree levels; None = the engine's
    context_lookup: bool = True       # greedy drafts may add branches looked up in the request's
    corpus_lookup: bool = True        # own tokens / in the corpus of the target's answers
    min_tokens: int = 0               # no EOS and no stop string ends the output before this
    #                                   many tokens (EOS is masked in the target's logits)
    cache_salt: str = ""              # requests share cached KV pages only with the same salt
    # logits processors (eagle_serve.core.processors), vLLM's meanings:
    presence_penalty: float = 0.0     # subtracted once from each token in the output
    frequency_penalty: float = 0.0    # subtracted per occurrence in the output
    repetition_penalty: float = 1.0   # divides positive / multiplies negative logits of tokens
    #                                   in the prompt or output
    min_p: float = 0.0                # sampled: drop tokens below min_p x the top probability
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    bad_words: tuple[str, ...] = ()   # never generated (each word's last token is banned where
    #                                   the output ends in its other tokens)
    stop_token_ids: tuple[int, ...] = ()  # end the output ("stop"), left out of it
    logprobs: int | None = None       # None: none; n: each output token's logprob and the n most
    #                                   likely alternatives (0-20)
    prompt_logprobs: int | None = None  # the same for each prompt token but the first (raw
    #                                   logits; the prompt is computed, not read from the cache)
    guide: tuple[str, str] | None = None  # structured output: (guide type, guide), as
    #                                   eagle_serve.core.grammar.GUIDE_TYPES (TensorRT-LLM's names)

    def validate(self, cfg: EngineConfig, max_k: int) -> None:
        """max_k: the largest k this engine drafts (0 without a drafter)."""
        stop_bytes = sum(len(s.encode("utf-8")) for s in self.stop)
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got {self.min_tokens}"),
            (math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (self.num_speculative_tokens is None or 0 <= self.num_speculative_tokens <= max_k,
             f"num_speculative_tokens must be in [0, {max_k}], got {self.num_speculative_tokens}"),
            (all(self.stop), "stop strings must not be empty"),
            (len(self.stop) <= MAX_STOP_STRINGS,
             f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}"),
            (stop_bytes <= MAX_STOP_BYTES, f"stop strings may total at most {MAX_STOP_BYTES} bytes, got {stop_bytes}"),
            (self.draft_topk is None or 1 <= self.draft_topk <= MAX_DRAFT_TOPK,
             f"draft_topk must be in [1, {MAX_DRAFT_TOPK}], got {self.draft_topk}"),
            (self.draft_depth is None or 1 <= self.draft_depth <= MAX_DRAFT_DEPTH,
             f"draft_depth must be in [1, {MAX_DRAFT_DEPTH}], got {self.draft_depth}"),
            (len(self.cache_salt.encode("utf-8")) <= MAX_CACHE_SALT_BYTES,
             f"cache_salt may be at most {MAX_CACHE_SALT_BYTES} bytes"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= 10,
             f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (len(self.logit_bias) <= MAX_LOGIT_BIAS,
             f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}"),
            (all(math.isfinite(b) for _, b in self.logit_bias), "logit_bias values must be finite"),
            (len({t for t, _ in self.logit_bias}) == len(self.logit_bias), "logit_bias names a token twice"),
            (len(self.bad_words) <= MAX_BAD_WORDS,
             f"at most {MAX_BAD_WORDS} bad_words are allowed, got {len(self.bad_words)}"),
            (all(w.strip() and len(w) <= 256 for w in self.bad_words),
             "bad_words must be non-empty and at most 256 characters each"),
            (len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_TOP_LOGPROBS,
             f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.guide is not None:
            check_guide(self.guide)
            if self.ignore_eos:
                raise ValueError("ignore_eos cannot be combined with a guide: the grammar ends the output")


@dataclass
class RequestOutput:
    """What one round produced for one request; counters are running totals."""
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str          # "" until finished, then "length", "stop" or "cancelled"
    num_input_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_rounds: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    logprobs: list[TokenLogprob] | None = None  # of new_token_ids, when the request asked
    queued_s: float = field(default=0.0, compare=False)  # arrival to first admission (a time:
    #                             outputs of equal runs compare equal)
    prompt_logprobs: list[TokenLogprob] | None = None  # of the prompt's tokens but the first:
    #                             in the first output with tokens, when the request asked
    error: str = ""             # the request failed: a message for its client (finished, no reason)
    error_code: str = ""        # then: "INTERNAL" (a model call failed) or "UNAVAILABLE" (limits)
    cause: BaseException | None = field(default=None, repr=False)  # what failed (logged, not sent)


@dataclass(eq=False)  # identity: `req in running` must not compare fields
class Request:
    id: str
    prompt_len: int
    params: SamplingParams
    k: int                          # drafts verified per round (tree: nodes), 0 = plain decoding
    seed: int
    stop: StopChecker | None
    tokens: list[int]               # prompt + output
    coupled: bool = False           # sampled, verified by coupling (settings.drafting.sampled_verify)
    topk: int = 1                   # draft-tree shape (1 = chain; rejection-sampled requests: 1)
    depth: int = 0                  # <= k
    arrival: int = 0                # admission order
    arrived_at: float = field(default_factory=time.monotonic)
    admitted: bool = False          # has been in the running batch
    queued_s: float = 0.0           # arrival to first admission
    suspect: bool = False           # was in a batch whose model call failed: runs alone until a
    #                                 round of its own verifies its drafts (engine.SOLO_ROUNDS)
    isolations: int = 0             # times a batch it was in failed (engine.MAX_ISOLATIONS)
    solo_rounds: int = 0            # rounds run alone since the last isolation
    num_computed: int = 0           # positions in the target's KV
    draft_computed: int = 0         # positions in the drafter's KV
    chunk: int | None = None        # this round computes at most this many of its uncomputed
    #                                 tokens (chunked prefill; None = all)
    page_keys: list[bytes] = field(default_factory=list)  # names of its full target pages
    #                                 (eagle_serve.core.prefix_cache)
    published_target: int = 0       # its first pages named in the prefix cache, per pool
    published_drafter: int = 0
    num_cached_tokens: int = 0      # prompt tokens its first admission found in the cache
    drafts: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)   # of each draft (-1 = the last token)
    kv_moves: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) target positions,
    #                                 applied by the next forward (the accepted tree path)
    draft_slots: list[int] = field(default_factory=list)
    draft_keys: list[LookupKey | None] = field(default_factory=list)  # of each lookup draft
    #                                 (None: the head's)
    lookup_budget: int = 0          # drafts lookup sources may add to the k of the head
    context: ContextIndex | None = None  # the request's own tokens, for context lookup
    acceptance: AcceptanceRecord = field(default_factory=AcceptanceRecord)         # head drafts
    lookup_scores: LookupScores | None = None  # where its verified lookup drafts are counted
    #                                 (the process's table: drafting.DraftPolicy.lookup_scores)
    undrafted: list[torch.Tensor] = field(default_factory=list)  # [n_i, F] each: target
    #                                 features of verified positions the drafter has not seen
    #                                 (rounds that drafted nothing), joined when it next drafts
    target_pages: list[int] = field(default_factory=list)
    drafter_pages: list[int] = field(default_factory=list)
    num_sent: int = 0               # output tokens handed out
    finish_reason: str = ""
    error: str = ""                 # set when the request failed
    error_code: str = ""
    cause: BaseException | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_rounds: int = 0
    bad_word_ids: tuple[tuple[int, ...], ...] = ()  # params.bad_words as token ids
    grammar: GrammarState | None = None  # params.guide's matcher, at the end of the output
    grammar_future: object | None = field(default=None, repr=False)  # its compile, until done
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of each output token (asked)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (asked)
    _prompt_set: np.ndarray | None = field(default=None, repr=False)

    def prompt_set(self) -> np.ndarray:
        """The distinct prompt token ids (the repetition penalty's), found once."""
        if self._prompt_set is None:
            self._prompt_set = np.unique(np.asarray(self.tokens[:self.prompt_len], dtype=np.int64))
        return self._prompt_set

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    @property
    def uncomputed(self) -> int:
        """Tokens whose KV the target has not computed (1 while decoding: the last one)."""
        return len(self.tokens) - self.num_computed

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    @property
    def matched(self) -> bool:
        """Its drafts are kept while they equal the target's own token: greedy requests (the
        argmax) and coupled sampled ones (the target's seeded sample); neither carries q."""
        return self.greedy or self.coupled

    @property
    def rule(self) -> str:
        """How its drafts are verified: "greedy" (kept while they equal the argmax), "coupled"
        (while they equal the target's seeded sample) or "rejection" (rejection sampling)."""
        return "greedy" if self.greedy else "coupled" if self.coupled else "rejection"

    @property
    def done(self) -> bool:
        return bool(self.finish_reason or self.error)

    def eos_banned(self, depth: int) -> bool:
        """Whether EOS is masked for the token `depth` places past the last one (0 = the next
        token): its output position is below min_tokens."""
        return not self.params.ignore_eos and len(self.output) + depth < self.params.min_tokens

    def sampling_row(self) -> tuple[float, int, float, int]:
        p = self.params
        return (p.temperature, p.top_k, p.top_p, self.seed)

    @property
    def draft_sources(self) -> list[str]:
        """The source of each draft (lookup.SOURCES)."""
        return [HEAD if key is None else key.source for key in self.draft_keys]

    @property
    def is_tree(self) -> bool:
        """Drafts that are not a chain (-1, 0, 1, ...)."""
        return any(p != j - 1 for j, p in enumerate(self.parents))

    def clear_drafts(self) -> None:
        self.drafts, self.draft_slots, self.parents, self.draft_keys = [], [], [], []

    def drafter_scratch(self) -> int:
        """Drafter positions past the verified ones that one drafting round may write."""
        return max(self.k, self.topk * (self.depth - 1)) if self.topk > 1 else self.k

    def fail(self, message: str, code: str, cause: BaseException | None = None) -> None:
        self.error, self.error_code, self.cause = message, code, cause

    def append(self, tokens: list[int], eos_token_ids: tuple[int, ...],
               logprobs: list[TokenLogprob] | None = None) -> None:
        """Add accepted tokens (and their logprobs) up to EOS, max_tokens, a stop token id, the
        end of the request's grammar or a stop string (stop ids and strings cut out)."""
        p = self.params
        for tok in tokens:
            self.tokens.append(tok)
            if tok in p.stop_token_ids and len(self.output) > p.min_tokens:
                del self.tokens[-1]
                self.finish_reason = "stop"
            elif tok in eos_token_ids and not p.ignore_eos:
                self.finish_reason = "stop"
            elif self.grammar is not None and self.grammar.accept(tok):
                self.finish_reason = "stop"  # the grammar took its stop token: the output is whole
            elif len(self.output) >= p.max_tokens:
                self.finish_reason = "length"
            if self.finish_reason:
                break
        if logprobs:
            self.logprobs += logprobs
        if self.stop is not None and self.stop.check(self.output):
            del self.tokens[self.prompt_len + self.stop.keep:]
            self.finish_reason = "stop"
        del self.logprobs[len(self.output):]

    def take_output(self, force: bool = False) -> RequestOutput | None:
        """The tokens not handed out yet (held back while they could start a stop string), with
        the running totals; None when there is nothing to say."""
        if self.error:
            return RequestOutput(self.id, [], True, "", self.prompt_len, len(self.output),
                                 self.num_draft_tokens, self.num_accepted_tokens, self.num_rounds,
                                 error=self.error, error_code=self.error_code, cause=self.cause)
        upto = len(self.output)
        if self.stop is not None and not self.finish_reason:
            upto = self.stop.safe_upto(self.output)
        new = self.output[self.num_sent:upto]
        if not new and not self.finish_reason and not force:
            return None
        logprobs = self.logprobs[self.num_sent:upto] if self.params.logprobs is not None else None
        prompt = self.prompt_logprobs if self.params.prompt_logprobs is not None and not self.num_sent else None
        self.num_sent += len(new)
        return RequestOutput(self.id, new, bool(self.finish_reason), self.finish_reason,
                             self.prompt_len, len(self.output), self.num_draft_tokens,
                             self.num_accepted_tokens, self.num_rounds, self.num_cached_tokens,
                             logprobs, self.queued_s, prompt)


@dataclass
class Completion:
    """A request run to the end by `Engine.generate`."""
    token_ids: list[int]
    finish_reason: str
    last: RequestOutput | None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of each token (asked)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.. (asked)

    @property
    def acceptance_length(self) -> float:
        o = self.last
        return acceptance_length(o.num_accepted_tokens, o.num_rounds) if o else 0.0

"""What drafting costs on the machine the server runs on, measured while it runs.

The draft policy weighs a request's expected accepted tokens against what its drafts cost: the
drafter call of the round and one more verify row per draft, as shares of a plain decoding
round. Those shares differ several-fold between machines (a verify row is nearly free where the
target forward is bound by memory or by per-op overhead, and costs a few percent of a step where
it is bound by arithmetic: fp32 on an AVX2 CPU), so the engine measures them: the wall time of
each decode/verify target call by its row count, and of each drafter call. `shares` fits the
target's time as a line in the row count (least squares over the row counts seen, each its
exponential moving average weighted by how often it ran lately, leaving out the largest row counts
that together ran under TRIM of the calls: the line follows the row counts the server runs, and
a few calls of many rows, e.g. first rounds' whole trees and their lookup branches, do not make
every row look dear) and returns, for a batch of B
requests:

    call = drafter call / plain round         (the call serves the round: each drafting request's
                                               tokens pay for all of it, as its round waits on it)
    step = slope x B / plain round            (a row of one request delays all B requests)

where the plain round is the target call for B rows. Until enough has been measured the policy
uses the static settings: all of them until the line has two row counts, the drafter call's until
MIN_CALLS calls were timed (a server whose head rarely pays calls it rarely, and its lookup
branches, which cost rows only, need not wait for that). Seeded rejection-sampled requests
always use the static settings, so their drafts, and so their output, never depend on timings
(see drafting._seeded_rejection).
"""
from __future__ import annotations

from dataclasses import dataclass

SMOOTHING = 0.2      # weight of a new sample in a row count's moving average
MIN_CALLS = 8        # drafter calls measured before the measured shares are used
MIN_ROW_COUNTS = 2   # distinct target row counts measured (a slope needs two)
DECAY = 0.995        # a row count's weight in the line: its calls, each older call counting
#                      this much less (the last few hundred calls set the shares)
TRIM = 0.05          # share of the calls, the largest row counts', the line leaves out
FORGET = 0.01        # a row count whose decayed calls fall below this is forgotten (unseen for
#                      ~1000 calls, its average is stale): a policy that stopped drafting on a
#                      slow spell's measurements falls back to the static costs, drafts, and
#                      measures again, instead of reading those stale averages for good


@dataclass(frozen=True)
class DraftCosts:
    """What drafting adds to a round, as shares of a plain decoding round."""
    call: float | None  # the drafter call (None: not measured yet)
    step: float         # one more verify row (one draft) of one request


class MeasuredCosts:
    def __init__(self):
        self.target: dict[int, float] = {}   # rows -> moving average of the call's seconds
        self.calls: dict[int, float] = {}    # rows -> its calls, decayed (DECAY)
        self.drafter: float | None = None    # moving average of a drafter call's seconds
        self.drafter_calls = 0
        self._fit: tuple[float, float] | None = None  # line() until the next target call

    @staticmethod
    def _average(old: float | None, new: float) -> float:
        return new if old is None else old + SMOOTHING * (new - old)

    def record_target(self, rows: int, seconds: float) -> None:
        """A decode/verify target call of `rows` rows (no prefill in it) took `seconds`."""
        for r in list(self.calls):  # age (and forget) the row counts before this call counts
            self.calls[r] *= DECAY
            if self.calls[r] < FORGET:
                del self.calls[r], self.target[r]
        self.target[rows] = self._average(self.target.get(rows), seconds)
        self.calls[rows] = self.calls.get(rows, 0.0) + 1.0
        self._fit = None

    def record_drafter(self, seconds: float) -> None:
        self.drafter = self._average(self.drafter, seconds)
        self.drafter_calls += 1

    def line(self) -> tuple[float, float] | None:
        """(intercept, slope) of the target's seconds against its row count (each row count
        weighted by its calls, the rarest largest ones left out), or None."""
        if self._fit is None and len(self.target) >= MIN_ROW_COUNTS:
            self._fit = self._fit_line()
        return self._fit

    def _fit_line(self) -> tuple[float, float]:
        w, rows, left = self.calls, sorted(self.target), TRIM * sum(self.calls.values())
        while len(rows) > MIN_ROW_COUNTS and w[rows[-1]] <= left:
            left -= w[rows.pop()]
        total = sum(w[r] for r in rows)
        mean_r = sum(w[r] * r for r in rows) / total
        mean_t = sum(w[r] * self.target[r] for r in rows) / total
        var = sum(w[r] * (r - mean_r) ** 2 for r in rows)
        slope = sum(w[r] * (r - mean_r) * (self.target[r] - mean_t) for r in rows) / var
        return mean_t - slope * mean_r, slope

    def shares(self, batch_size: int) -> DraftCosts | None:
        """The costs of drafting in a round of `batch_size` requests, or None until the line is
        measured (call None until the drafter call is)."""
        fit = self.line()
        if fit is None:
            return None
        intercept, slope = fit
        plain = self.target.get(batch_size, intercept + slope * batch_size)
        if plain <= 0:
            return None
        timed = self.drafter is not None and self.drafter_calls >= MIN_CALLS
        return DraftCosts(call=self.drafter / plain if timed else None,
                          step=max(slope, 0.0) * batch_size / plain)

"""How likely a lookup draft is to be accepted, learned from the server's own rounds.

Each token of a lookup proposal (eagle_serve.spec.lookup) has a key: the request's verification
rule (Request.rule: greedy, whose drafts must equal the target's argmax; coupled, whose drafts
must equal its seeded sample; rejection-sampled, whose drafts are accepted with the target's
probability of them; on held-out prompts, 128 tokens, coupled at temperature 0.7 kept 0.48 of
the reached first context tokens and 0.34 of the first corpus tokens against greedy's 0.57 and
0.41, so one rule's outcomes would misprice the other's drafts on a server running both), the
source, the strength of what proposed it (a context match: the matched suffix's length; a
corpus step: lookup.corpus_strength, the bands of its match length, of the agreement of the
corpus's occurrences and of their number) and its place in the proposal (1, 2, 3, MAX_PLACE
and beyond). `LookupScores` keeps, per key, decayed counts of the drafts that were reached
(their parent was accepted, or they hung from the root) and of those accepted: a token's
chance of being accepted is the product of its own rate and its predecessors'. One table serves
every request of the process: a request's own few rounds say little, while a context match of 6
tokens or a unanimous corpus step after a long match behaves alike in every request, and a
proposal is scored from its first round on, with no probing.

The draft policy keeps a proposal up to its last token likely enough to pay for its verify row
(drafting.DraftPolicy.lookups); the tokens it drafts are counted by verify._observe_lookups.
"""
from __future__ import annotations

from dataclasses import dataclass

from eagle_serve.spec.lookup import Proposal

PRIOR_RATE, PRIOR_WEIGHT = 0.5, 2.0   # a key's rate before it was measured, counted this often
DECAY = 0.998                          # per count of a key: its last ~500 drafts set its rate
MAX_PLACE = 4                          # places from here on share a key


@dataclass(frozen=True)
class LookupKey:
    rule: str         # Request.rule: "greedy", "coupled" or "rejection"
    source: str       # lookup.CONTEXT or lookup.CORPUS
    strength: int     # the context match's length, or the corpus step's lookup.corpus_strength
    place: int        # 1 = the proposal's first token (capped at MAX_PLACE)


class LookupScores:
    def __init__(self):
        self.counts: dict[LookupKey, tuple[float, float]] = {}  # key -> (reached, accepted)

    @staticmethod
    def keys(proposal: Proposal, rule: str) -> list[LookupKey]:
        return [LookupKey(rule, proposal.source, s, min(i + 1, MAX_PLACE))
                for i, s in enumerate(proposal.strengths)]

    def rate(self, key: LookupKey, measured: bool = True) -> float:
        """The chance that a reached draft with this key is accepted (the prior alone unless
        `measured`: a seeded rejection-sampled request's drafts must not depend on others')."""
        reached, accepted = self.counts.get(key, (0.0, 0.0)) if measured else (0.0, 0.0)
        return (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (reached + PRIOR_WEIGHT)

    def chances(self, keys: list[LookupKey], measured: bool = True) -> list[float]:
        """[n] the chance that each of a proposal's tokens is accepted, its parent reached."""
        out, chance = [], 1.0
        for key in keys:
            chance *= self.rate(key, measured)
            out.append(chance)
        return out

    def record(self, key: LookupKey, accepted: bool) -> None:
        """A reached draft with this key was verified."""
        reached, kept = self.counts.get(key, (0.0, 0.0))
        self.counts[key] = (DECAY * reached + 1.0, DECAY * kept + float(accepted))

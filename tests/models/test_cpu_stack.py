"""An EAGLE head's layers in one C++ call (eagle_serve.models.cpu_stack.head_stack) draft exactly what
its Python loop drafts. (The target's stack: tests/models/test_architectures.py.)"""
from __future__ import annotations

import pytest
import torch

from eagle_serve.core.requests import SamplingParams
from eagle_serve.kernels.cpu import cpu_kernels
from eagle_serve.testing import tiny_engine

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the layer stack is eagle_serve/kernels/cpu.cpp's (AVX2, FMA)")


@pytest.mark.parametrize("weights", ["trained", "q8_0", "q8_0_a8"])
@pytest.mark.parametrize("head", ["eagle1_head", "eagle3_head"])
def test_a_heads_layers_in_one_call_draft_what_its_python_loop_drafts(head, weights, tiny_target, prompts,
                                                                      request):
    """fp32 on CPU: chains, draft trees and sampled chains (catch-up, feedback and tree steps
    of the head) give bitwise the same drafts, draft probabilities and tree scores whether the
    head's layers run as one call or as the Python loop; the call ran for every step (no long
    prefill here)."""
    folder = request.getfixturevalue(head)
    engines = [tiny_engine(tiny_target, folder, dtype="float32", drafter_weights=weights, max_running=3)
               for _ in range(2)]
    stacked, loop = engines
    assert stacked.drafter.stack is not None
    loop.drafter.stack = None
    calls, drafts = [], {id(e): [] for e in engines}
    run = stacked.drafter.stack.__call__
    stacked.drafter.stack = lambda *args, **kw: calls.append(run(*args, **kw)) or calls[-1]
    for e in engines:  # every drafter call's drafts, draft probabilities and tree scores
        def propose(*args, _propose=e.drafter.propose, _seen=drafts[id(e)]):
            out = _propose(*args)
            _seen.append([x for x in (out.tokens, out.probs, out.parents, out.scores) if x is not None])
            return out
        e.drafter.propose = propose
    shapes = [SamplingParams(max_tokens=12, num_speculative_tokens=4),
              SamplingParams(max_tokens=12, num_speculative_tokens=6, draft_topk=2, draft_depth=3),
              SamplingParams(max_tokens=12, num_speculative_tokens=3, temperature=0.8, seed=5)]
    seqs = [prompts[0], prompts[3], prompts[5]]
    assert ([r.token_ids for r in stacked.generate(seqs, shapes)]
            == [r.token_ids for r in loop.generate(seqs, shapes)])
    got, want = drafts[id(stacked)], drafts[id(loop)]
    assert len(got) == len(want) > 0
    assert all(len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b)) for a, b in zip(got, want))
    assert calls and all(c is not None for c in calls)

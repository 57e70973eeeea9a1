"""eagle_serve/kernels/warmup.py launches every kernel variant the served path launches.

Triton compiles a kernel once per key: its constexpr values and the specialization of every
other argument (dtype; integers equal to 1 or a multiple of 16; 16-byte aligned pointers) as
Triton's own `native_specialize_impl` computes it for CUDA. A hook records that key for each
launch while (1) the warm-up runs for a model and (2) the in-process engine serves greedy chains,
a draft tree and sampled requests with the same model, every kernel forced on CPU tensors
through the interpreter. Every key of (2) must be among those of (1): a variant the warm-up
missed would compile on a GPU at the first request that needs it.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from eagle_serve import kernels
from eagle_serve.engine import SamplingParams
from eagle_serve.kernels import layer_ops, paged_attention, rejection, sampling, warmup, workspace
from eagle_serve.local import build_local_engine
from eagle_serve.testing import make_random_head, make_tiny_llama

KERNELS = [layer_ops._add_rms_norm_kernel, layer_ops._rope_write_kv_kernel, layer_ops._silu_mul_kernel,
           paged_attention._paged_attention_kernel,
           sampling._probs_kernel, sampling._sample_kernel, rejection._greedy_accept_kernel,
           rejection._recover_kernel, rejection._random_accept_kernel,
           workspace._scatter_rows_kernel, workspace._gather_rows_kernel]


def launch_key(kernel, args, kwargs) -> tuple:
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.runtime.jit import native_specialize_impl

    names = kernel.arg_names
    bound = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    annotations = inspect.get_annotations(kernel.fn)
    not_specialized = set(kernel.kwargs.get("do_not_specialize") or ())
    key = []
    for name in names:
        if "constexpr" in str(annotations.get(name, "")):
            key.append((name, bound[name]))
        else:
            key.append((name, native_specialize_impl(CUDABackend, bound[name], False,
                                                     name not in not_specialized, True)))
    return kernel.__name__, tuple(key)


@pytest.fixture
def recorder():
    keys: set = set()
    hooks = []
    for kernel in KERNELS:
        hook = (lambda k: lambda *a, **kw: keys.add(launch_key(k, a, kw)))(kernel)
        kernel.add_pre_run_hook(hook)
        hooks.append((kernel, hook))
    yield keys
    for kernel, hook in hooks:
        kernel.pre_run_hooks.remove(hook)


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """A GQA tiny Llama (group 2, 3 layers) with a 4096-token vocabulary and an EAGLE-3 head
    drafting over 1024 of them: every kernel path, small enough for the interpreter."""
    root = tmp_path_factory.mktemp("warmup-models")
    target = make_tiny_llama(root / "target", vocab_size=4096, num_layers=3)
    return target, make_random_head(root / "eagle3", target, 3, draft_vocab_size=1024)


def test_every_tile_a_launcher_can_pick_is_warmed():
    """The tile functions saturate: sizes far beyond MAX_ROWS / MAX_QUERIES pick nothing new."""
    for group in (1, 3, 4, 8):
        warmed = set(warmup.smallest_inputs(lambda q: paged_attention.attention_tile(group, q),
                                            range(1, warmup.MAX_QUERIES + 1)))
        assert {paged_attention.attention_tile(group, q) for q in range(1, 5000)} <= warmed
    for tile in (rejection.request_block, lambda r: sampling.vocab_row_tile(r, 49152),
                 lambda r: sampling.vocab_row_tile(r, 300), lambda n: workspace.row_tile(n, 128)):
        warmed = set(warmup.smallest_inputs(tile, range(1, warmup.MAX_ROWS + 1)))
        assert {tile(n) for n in range(1, 20000, 7)} <= warmed


@pytest.mark.slow
def test_the_warmup_launches_every_variant_the_engine_launches(small_models, recorder,
                                                                kernels_on_cpu):
    target, head = small_models
    engine = build_local_engine(target, head, dtype=torch.float32, num_speculative_tokens=3,
                                num_target_pages=64, num_drafter_pages=64, num_draft_slots=64,
                                draft_call_cost=0.0, draft_step_cost=0.0,  # fixed shapes: every
                                sampled_verify="auto")  # path drafts, whatever the timings; both
    #                                                     ways of verifying sampled drafts run
    for report in (warmup.warm_target(engine.target, force=True),
                   warmup.warm_drafter(engine.drafter, force=True),
                   warmup.warm_engine(engine, force=True)):
        assert report is not None and report.launches > 0
    warmed = set(recorder)
    recorder.clear()

    prompts = [list(range(5, 37)), list(range(40, 53)), list(range(100, 103))]  # 48 tokens
    engine.generate(prompts, [SamplingParams(max_tokens=6, ignore_eos=True),
                              SamplingParams(max_tokens=6, ignore_eos=True, draft_topk=2,
                                             draft_depth=2, num_speculative_tokens=4),
                              SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8,
                                             top_p=0.9, seed=7, num_speculative_tokens=2)])
    engine.generate(prompts[1:2], SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0,
                                                 seed=3))
    # seeded sampled requests are coupled (sampled_verify "auto"), unseeded ones rejection-sampled
    engine.generate(prompts[:2], [SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8,
                                                 top_p=0.9, num_speculative_tokens=2),
                                  SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0)])
    served = set(recorder)
    launched = {name for name, _ in served}
    assert launched == {k.__name__ for k in KERNELS}, "the engine did not reach every kernel"
    missed = served - warmed
    assert not missed, f"{len(missed)} variants compile at a request, e.g. {sorted(missed)[:2]}"
    print(f"{len(warmed)} variants warmed, {len(served)} launched by the engine")


def test_the_warmup_does_nothing_on_cpu(small_models):
    target, head = small_models
    engine = build_local_engine(target, head, dtype=torch.float32, num_target_pages=8,
                                num_drafter_pages=8, num_draft_slots=8)
    assert warmup.warm_target(engine.target) is None
    assert warmup.warm_drafter(engine.drafter) is None
    assert warmup.warm_engine(engine) is None
    assert kernels.use_kernel(None, torch.zeros(1)) is False

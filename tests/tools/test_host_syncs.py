"""An engine round waits for the device a fixed, small number of times.

On a GPU every device-to-host read, every copy of host data to the device and every output
whose size depends on device data stalls the host (eagle_serve.tools.host_syncs). Counted here on
CPU with every kernel dispatcher on its GPU path (the Triton kernels, through the
interpreter): the number per `Engine.step()` (a verify pass, acceptance and the next drafts)
must be the same for 1 request on a 3-layer target as for 2 on a 4-layer one (a sync per
request or per layer adds to the second; nothing takes one away), and stay within a budget.
Confidence limits are off so that every round drafts the same shape.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_serve.core import staging
from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.engine import SamplingParams
from eagle_serve.local import build_local_engine
from eagle_serve.testing import make_random_head, make_tiny_llama, reference_ops
from eagle_serve.tools.host_syncs import count_host_syncs

ROUNDS = {  # per-request parameters -> the most host syncs a round may make
    "greedy chains of 3": (dict(num_speculative_tokens=3, draft_topk=1), 16),
    "greedy trees (top-2, depth 2)": (dict(num_speculative_tokens=4, draft_topk=2, draft_depth=2), 16),
    "sampled chains of 2": (dict(num_speculative_tokens=2, temperature=0.8, seed=1), 21),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny Llamas of 3 and 4 layers, each with an EAGLE-3 head (small vocabularies: the
    kernels run through the interpreter)."""
    root = tmp_path_factory.mktemp("sync-models")
    out = {}
    for layers in (3, 4):
        target = make_tiny_llama(root / f"target-{layers}", vocab_size=4096, num_layers=layers)
        out[layers] = target, make_random_head(root / f"head-{layers}", target, 3, draft_vocab_size=1024)
    return out


def syncs_per_round(models, layers: int, num_requests: int, params: dict, monkeypatch) -> list[int]:
    target, head = models[layers]
    engine = build_local_engine(
        target, head, dtype=torch.float32, corpus=None, num_target_pages=64,
        num_drafter_pages=64, num_draft_slots=128, max_draft_batch=8, max_sampled_draft_batch=8,
        max_tree_batch=8, draft_call_cost=0.0, draft_step_cost=0.0, draft_batch_cost=0.0,
        draft_min_prob=0.0, draft_expand_prob=0.0, sampled_draft_min_prob=0.0,
        sampled_verify="rejection")  # seeded sampled chains: rejection-sampled, as the case says
    for i in range(num_requests):
        engine.add_request(list(range(5 + 10 * i, 10 + 10 * i)),  # short: the prefill is not counted
                           SamplingParams(max_tokens=24, ignore_eos=True, context_lookup=False, **params))
    with reference_ops(monkeypatch):  # prefill: the first round is not a steady one
        engine.step()
    counts = []
    for _ in range(2):
        with count_host_syncs() as counter:
            engine.step()
        counts.append(counter.total)
        last = counter
    print(f"{layers} layers, {num_requests} requests: {counts}\n{last.report()}")
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("case", ROUNDS)
def test_a_round_syncs_as_often_whatever_the_batch_size_and_layer_count(case, models, kernels_on_cpu,
                                                                        monkeypatch):
    params, budget = ROUNDS[case]
    counts = {(layers, n): syncs_per_round(models, layers, n, params, monkeypatch)
              for layers, n in ((3, 1), (4, 2))}
    assert len({c for per_round in counts.values() for c in per_round}) == 1, counts
    assert counts[(3, 1)][0] <= budget, counts


def test_the_counter_sees_reads_copies_and_data_dependent_shapes():
    x = torch.arange(6)
    with count_host_syncs() as counter:
        x.sum().item(), x.tolist(), bool(x[0]), int(x[1])  # 4 reads
        torch.tensor([1, 2], device=x.device), x.to(x.device)  # 2 copies
        x.nonzero(), x[x > 2]  # 2 shapes
        torch.tensor([1, 2]), x + 1, x[1:3], x.to(torch.float64)  # host data, device ops: none
    kinds = {kind: 0 for kind in ("read", "copy", "shape")}
    for (kind, _, _), n in counter.calls.items():
        kinds[kind] += n
    assert kinds == {"read": 4, "copy": 2, "shape": 2}, counter.report()


def test_attention_without_the_hosts_query_length_would_sync_once_per_layer(models, kernels_on_cpu):
    """The launcher's own fallback (no max_query_len in the batch) reads it from the device:
    the per-layer sync the round budget above rules out."""
    target, head = models[4]
    engine = build_local_engine(target, head, dtype=torch.float32, corpus=None,
                                num_target_pages=16, num_drafter_pages=16, num_draft_slots=16)
    model = engine.target
    staged = staging.to_device({"input_ids": staging.int64([5, 6, 7]), "positions": staging.int64([0, 1, 2]),
                                "cu_seqlens": staging.int64([0, 3]), "seq_lens": staging.int64([3]),
                                "block_tables": staging.padded([[0]]), "slot_mapping": staging.int64([0, 1, 2])},
                               "cpu")
    counts = {}
    for known in (3, None):
        batch = RaggedBatch.staged(staged, known)
        with count_host_syncs() as counter:
            model.hidden_states(batch)
        counts[known] = sum(n for (kind, name, site), n in counter.calls.items()
                            if "paged_attention" in site)
    assert counts == {3: 0, None: model.num_layers}


def test_staged_fields_arrive_with_their_shapes_dtypes_and_values():
    fields = {"ids": staging.int64([3, -1, 7]), "temp": staging.float32([0.5, 0.0]),
              "mask": np.array([[True, False], [False, True]]), "empty": staging.int64([]),
              "table": staging.padded([[1, 2, 3], [4]])}
    with count_host_syncs() as counter:
        staged = staging.to_device(fields, "cpu")
    assert counter.total == 1  # the one copy
    for name, array in fields.items():
        assert staged[name].shape == array.shape and staged[name].numpy().dtype == array.dtype
        assert np.array_equal(staged[name].numpy(), array)
    assert staged["table"].tolist() == [[1, 2, 3], [4, -1, -1]]
    with pytest.raises(TypeError, match="int32"):
        staging.to_device({"x": np.zeros(2, dtype=np.int32)}, "cpu")


def test_every_staged_field_starts_16_byte_aligned():
    """Triton specialises a kernel for pointers divisible by 16; the warm-up compiles those."""
    fields = {"a": staging.int64([1]), "b": staging.float32([1.0, 2.0, 3.0]),
              "c": np.ones((3, 5), dtype=np.bool_), "d": staging.int64([4, 5])}
    staged = staging.to_device(fields, "cpu")
    assert all(t.data_ptr() % 16 == 0 for t in staged.values())

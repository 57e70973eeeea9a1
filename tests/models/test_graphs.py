"""The padded buckets CUDA graphs replay (eagle_serve.models.graphs), run eagerly on CPU: a
batch padded into its bucket gives its real rows what the unpadded forward gives them, for
decode, verify and draft-tree batches, on the GPU path's kernels (through the interpreter);
and filling the buffers plus the forward wait for the device nowhere (a graph cannot)."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.models.graphs import Bucket, TargetGraphs, bucket_of
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import force_gpu_kernels, greedy_rows, make_tiny_target, ragged_prefill, reference_ops
from eagle_serve.tools.host_syncs import count_host_syncs

PROMPTS = [list(range(5, 26)), [7, 8, 9], list(range(30, 41))]


def step_batch(prompts, pool: PagePool, tables: list[list[int]], new: list[list[int]], tree=None) -> RaggedBatch:
    """Each prompt's next `new` tokens after its cached prompt (verify- or decode-shaped)."""
    ids, pos, slots, cu = [], [], [], [0]
    for p, table, toks in zip(prompts, tables, new):
        pool.grow(table, len(p) + len(toks))
        ids += toks
        pos += range(len(p), len(p) + len(toks))
        slots += [pool.slot(table, i) for i in range(len(p), len(p) + len(toks))]
        cu.append(cu[-1] + len(toks))
    width = max(len(t) for t in tables)
    return RaggedBatch(torch.tensor(ids), torch.tensor(pos), torch.tensor(cu),
                       torch.tensor([len(p) + len(t) for p, t in zip(prompts, new)]),
                       torch.tensor([t + [-1] * (width - len(t)) for t in tables]), torch.tensor(slots),
                       tree_mask=tree, max_query_len=max(len(t) for t in new))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_target(tmp_path_factory.mktemp("graphs") / "llama", vocab_size=512)


CASES = {"decode": [[40], [41], [42]], "verify": [[40, 50, 60, 70], [41, 51], [42, 52, 62]]}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["decode", "verify", "tree"])
def test_a_padded_batch_gives_its_rows_what_the_unpadded_forward_gives(folder, monkeypatch, case):
    force_gpu_kernels(monkeypatch)
    target = TargetModel(folder, dtype=torch.float32, num_pages=64, page_size=4)  # its layers fused
    pool = PagePool(64, 4)
    prefill = ragged_prefill(PROMPTS, pool)
    with reference_ops(monkeypatch):  # the prompts' KV: what is checked is the step below
        target.forward(prefill, torch.zeros(0, dtype=torch.int64), greedy_rows(0))
    tables = [[int(p) for p in row if p >= 0] for row in prefill.block_tables]
    new = CASES["verify" if case == "tree" else case]
    tree = None
    if case == "tree":  # node 2 is a sibling of node 1 in every request
        tree = torch.ones(3, 5, 5, dtype=torch.bool).tril()
        tree[:, 2, 1] = False
    batch = step_batch(PROMPTS, pool, tables, new, tree)
    assert bucket_of(batch) == Bucket(4, max(len(t) for t in new), tree is not None)
    expected = target._hidden_states(batch)
    graphs = TargetGraphs(target._hidden_states, 64, torch.device("cpu"), capture=False)
    with count_host_syncs() as syncs:
        padded = graphs(batch)
    # HF's RoPE moves its frequencies to the input's device each call: there already on a GPU
    waits = [call for call in syncs.calls if not (call[1] == "to" and "modeling_llama" in call[2])]
    assert not waits, syncs.report()
    for got, want in zip(padded, expected):
        assert got.shape == want.shape
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_prefills_and_oversized_batches_have_no_bucket():
    one = torch.tensor([0])
    batch = RaggedBatch(one, one, torch.tensor([0, 1]), torch.tensor([5]), torch.tensor([[0]]), one,
                        max_query_len=17)
    assert bucket_of(batch) is None
    big = RaggedBatch(torch.zeros(33, dtype=torch.int64), one, torch.arange(34), torch.ones(33),
                      torch.zeros(33, 1), one, max_query_len=1)
    assert bucket_of(big) is None


def test_graphs_whose_replay_differs_from_the_eager_forward_are_refused():
    calls = []

    def drifting(batch):  # another result each call, as a replay that differs would give
        calls.append(1)
        h = torch.full((batch.input_ids.shape[0], 4), float(len(calls)))
        return h, h

    def steady(batch):
        h = torch.ones(batch.input_ids.shape[0], 4)
        return h, h
    assert not TargetGraphs(drifting, 4, torch.device("cpu"), capture=False).verified()
    assert TargetGraphs(steady, 4, torch.device("cpu"), capture=False).verified()

"""Drafter training: the unrolled objective sees what drafting sees; a few steps learn."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.models.checkpoints import load_drafter
from eagle_serve.models.heads import random_head
from eagle_serve.models.target import TargetModel
from eagle_serve.testing import local_engine
from eagle_serve.train.trainer import (
    TrainConfig,
    Trainer,
    _prefill_batch,
    compute_features,
    soft_cross_entropy,
    target_to_draft,
    unrolled_hidden,
    unrolled_loss,
)


@torch.inference_mode()
def test_unrolled_training_steps_equal_drafting_steps_at_inference(tiny_target, prompts):
    torch.manual_seed(0)
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=32, page_size=4,
                         feature_layers=(2, 2, 1))
    head = random_head(target.config, 3, 4096, seed=3).double()
    head.spec.__dict__["feature_layers"] = (2, 2, 1)
    seq = prompts[1][:20]
    _, feats = target.hidden_states(_prefill_batch([seq], PagePool(32, 4)))
    embed = target.embed_tokens.weight.detach()
    ids = torch.tensor([seq + [-1] * 4])
    with torch.inference_mode():
        train_steps = unrolled_hidden(head, embed, feats.unsqueeze(0), ids, steps=3)

    from eagle_serve.models.drafter import Drafter
    drafter = Drafter(head, embed, None, num_pages=32, page_size=4)
    m = 12  # chain started at position m: catch up on (f_p, x_{p+1}) for p <= m
    pool = PagePool(32, 4)
    catch_up = _prefill_batch([seq[1:m + 2]], pool)
    out = head.step(torch.nn.functional.embedding(catch_up.input_ids, embed), feats[:m + 1], True,
                    catch_up, drafter.cache)
    assert torch.allclose(out, train_steps[0][0, :m + 1], atol=1e-10)
    hidden = out[-1:]
    for j in (1, 2):  # feed back the true token x_{m+j+1} at position m+j, as drafting does
        step = drafter._single_token_batch(catch_up, torch.tensor([0]), torch.tensor([seq[m + j + 1]]),
                                           torch.tensor([m + j]))
        hidden = head.step(torch.nn.functional.embedding(step.input_ids, embed), hidden, False, step,
                           drafter.cache)
        assert torch.allclose(hidden[0], train_steps[j][0, m], atol=1e-10)


def test_a_few_training_steps_lower_the_loss_and_the_head_serves(tmp_path, tiny_target, prompts, hf_greedy):
    """Also with feature layers other than EAGLE-3's default (2, L//2, L-3) = (2, 2, 1) here:
    the checkpoint records them and the engine's target captures those layers."""
    rows = [{"prompt": str(i), "prompt_ids": p, "output_ids": hf_greedy(p, 24)} for i, p in enumerate(prompts)]
    cfg = TrainConfig(draft_vocab_size=256, steps=40, tokens_per_batch=96, lr=3e-3, warmup=5, save_every=20,
                      feature_layers=(1, 2, 3))
    trainer = Trainer(rows, tiny_target, tmp_path / "work", cfg)
    assert trainer.coverage == 1.0  # 8 x 24 answer tokens fit in 256 draft ids
    trainer.train()
    first, last = sum(trainer.history[:5]) / 5, sum(trainer.history[-5:]) / 5
    assert last < 0.8 * first
    out = trainer.export(tmp_path / "head", {"smoke": True})
    drafter = load_drafter(out, tiny_target)
    assert drafter.head.version == 3 and drafter.head.spec.draft_vocab_size == 256
    assert drafter.feature_layers == (1, 2, 3)
    resumed = Trainer(rows, tiny_target, tmp_path / "work", cfg)  # checkpoint picked up
    assert resumed.step == 40
    extra = [{"prompt": "x", "prompt_ids": prompts[0], "output_ids": list(range(300, 560))}]
    grown = Trainer(rows + extra, tiny_target, tmp_path / "work", cfg)  # corpus grew: new token counts
    assert grown.step == 40 and torch.equal(grown.head.d2t, trainer.head.d2t)
    assert torch.equal(grown.t2d, trainer.t2d)  # labels still map into the checkpoint's vocabulary
    engine = local_engine(tiny_target, out)
    results = engine.generate(prompts[:2], SamplingParams(max_tokens=24, num_speculative_tokens=3))
    assert [r.token_ids for r in results] == [hf_greedy(p, 24) for p in prompts[:2]]
    assert engine.stats.accepted_tokens > 0  # it learned something its target says


def test_features_of_a_grown_corpus_extend_the_cache_and_equal_a_fresh_pass(tmp_path, tiny_target, prompts):
    seqs = [(p + p[:5], len(p)) for p in prompts]
    grown = compute_features(seqs[:3], tiny_target, tmp_path / "cache", soft_topk=4)
    assert grown.features.shape[0] == grown.labels.shape[0] == grown.soft_ids.shape[0] == sum(len(s) for s, _ in seqs[:3])
    before = (tmp_path / "cache" / "features.f16").stat().st_mtime_ns
    extended = compute_features(seqs, tiny_target, tmp_path / "cache", soft_topk=4)
    fresh = compute_features(seqs, tiny_target, tmp_path / "fresh", soft_topk=4)
    fresh_features = np.asarray(fresh.features, dtype=np.float32)
    np.testing.assert_allclose(np.asarray(extended.features, dtype=np.float32), fresh_features, rtol=1e-2, atol=1e-2)
    np.testing.assert_array_equal(np.asarray(extended.labels), np.asarray(fresh.labels))
    np.testing.assert_array_equal(np.asarray(extended.soft_ids[:, 0]), np.asarray(fresh.soft_ids[:, 0]))
    np.testing.assert_allclose(np.asarray(extended.soft_probs, dtype=np.float32),
                               np.asarray(fresh.soft_probs, dtype=np.float32), atol=1e-2)
    written = (tmp_path / "cache" / "features.f16").stat().st_mtime_ns
    assert written != before
    again = compute_features(seqs, tiny_target, tmp_path / "cache", soft_topk=4)  # cached: read, not redone
    assert (tmp_path / "cache" / "features.f16").stat().st_mtime_ns == written
    np.testing.assert_array_equal(np.asarray(again.features), np.asarray(extended.features))
    hard = compute_features(seqs, tiny_target, tmp_path / "cache")  # no soft labels asked: redone without
    assert hard.soft_ids is None and hard.soft_probs is None
    other = compute_features(seqs[1:], tiny_target, tmp_path / "cache")  # not a prefix: redone
    np.testing.assert_allclose(np.asarray(other.features, dtype=np.float32), fresh_features[len(seqs[0][0]):],
                               rtol=1e-2, atol=1e-2)


def test_an_interrupted_feature_pass_goes_on_where_it_stopped(tmp_path, tiny_target, prompts, monkeypatch):
    seqs = [(p + p[:5], len(p)) for p in prompts]
    real, groups = TargetModel.hidden_states, []

    def counted(self, batch):
        if len(groups) == 3:
            raise KeyboardInterrupt  # stopped during its fourth group
        groups.append(batch.cu_seqlens.numel() - 1)
        return real(self, batch)

    monkeypatch.setattr(TargetModel, "hidden_states", counted)
    with pytest.raises(KeyboardInterrupt):
        compute_features(seqs, tiny_target, tmp_path / "cache", batch_tokens=1, soft_topk=4)  # a group per sequence
    assert groups == [1, 1, 1]
    groups.clear()
    monkeypatch.setattr(TargetModel, "hidden_states", lambda self, batch: groups.append(1) or real(self, batch))
    resumed = compute_features(seqs, tiny_target, tmp_path / "cache", batch_tokens=1, soft_topk=4)
    assert len(groups) == len(seqs) - 3  # only the sequences it had not done
    fresh = compute_features(seqs, tiny_target, tmp_path / "fresh", batch_tokens=1, soft_topk=4)
    for name in ("features", "labels", "soft_ids", "soft_probs"):
        np.testing.assert_array_equal(np.asarray(getattr(resumed, name)), np.asarray(getattr(fresh, name)))


def test_soft_labels_are_the_targets_most_likely_tokens_and_their_probabilities(tmp_path, tiny_target, prompts):
    from transformers import AutoModelForCausalLM

    seqs = [(p + p[:4], len(p)) for p in prompts[:2]]
    data = compute_features(seqs, tiny_target, tmp_path / "cache", dtype="float64", soft_topk=5)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    offset = 0
    for seq, _ in seqs:
        with torch.no_grad():
            probs = torch.softmax(model(torch.tensor([seq])).logits[0], dim=-1)  # [L, V]
        top = probs.topk(5, dim=-1)
        rows = slice(offset, offset + len(seq))
        np.testing.assert_array_equal(np.asarray(data.soft_ids[rows]), top.indices.numpy())
        np.testing.assert_allclose(np.asarray(data.soft_probs[rows], dtype=np.float64), top.values.numpy(),
                                   rtol=1e-3, atol=1e-4)  # stored in fp16
        np.testing.assert_array_equal(np.asarray(data.labels[rows]), np.asarray(data.soft_ids[rows][:, 0]))
        offset += len(seq)


def test_the_soft_loss_of_a_one_hot_target_is_the_hard_loss_and_ignores_tokens_outside_the_draft_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64)
    t2d = torch.full((20,), -1, dtype=torch.int64)
    t2d[torch.arange(0, 20, 2)] = torch.arange(10)  # even target ids are in the draft vocabulary
    labels = torch.tensor([0, 2, 4, 6, 8, 10])
    ids = torch.stack([labels, labels + 1, labels + 2], dim=1)  # [6, 3]: one odd id per row
    one_hot = torch.tensor([[1.0, 0.0, 0.0]]).expand(6, 3)
    hard = torch.nn.functional.cross_entropy(logits, t2d[labels])
    assert torch.allclose(soft_cross_entropy(logits, ids, one_hot, t2d), hard, atol=1e-12)
    # mass on a token outside the draft vocabulary (the odd id) is dropped and the rest renormalized
    spread = torch.tensor([[0.3, 0.5, 0.2]]).expand(6, 3)
    logp = torch.log_softmax(logits, dim=-1)
    expected = -(0.6 * logp[torch.arange(6), t2d[labels]] + 0.4 * logp[torch.arange(6), t2d[labels + 2]])
    assert torch.allclose(soft_cross_entropy(logits, ids, spread, t2d), expected.mean(), atol=1e-12)


def test_labels_are_the_targets_argmax_so_sampled_answers_teach_what_the_target_would_say(
        tmp_path, tiny_target, prompts, hf_greedy):
    greedy = [(p + hf_greedy(p, 12), len(p)) for p in prompts[:3]]
    labels = compute_features(greedy, tiny_target, tmp_path / "greedy", dtype="float64").labels
    offset = 0
    for seq, plen in greedy:  # greedy answer: the label at p is the answer token at p + 1
        assert list(labels[offset + plen - 1:offset + len(seq) - 1]) == seq[plen:]
        offset += len(seq)
    rng = np.random.default_rng(0)  # a "sampled" answer: random tokens, labels still the argmax
    sampled = [(p + rng.integers(0, 200, 12).tolist(), len(p)) for p in prompts[:3]]
    labels = compute_features(sampled, tiny_target, tmp_path / "sampled", dtype="float64").labels
    offset, differ = 0, 0
    for seq, plen in sampled:
        for pos in (3, len(seq) - 1):
            assert labels[offset + pos] == hf_greedy(seq[:pos + 1], 1)[0]
        differ += sum(labels[offset + p] != seq[p + 1] for p in range(plen, len(seq) - 1))
        offset += len(seq)
    assert differ > 0  # the labels are not the sampled text


def test_teacher_forced_accuracy_scores_every_answer_position_and_reuses_its_cache(tmp_path, tiny_target, eagle3_head):
    from eagle_serve.train.corpus import read_corpus
    from eagle_serve.train.evaluate import teacher_forced_accuracy

    prompts = ["Why is the sky blue?", "Name three fruits."]
    report = teacher_forced_accuracy(eagle3_head, tiny_target, prompts, tmp_path, max_tokens=10, dtype="float64")
    rows = read_corpus(tmp_path / "answers")
    assert report["rows"] == 2 and len(report["step_accuracy"]) == 3
    assert report["positions"] == sum(len(r["output_ids"]) for r in rows)  # labels x_{p+2} in the answer
    assert all(0.0 <= a <= 1.0 for a in report["step_accuracy"])
    assert teacher_forced_accuracy(eagle3_head, tiny_target, prompts, tmp_path, max_tokens=10,
                                   dtype="float64") == report


@torch.inference_mode()
def test_accuracy_counts_target_tokens_outside_the_draft_vocabulary_as_misses(tiny_target, prompts):
    conf = TargetModel(tiny_target, num_pages=1, page_size=4).config
    full = random_head(conf, 3, conf.vocab_size, seed=1).double()
    target = TargetModel(tiny_target, dtype=torch.float64, num_pages=32, page_size=4,
                         feature_layers=full.spec.feature_layers)
    seq = prompts[0][:16]
    _, feats = target.hidden_states(_prefill_batch([seq], PagePool(32, 4)))
    ids = torch.tensor([seq + [-1] * 4])
    argmax = ids.clone()  # labels: the text itself
    mask = torch.zeros(1, len(seq), dtype=torch.bool)
    mask[0, 3:len(seq) - 2] = True
    vocab = target.vocab_size
    cfg = TrainConfig(unroll=2, noise=0.0)
    embed = target.embed_tokens.weight.detach()
    _, accs = unrolled_loss(full, embed, feats.unsqueeze(0), ids, argmax, mask,
                            target_to_draft(full.d2t.to(torch.int64), vocab), cfg)
    scored = [n for _, n in accs]
    assert scored[0] == int(mask.sum())
    # a draft vocabulary without the labels: nothing can hit, every position still counts
    outside = sorted(set(range(vocab)) - set(seq))[:8]
    d2t = torch.tensor(outside) - torch.arange(8)
    small = random_head(target.config, 3, 8, seed=1, d2t=d2t, feature_layers=full.spec.feature_layers).double()
    _, accs = unrolled_loss(small, embed, feats.unsqueeze(0), ids, argmax, mask,
                            target_to_draft(d2t, vocab), cfg)
    assert [h for h, _ in accs] == [0, 0] and [n for _, n in accs] == scored


def test_in_process_eval_reports_acceptance_per_position_in_the_dtype_asked_for(tiny_target, eagle3_head):
    from eagle_serve.train.evaluate import evaluate

    report = evaluate(eagle3_head, tiny_target, ["Why is the sky blue?", "Name three fruits."], k=2,
                      max_tokens=24, dtype="float64")  # long enough for the served policy to look up
    assert report["dtype"] == "float64" and report["prompts"] == 2
    first, second = report["acceptance_per_position"]
    assert 0.0 <= second <= first <= 1.0  # a chain's second draft counts only behind an accepted first
    assert 1.0 <= report["tau"] <= 3.0 and report["tokens_per_s"] > 0 and report["tokens_per_s_k0"] > 0
    assert {s for s, n in report["drafts_by_source"].items() if n} == {"eagle"}  # the head alone
    report = evaluate(eagle3_head, tiny_target, ["Why is the sky blue?"], k=5, max_tokens=24, dtype="float64")
    assert len(report["acceptance_per_position"]) == 5 and None not in report["acceptance_per_position"]

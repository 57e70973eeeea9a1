"""Train an EAGLE-3 head on a self-distillation corpus.

- Features: one teacher-forced pass of the target over prompt + answer gives, per position p,
  the inputs of layers (2, L//2, L-3) (the EAGLE-3 fusion input) and the target's own argmax
  (the label: for a greedy answer it is the next answer token, for a sampled one it is what the
  target would have said there); cached on disk (features fp16, labels int32).
- Draft vocabulary: the most frequent answer tokens (d2t: target_id = draft_id + d2t[draft_id]);
  the head's LM head rows start from the target's embedding rows of those tokens.
- Objective: token cross-entropy against the target's argmax with training-time unrolling
  (EAGLE-3's "training-time test"): step 1 reads the target's features, step j > 1 reads the
  head's own output of step j-1 and the true token, attending to the step-1 keys of earlier
  positions and to its own chain, i.e. exactly what drafting at inference sees. Only positions
  whose label is an answer token count.
- Resumable: a checkpoint (head, optimizer, step, RNG) every `save_every` steps.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from eagle_serve.checkpoints import save_head
from eagle_serve.heads import EagleHead, eagle3_feature_layers, random_head
from eagle_serve.interfaces import RaggedBatch
from eagle_serve.kv_pages import PagePool
from eagle_serve.target import TargetModel, load_target_config


@dataclass(frozen=True)
class TrainConfig:
    draft_vocab_size: int = 4096      # most frequent answer tokens
    unroll: int = 3                   # training-time test depth
    step_decay: float = 0.8           # loss weight of step j is decay**(j-1)
    tokens_per_batch: int = 2048      # answer tokens per optimizer step (approx.)
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: int = 50
    steps: int = 1500
    grad_clip: float = 0.5
    noise: float = 0.05               # uniform feature noise, relative to feature std
    save_every: int = 100
    seed: int = 0
    feature_layers: tuple[int, ...] | None = None  # inputs of these target layers; None = 2, L//2, L-3


# ---- data ----

def sequences(rows: list[dict]) -> list[tuple[list[int], int]]:
    """-> (prompt + answer ids, prompt length) per corpus row"""
    return [(r["prompt_ids"] + r["output_ids"], len(r["prompt_ids"])) for r in rows if r["output_ids"]]


def draft_vocab(rows: list[dict], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """-> d2t [size] (target = draft + d2t[draft]), coverage of answer tokens"""
    counts = Counter(t for r in rows for t in r["output_ids"])
    top = sorted(t for t, _ in counts.most_common(size))
    top += sorted(set(range(vocab_size)) - set(top))[:size - len(top)]  # pad with unused ids
    top = sorted(top)
    covered = sum(counts[t] for t in top) / max(1, sum(counts.values()))
    ids = torch.tensor(top, dtype=torch.int64)
    return ids - torch.arange(size), covered


def target_to_draft(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """d2t [D] -> t2d [V]: the draft id of each target id, -1 outside the draft vocabulary"""
    t2d = torch.full((vocab_size,), -1, dtype=torch.int64)
    t2d[torch.arange(d2t.shape[0]) + d2t] = torch.arange(d2t.shape[0])
    return t2d


def _digest(seqs) -> str:
    h = hashlib.sha1()
    for s, plen in seqs:
        h.update(np.asarray(s + [plen, -1], dtype=np.int64).tobytes())
    return h.hexdigest()


def compute_features(seqs, target_dir: Path, cache: Path, layers: tuple[int, ...] | None = None,
                     batch_tokens: int = 4096, dtype: str = "float32") -> tuple[np.memmap, np.memmap]:
    """Teacher-forced target pass in `dtype`; -> features memmap [total_tokens, 3H] fp16 and
    labels memmap [total_tokens] int32 (the target's argmax at each position; rows in sequence
    order). A cache made for a prefix of `seqs` (the corpus before it grew) is extended, not redone."""
    cache.mkdir(parents=True, exist_ok=True)
    total = sum(len(s) for s, _ in seqs)
    meta = cache / "features.json"
    tconf = load_target_config(target_dir)
    layers = tuple(layers or eagle3_feature_layers(tconf.num_hidden_layers))
    width = 3 * tconf.hidden_size
    path, lpath = cache / "features.f16", cache / "labels.i32"
    fixed = {"width": width, "layers": list(layers), "dtype": dtype, "labels": True}
    key = {"tokens": total, "rows": len(seqs), "digest": _digest(seqs)} | fixed
    old = json.loads(meta.read_text()) if meta.exists() else {}
    if old == key:
        return (np.memmap(path, dtype=np.float16, mode="r", shape=(total, width)),
                np.memmap(lpath, dtype=np.int32, mode="r", shape=(total,)))
    done = old.get("rows", 0) if (
        {k: old.get(k) for k in fixed} == fixed
        and 0 < old.get("rows", 0) <= len(seqs) and old.get("digest") == _digest(seqs[:old["rows"]])) else 0
    store = np.memmap(path.with_suffix(".tmp"), dtype=np.float16, mode="w+", shape=(total, width))
    labels = np.memmap(lpath.with_suffix(".tmp"), dtype=np.int32, mode="w+", shape=(total,))
    offset = sum(len(s) for s, _ in seqs[:done])
    if done:
        store[:offset] = np.memmap(path, dtype=np.float16, mode="r", shape=(offset, width))
        labels[:offset] = np.memmap(lpath, dtype=np.int32, mode="r", shape=(offset,))
    target = TargetModel(target_dir, num_pages=batch_tokens // 16 + 64, page_size=16,
                         feature_layers=layers, dtype=getattr(torch, dtype))
    i = done
    bar = tqdm(total=total, initial=offset, desc="target features", unit="tok")
    while i < len(seqs):
        group = []
        while i < len(seqs) and (not group or sum(len(s) for s, _ in group) + len(seqs[i][0]) <= batch_tokens):
            group.append(seqs[i])
            i += 1
        batch = _prefill_batch([s for s, _ in group], PagePool(target.cache.num_pages, 16))
        with torch.inference_mode():
            final, feats = target.hidden_states(batch)
            argmax = target.lm_head(final).float().argmax(-1)  # [n]
        n = feats.shape[0]
        store[offset:offset + n] = feats.to(torch.float16).numpy()
        labels[offset:offset + n] = argmax.numpy()
        offset += n
        bar.update(n)
    bar.close()
    for m, f in ((store, path), (labels, lpath)):
        m.flush()
        f.with_suffix(".tmp").rename(f)
    del store, labels
    meta.write_text(json.dumps(key))
    return (np.memmap(path, dtype=np.float16, mode="r", shape=(total, width)),
            np.memmap(lpath, dtype=np.int32, mode="r", shape=(total,)))


def _prefill_batch(seqs: list[list[int]], pool: PagePool) -> RaggedBatch:
    tables, cu, slots = [], [0], []
    for s in seqs:
        t: list[int] = []
        assert pool.grow(t, len(s))
        tables.append(t)
        cu.append(cu[-1] + len(s))
        slots += [pool.slot(t, p) for p in range(len(s))]
    width = max(len(t) for t in tables)
    return RaggedBatch(torch.tensor([x for s in seqs for x in s]),
                       torch.tensor([p for s in seqs for p in range(len(s))]),
                       torch.tensor(cu), torch.tensor([len(s) for s in seqs]),
                       torch.tensor([t + [-1] * (width - len(t)) for t in tables]), torch.tensor(slots))


# ---- the unrolled training forward ----

def _attention(layer, x, positions, rotary, head_dim, prev_keys, prev_values, first_keys):
    """Attention of step j: causal over step-1 keys, plus the same chain's earlier steps.

    x: [B, L, 2H]; positions: [B, L]; prev_*: lists of [B, Hkv, L, D] (steps 2..j-1);
    first_keys: (k1, v1) [B, Hkv, L, D] or None (this is step 1) -> out [B, L, H], (k, v)
    """
    attn = layer.self_attn
    b, n, _ = x.shape
    q = attn.q_proj(x).view(b, n, -1, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(b, n, -1, head_dim).transpose(1, 2)
    v = attn.v_proj(x).view(b, n, -1, head_dim).transpose(1, 2)
    cos, sin = rotary(x, positions)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k1, v1 = (k, v) if first_keys is None else first_keys
    groups = q.shape[1] // k1.shape[1]
    rep = lambda t: t.repeat_interleave(groups, dim=1)  # noqa: E731
    scale = head_dim ** -0.5
    causal = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
    scores = [(q @ rep(k1).transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))]
    values = [rep(v1)]
    diag = list(zip(prev_keys, prev_values)) + ([(k, v)] if first_keys is not None else [])
    for dk, dv in diag:  # the chain's own steps: one key per query (its own position)
        scores.append((q * rep(dk)).sum(-1, keepdim=True) * scale)
        values.append(rep(dv))
    probs = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = probs[..., :n] @ values[0]
    for i, val in enumerate(values[1:]):
        out = out + probs[..., n + i:n + i + 1] * val
    return attn.o_proj(out.transpose(1, 2).reshape(b, n, -1)), (k, v)


def unrolled_hidden(head: EagleHead, embed: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor,
                    steps: int) -> list[torch.Tensor]:
    """The head's output features of each unrolled step.

    feats: [B, L, 3H] target features at positions p; ids: [B, >= L + steps] tokens (-1 = pad)
    -> per step j: [B, L, H], the chain started at p after j+1 drafting steps
    """
    layer, rotary = head.layer, head.rotary
    b, n, _ = feats.shape
    pos = torch.arange(n).expand(b, n)
    hidden, firsts, prev_k, prev_v, outs = None, None, [], [], []
    for j in range(steps):
        emb = F.embedding(ids[:, 1 + j:1 + j + n].clamp(min=0), embed)  # x_{p+j+1}
        residual = head.fc(feats) if j == 0 else hidden
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(residual)], dim=-1)
        out, kv = _attention(layer, x, pos + j, rotary, head.head_dim, prev_k, prev_v, firsts)
        if j == 0:
            firsts = kv
        else:
            prev_k, prev_v = prev_k + [kv[0]], prev_v + [kv[1]]
        h = residual + out
        hidden = h + layer.mlp(layer.post_attention_layernorm(h))
        outs.append(hidden)
    return outs


def unrolled_loss(head: EagleHead, embed: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor,
                  argmax: torch.Tensor, mask: torch.Tensor, t2d: torch.Tensor, cfg: TrainConfig):
    """Cross-entropy of each step j against the target's argmax after x_{p+j+1} (in draft ids),
    weighted decay**j.

    argmax: [B, >= L + steps] the target's argmax at each position (-1 = pad); mask: [B, L]
    positions whose step-1 label is an answer token; t2d: [V] draft id or -1
    -> loss, per step (hits, scored): scored = answer positions with a label, including the
       target tokens outside the draft vocabulary (a draft can never hit those)
    """
    n = feats.shape[1]
    loss, accs = 0.0, []
    for j, hidden in enumerate(unrolled_hidden(head, embed, feats, ids, cfg.unroll)):
        target_ids = argmax[:, 1 + j:1 + j + n]  # the target's token after x_{p+j+1}
        labels = torch.where(target_ids >= 0, t2d[target_ids.clamp(min=0)], -1)  # -1: no label
        valid = mask & (labels >= 0)
        logits = head.lm_head(head.norm(hidden[valid]))
        step_loss = F.cross_entropy(logits, labels[valid]) if valid.any() else logits.sum() * 0
        loss = loss + cfg.step_decay ** j * step_loss
        accs.append((int((logits.argmax(-1) == labels[valid]).sum()), int((mask & (target_ids >= 0)).sum())))
    return loss, accs


# ---- the loop ----

class Trainer:
    def __init__(self, rows: list[dict], target_dir: Path, work: Path, cfg: TrainConfig,
                 feature_dtype: str = "float32"):
        self.cfg, self.work, self.target_dir = cfg, Path(work), Path(target_dir)
        self.seqs = sequences(rows)
        self.offsets = np.cumsum([0] + [len(s) for s, _ in self.seqs])
        tconf = load_target_config(target_dir)
        d2t, self.coverage = draft_vocab(rows, cfg.draft_vocab_size, tconf.vocab_size)
        self.t2d = target_to_draft(d2t, tconf.vocab_size)
        self.features, self.labels = compute_features(self.seqs, target_dir, self.work / "features",
                                                      cfg.feature_layers, dtype=feature_dtype)
        self.feat_std = float(np.asarray(self.features[:20000], dtype=np.float32).std())
        target = TargetModel(target_dir, num_pages=1, page_size=16)
        self.embed = target.embed_tokens.weight.detach()
        self.head = random_head(tconf, 3, cfg.draft_vocab_size, seed=cfg.seed, d2t=d2t,
                                feature_layers=cfg.feature_layers)
        with torch.no_grad():  # start from the target: LM head rows, fc passing the last feature through
            self.head.lm_head.weight.copy_(target.lm_head.weight[torch.arange(cfg.draft_vocab_size) + d2t])
            h = tconf.hidden_size
            self.head.fc.weight.zero_()
            self.head.fc.weight[:, 2 * h:].copy_(torch.eye(h))
            self.head.norm.weight.copy_(target.final_norm_scale())
        del target
        self.opt = torch.optim.AdamW([p for n, p in self.head.named_parameters() if n != "d2t"],
                                     lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.step = 0
        self.history: list[float] = []  # loss per step of this run
        self.rng = np.random.default_rng(cfg.seed)
        self._resume()

    def _lr(self) -> float:
        c = self.cfg
        if self.step < c.warmup:
            return c.lr * (self.step + 1) / c.warmup
        return c.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, (self.step - c.warmup) / max(1, c.steps - c.warmup))))

    def _batch(self):
        """Random sequences up to ~tokens_per_batch answer tokens, padded."""
        picked, tokens = [], 0
        while tokens < self.cfg.tokens_per_batch:
            i = int(self.rng.integers(len(self.seqs)))
            picked.append(i)
            tokens += len(self.seqs[i][0]) - self.seqs[i][1]
        n = max(len(self.seqs[i][0]) for i in picked)
        u = self.cfg.unroll
        feats = torch.zeros(len(picked), n, self.features.shape[1])
        ids = torch.full((len(picked), n + u + 1), -1, dtype=torch.int64)
        argmax = torch.full((len(picked), n + u + 1), -1, dtype=torch.int64)
        mask = torch.zeros(len(picked), n, dtype=torch.bool)
        for row, i in enumerate(picked):
            seq, plen = self.seqs[i]
            feats[row, :len(seq)] = torch.from_numpy(np.asarray(
                self.features[self.offsets[i]:self.offsets[i] + len(seq)], dtype=np.float32))
            ids[row, :len(seq)] = torch.tensor(seq)
            argmax[row, :len(seq)] = torch.from_numpy(np.asarray(
                self.labels[self.offsets[i]:self.offsets[i] + len(seq)], dtype=np.int64))
            mask[row, max(0, plen - 2):len(seq) - 2] = True  # label x_{p+2} is an answer token
        noise = (torch.rand_like(feats) - 0.5) * 2 * self.cfg.noise * self.feat_std
        return feats + noise, ids, argmax, mask

    def train(self) -> None:
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train EAGLE-3 head", unit="step")
        while self.step < self.cfg.steps:
            feats, ids, argmax, mask = self._batch()
            for g in self.opt.param_groups:
                g["lr"] = self._lr()
            loss, accs = unrolled_loss(self.head, self.embed, feats, ids, argmax, mask, self.t2d, self.cfg)
            self.opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
            self.opt.step()
            self.step += 1
            self.history.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", acc="/".join(f"{h / max(1, n):.2f}" for h, n in accs))
            if self.step % self.cfg.save_every == 0 or self.step == self.cfg.steps:
                self._save()
        bar.close()

    def _save(self) -> None:
        ckpt = self.work / "checkpoint.pt"
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "rng": self.rng.bit_generator.state, "cfg": asdict(self.cfg)}, ckpt.with_suffix(".tmp"))
        ckpt.with_suffix(".tmp").rename(ckpt)

    def _resume(self) -> None:
        ckpt = self.work / "checkpoint.pt"
        if ckpt.exists():
            state = torch.load(ckpt, weights_only=False)
            # the first layer may be saved under its published EAGLE-3 name, `midlayer`
            self.head.load_state_dict({k.replace("midlayer.", "layers.0.", 1): v for k, v in state["head"].items()})
            # a resumed run keeps the checkpoint's draft vocabulary, even if the corpus grew since
            self.t2d = target_to_draft(self.head.d2t.to(torch.int64), self.t2d.shape[0])
            self.opt.load_state_dict(state["opt"])
            self.step, self.rng.bit_generator.state = state["step"], state["rng"]

    def export(self, folder: Path, card: dict) -> Path:
        return save_head(self.head, folder, extra_config={"eagle_training": card})

"""Train an EAGLE-3 head on a self-distillation corpus.

- Features: one teacher-forced pass of the target over prompt + answer gives, per position p,
  the inputs of layers (2, L//2, L-3) (the EAGLE-3 fusion input) and the target's own argmax
  (the label: for a greedy answer it is the next answer token, for a sampled one it is what the
  target would have said there), and its top-k tokens with their probabilities (soft labels);
  cached on disk (features fp16, labels int32, soft labels int32 + fp16).
- Draft vocabulary: the most frequent answer tokens (d2t: target_id = draft_id + d2t[draft_id]);
  the head's LM head rows start from the target's embedding rows of those tokens.
- Objective: token cross-entropy against the target's distribution (soft labels: its top-k
  probabilities, stored beside the features, renormalized over the draft vocabulary; or its
  argmax alone, soft_topk = 0) with training-time unrolling
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

from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.models.checkpoints import save_head
from eagle_serve.models.heads import EagleHead, eagle3_feature_layers, random_head
from eagle_serve.models.target import TargetModel, load_target_config


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
    soft_topk: int = 32               # soft labels: the target's top-k probabilities (0 = its argmax)


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


def _hashed(seqs, h=None):
    """sha1 over the sequences, continuing `h` (a hashlib sha1) when given"""
    h = h or hashlib.sha1()
    for s, plen in seqs:
        h.update(np.asarray(s + [plen, -1], dtype=np.int64).tobytes())
    return h


@dataclass(frozen=True)
class TargetPass:
    """What the teacher-forced target pass leaves per position (rows in sequence order)."""
    features: np.ndarray            # [T, 3H] fp16: the inputs of the fused layers
    labels: np.ndarray              # [T] int32: the target's argmax
    soft_ids: np.ndarray | None     # [T, K] int32: its K most likely tokens (None: no soft labels)
    soft_probs: np.ndarray | None   # [T, K] fp16: their probabilities


def _cache_arrays(width: int, soft_topk: int) -> dict[str, tuple[str, type, tuple[int, ...]]]:
    """TargetPass field -> (file, dtype, shape after the token axis)"""
    arrays = {"features": ("features.f16", np.float16, (width,)), "labels": ("labels.i32", np.int32, ())}
    if soft_topk:
        arrays |= {"soft_ids": ("soft_ids.i32", np.int32, (soft_topk,)),
                   "soft_probs": ("soft_probs.f16", np.float16, (soft_topk,))}
    return arrays


def compute_features(seqs, target_dir: Path, cache: Path, layers: tuple[int, ...] | None = None,
                     batch_tokens: int = 4096, dtype: str = "float32", soft_topk: int = 0) -> TargetPass:
    """Teacher-forced target pass in `dtype` -> TargetPass (memmaps): the features and, at each
    position, the target's argmax and (soft_topk > 0) its soft_topk most likely tokens with their
    probabilities. Resumable: the cache records how many sequences it holds after each group of
    ~batch_tokens, so an interrupted pass, or one over a corpus that grew (the cache holds a
    prefix of `seqs`), goes on from there."""
    cache.mkdir(parents=True, exist_ok=True)
    total = sum(len(s) for s, _ in seqs)
    meta = cache / "features.json"
    tconf = load_target_config(target_dir)
    layers = tuple(layers or eagle3_feature_layers(tconf.num_hidden_layers))
    width = 3 * tconf.hidden_size
    arrays = _cache_arrays(width, soft_topk)
    fixed = {"width": width, "layers": list(layers), "dtype": dtype, "labels": True, "soft_topk": soft_topk}
    old = json.loads(meta.read_text()) if meta.exists() else {}
    rows = old.get("rows", 0)
    prefix = _hashed(seqs[:rows]) if 0 < rows <= len(seqs) else None  # continued by _extend
    done = rows if (
        {k: old.get(k) for k in fixed} == fixed
        and prefix is not None and old.get("digest") == prefix.hexdigest()
        and all((cache / f).exists() for f, _, _ in arrays.values())) else 0
    if done < len(seqs):
        _extend(seqs, done, target_dir, cache, arrays, fixed, batch_tokens,
                prefix if done else hashlib.sha1())
    stores = {name: np.memmap(cache / f, dtype=t, mode="r", shape=(total, *shape))
              for name, (f, t, shape) in arrays.items()}
    return TargetPass(**{"soft_ids": None, "soft_probs": None} | stores)


def _extend(seqs, done: int, target_dir: Path, cache: Path, arrays: dict, fixed: dict,
            batch_tokens: int, hasher) -> None:
    """Run the target over seqs[done:] into the cache files (grown to hold every sequence; new
    files when done = 0), recording the sequences held after each group; `hasher` holds the
    digest of seqs[:done] (`_hashed`) and goes on over the rest."""
    total = sum(len(s) for s, _ in seqs)
    stores = {}
    for name, (f, t, shape) in arrays.items():
        path = cache / f
        if done:  # keep what the files hold, make room for the rest
            with open(path, "r+b") as fh:
                fh.truncate(total * int(np.prod(shape, dtype=np.int64)) * np.dtype(t).itemsize)
        stores[name] = np.memmap(path, dtype=t, mode="r+" if done else "w+", shape=(total, *shape))
    target = TargetModel(target_dir, num_pages=batch_tokens // 16 + 64, page_size=16,
                         feature_layers=tuple(fixed["layers"]), dtype=getattr(torch, fixed["dtype"]))
    for m in target.cpu_linears():  # oneDNN's GEMM: training needs no row-invariance, and over
        m.cpu_kernel = False         # thousands of rows it runs ~1.45x the row kernel's speed
    offset, i = sum(len(s) for s, _ in seqs[:done]), done
    bar = tqdm(total=total, initial=offset, desc="target features", unit="tok")
    while i < len(seqs):
        group = []
        while i < len(seqs) and (not group or sum(len(s) for s, _ in group) + len(seqs[i][0]) <= batch_tokens):
            group.append(seqs[i])
            i += 1
        batch = _prefill_batch([s for s, _ in group], PagePool(target.cache.num_pages, 16))
        with torch.inference_mode():
            final, feats = target.hidden_states(batch)
            logits = target.lm_head(final).float()  # [n, V]
            out = {"features": feats.to(torch.float16), "labels": logits.argmax(-1).to(torch.int32)}
            if fixed["soft_topk"]:
                top = logits.topk(fixed["soft_topk"], dim=-1)
                probs = torch.exp(top.values - torch.logsumexp(logits, -1, keepdim=True))
                out |= {"soft_ids": top.indices.to(torch.int32), "soft_probs": probs.to(torch.float16)}
        n = feats.shape[0]
        for name, store in stores.items():
            store[offset:offset + n] = out[name].numpy()
            store.flush()
        _hashed(group, hasher)
        offset += n
        record = {"tokens": offset, "rows": i, "digest": hasher.hexdigest()} | fixed
        (cache / "features.tmp.json").write_text(json.dumps(record))
        (cache / "features.tmp.json").rename(cache / "features.json")
        bar.update(n)
    bar.close()


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


@dataclass(frozen=True)
class SoftLabels:
    """The target's distribution at each position, as its K most likely tokens."""
    ids: torch.Tensor     # [B, >= L + steps, K] target token ids (-1 = pad)
    probs: torch.Tensor   # [B, >= L + steps, K] their probabilities


def soft_cross_entropy(logits: torch.Tensor, ids: torch.Tensor, probs: torch.Tensor,
                       t2d: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the draft logits [N, D] against the target's distribution restricted to
    the draft vocabulary: its top K (ids, probs [N, K]) renormalized over the tokens the draft
    vocabulary holds (as EAGLE-3's trainers restrict the target's softmax to it)."""
    draft = torch.where(ids >= 0, t2d[ids.clamp(min=0)], -1)  # [N, K]
    weights = torch.where(draft >= 0, probs.to(logits.dtype), 0.0)
    weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-12)
    logp = torch.log_softmax(logits, dim=-1).gather(1, draft.clamp(min=0))  # [N, K]
    return -(weights * logp).sum(-1).mean()


def unrolled_loss(head: EagleHead, embed: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor,
                  argmax: torch.Tensor, mask: torch.Tensor, t2d: torch.Tensor, cfg: TrainConfig,
                  soft: SoftLabels | None = None):
    """Cross-entropy of each step j against the target after x_{p+j+1}, weighted decay**j: its
    argmax (in draft ids), or with `soft` its distribution (soft_cross_entropy).

    argmax: [B, >= L + steps] the target's argmax at each position (-1 = pad); mask: [B, L]
    positions whose step-1 label is an answer token; t2d: [V] draft id or -1
    -> loss, per step (hits, scored): scored = answer positions with a label, including the
       target tokens outside the draft vocabulary (a draft can never hit those); a position
       whose argmax is outside the draft vocabulary is not trained on
    """
    n = feats.shape[1]
    loss, accs = 0.0, []
    for j, hidden in enumerate(unrolled_hidden(head, embed, feats, ids, cfg.unroll)):
        after = slice(1 + j, 1 + j + n)  # the target's token after x_{p+j+1}
        target_ids = argmax[:, after]
        labels = torch.where(target_ids >= 0, t2d[target_ids.clamp(min=0)], -1)  # -1: no label
        valid = mask & (labels >= 0)
        logits = head.lm_head(head.norm(hidden[valid]))
        if not valid.any():
            step_loss = logits.sum() * 0
        elif soft is None:
            step_loss = F.cross_entropy(logits, labels[valid])
        else:
            step_loss = soft_cross_entropy(logits, soft.ids[:, after][valid], soft.probs[:, after][valid], t2d)
        loss = loss + cfg.step_decay ** j * step_loss
        accs.append((int((logits.argmax(-1) == labels[valid]).sum()), int((mask & (target_ids >= 0)).sum())))
    return loss, accs


# ---- the loop ----

@dataclass(frozen=True)
class TrainBatch:
    features: torch.Tensor       # [B, n, 3H] with noise
    ids: torch.Tensor            # [B, n + unroll + 1] tokens (-1 = pad)
    argmax: torch.Tensor         # [B, n + unroll + 1] the target's argmax (-1 = pad)
    mask: torch.Tensor           # [B, n] positions whose step-1 label is an answer token
    soft: SoftLabels | None      # the target's top-k (None: soft_topk = 0)


class Trainer:
    def __init__(self, rows: list[dict], target_dir: Path, work: Path, cfg: TrainConfig,
                 feature_dtype: str = "float32"):
        self.cfg, self.work, self.target_dir = cfg, Path(work), Path(target_dir)
        self.seqs = sequences(rows)
        self.offsets = np.cumsum([0] + [len(s) for s, _ in self.seqs])
        tconf = load_target_config(target_dir)
        d2t, self.coverage = draft_vocab(rows, cfg.draft_vocab_size, tconf.vocab_size)
        self.t2d = target_to_draft(d2t, tconf.vocab_size)
        self.data = compute_features(self.seqs, target_dir, self.work / "features", cfg.feature_layers,
                                     dtype=feature_dtype, soft_topk=cfg.soft_topk)
        self.feat_std = float(np.asarray(self.data.features[:20000], dtype=np.float32).std())
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

    def _batch(self) -> TrainBatch:
        """Random sequences up to ~tokens_per_batch answer tokens, padded."""
        picked, tokens = [], 0
        while tokens < self.cfg.tokens_per_batch:
            i = int(self.rng.integers(len(self.seqs)))
            picked.append(i)
            tokens += len(self.seqs[i][0]) - self.seqs[i][1]
        n = max(len(self.seqs[i][0]) for i in picked)
        u, k, data = self.cfg.unroll, self.cfg.soft_topk, self.data
        feats = torch.zeros(len(picked), n, data.features.shape[1])
        ids = torch.full((len(picked), n + u + 1), -1, dtype=torch.int64)
        argmax = torch.full((len(picked), n + u + 1), -1, dtype=torch.int64)
        soft = SoftLabels(torch.full((len(picked), n + u + 1, k), -1, dtype=torch.int64),
                          torch.zeros(len(picked), n + u + 1, k)) if k else None
        mask = torch.zeros(len(picked), n, dtype=torch.bool)
        for row, i in enumerate(picked):
            seq, plen = self.seqs[i]
            rows = slice(self.offsets[i], self.offsets[i] + len(seq))
            feats[row, :len(seq)] = torch.from_numpy(np.asarray(data.features[rows], dtype=np.float32))
            ids[row, :len(seq)] = torch.tensor(seq)
            argmax[row, :len(seq)] = torch.from_numpy(np.asarray(data.labels[rows], dtype=np.int64))
            if soft is not None:
                soft.ids[row, :len(seq)] = torch.from_numpy(np.asarray(data.soft_ids[rows], dtype=np.int64))
                soft.probs[row, :len(seq)] = torch.from_numpy(np.asarray(data.soft_probs[rows], dtype=np.float32))
            mask[row, max(0, plen - 2):len(seq) - 2] = True  # label x_{p+2} is an answer token
        noise = (torch.rand_like(feats) - 0.5) * 2 * self.cfg.noise * self.feat_std
        return TrainBatch(feats + noise, ids, argmax, mask, soft)

    def train(self) -> None:
        bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train EAGLE-3 head", unit="step")
        while self.step < self.cfg.steps:
            b = self._batch()
            for g in self.opt.param_groups:
                g["lr"] = self._lr()
            loss, accs = unrolled_loss(self.head, self.embed, b.features, b.ids, b.argmax, b.mask, self.t2d,
                                       self.cfg, b.soft)
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

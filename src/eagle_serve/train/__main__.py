"""`python -m eagle_serve.train corpus|train|eval ...`: train an EAGLE head for a target.

  corpus  self-distil the target on the offline instruction set (resumable shards)
  train   train an EAGLE-3 head on the corpus (resumable checkpoints), save it in the
          published layout
  eval    measure acceptance of a head on held-out prompts with the real engine
"""
from __future__ import annotations

import argparse
import importlib
import json
import time
from dataclasses import asdict
from pathlib import Path

from eagle_serve import paths

DEFAULT_CORPUS = paths.REPO_ROOT / "drafters" / "data" / "smollm2-selfdistill"
PROMPT_SETS = {"base": ("prompts", "build_prompts"), "extended": ("prompts_more", "extended_prompts"),
               "chat": ("prompts_chat", "chat_prompts")}  # name: (module of eagle_serve.train, function)


def prompt_set(name: str):
    """The instruction set `name`'s builder: (seed, held-out prompts file) -> prompts."""
    module, function = PROMPT_SETS[name]
    return getattr(importlib.import_module(f"eagle_serve.train.{module}"), function)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle_serve.train")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("corpus")
    c.add_argument("--target", default="default")
    c.add_argument("--out", type=Path, default=DEFAULT_CORPUS)
    c.add_argument("--max-tokens", type=int, default=128)
    c.add_argument("--batch", type=int, default=32)
    c.add_argument("--shard-size", type=int, default=512, help="prompts per shard (x batch: fewer tail steps)")
    c.add_argument("--limit", type=int, default=None, help="at most this many new prompts")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--prompt-set", choices=list(PROMPT_SETS), default="base",
                   help="base: train.prompts; extended: train.prompts_more; chat: train.prompts_chat")
    c.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy answers; > 0 = sampled answers (seeded per prompt), labelled by the target's argmax at training")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    t = sub.add_parser("train")
    t.add_argument("--target", default="default")
    t.add_argument("--corpus", type=Path, nargs="+", default=[DEFAULT_CORPUS],
                   help="corpus folders (greedy and/or sampled answers), read in this order")
    t.add_argument("--feature-dtype", default="float32", choices=["float32", "bfloat16"],
                   help="dtype of the teacher-forced target pass (bfloat16: as the CPU server runs)")
    t.add_argument("--work", type=Path, default=paths.cache_dir() / "train-eagle3")
    t.add_argument("--out", type=Path, default=paths.default_drafter_dir())
    t.add_argument("--steps", type=int, default=1500)
    t.add_argument("--draft-vocab", type=int, default=4096)
    t.add_argument("--unroll", type=int, default=3)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--tokens-per-batch", type=int, default=2048)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--soft-topk", type=int, default=32,
                   help="soft labels: the target's top-k probabilities at each position (0 = its argmax alone)")
    t.add_argument("--feature-layers", type=int, nargs=3, default=None,
                   help="target layers whose inputs the head fuses (default 2, L//2, L-3)")
    e = sub.add_parser("eval")
    e.add_argument("--target", default="default")
    e.add_argument("--head", type=Path, default=paths.default_drafter_dir())
    e.add_argument("--prompts", type=Path, default=paths.HELDOUT_PROMPTS)
    e.add_argument("--k", type=int, default=4)
    e.add_argument("--max-tokens", type=int, default=96)
    e.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float64"], default="auto",
                   help="dtype of target and head, also of --teacher-forced's answers and features "
                        "(auto: what the server runs, models.checkpoints.torch_dtype)")
    e.add_argument("--teacher-forced", type=Path, default=None, metavar="WORK",
                   help="instead: per-step accuracy along the target's greedy answers (cached in WORK, "
                        "one per dtype)")
    args = parser.parse_args(argv)
    if args.command == "corpus":
        from eagle_serve.train.corpus import generate_corpus
        prompts = prompt_set(args.prompt_set)(args.seed, paths.HELDOUT_PROMPTS)
        n = generate_corpus(args.out, paths.resolve_model_path(args.target), prompts,
                            max_tokens=args.max_tokens, batch=args.batch,
                            shard_size=args.shard_size, limit=args.limit,
                            temperature=args.temperature, seed=args.seed, dtype=args.dtype)
        print(f"corpus: {n} new answers in {args.out}")
    elif args.command == "train":
        train(args)
    elif args.command == "eval":
        from eagle_serve.train.evaluate import evaluate, teacher_forced_accuracy
        if args.teacher_forced:
            report = teacher_forced_accuracy(args.head, paths.resolve_model_path(args.target),
                                             paths.read_prompts(args.prompts), args.teacher_forced,
                                             max_tokens=args.max_tokens, dtype=args.dtype)
            print(json.dumps(report, indent=2))
            return
        report = evaluate(args.head, paths.resolve_model_path(args.target),
                          paths.read_prompts(args.prompts), k=args.k, max_tokens=args.max_tokens,
                          dtype=args.dtype)
        print(json.dumps(report, indent=2))


def train(args) -> None:
    from eagle_serve.train.corpus import read_corpus
    from eagle_serve.train.trainer import TrainConfig, Trainer

    rows = [row for folder in args.corpus for row in read_corpus(folder)]
    cfg = TrainConfig(draft_vocab_size=args.draft_vocab, unroll=args.unroll, lr=args.lr,
                      steps=args.steps, tokens_per_batch=args.tokens_per_batch, seed=args.seed,
                      soft_topk=args.soft_topk,
                      feature_layers=tuple(args.feature_layers) if args.feature_layers else None)
    start = time.time()
    trainer = Trainer(rows, paths.resolve_model_path(args.target), args.work, cfg,
                      feature_dtype=args.feature_dtype)
    print(f"corpus: {len(rows)} answers; draft vocabulary {cfg.draft_vocab_size} covers "
          f"{trainer.coverage:.4f} of answer tokens", flush=True)
    trainer.train()
    card = {"corpora": [str(c) for c in args.corpus], "feature_dtype": args.feature_dtype,
            "corpus_rows": len(rows), "answer_tokens": sum(len(r["output_ids"]) for r in rows),
            "draft_vocab_coverage": round(trainer.coverage, 5), "config": asdict(cfg),
            "wall_time_s_this_run": round(time.time() - start, 1)}
    out = trainer.export(args.out, card)
    print(f"saved {out}: {json.dumps(card)}")


if __name__ == "__main__":
    main()

"""Rejection sampling against coupled verification of sampled drafts, in process (no server):

    python clients/sampled_verify.py --prompts clients/prompts/heldout.jsonl --num-prompts 8 \\
        --max-tokens 64 --json docs/sampled_verify.json --plot docs/sampled_verify.png

`sampled_verify` is a server setting, so one server cannot interleave the two; two in-process
engines on the default model (the served settings, one per mode) can. Each prompt runs through
every config in turn, seeded (seed = 1000 + prompt index) at --temperature: plain sampling
(k = 0), the shipped rejection-sampled chains, coupled chains of the same length, a coupled
2x2 tree keeping 4 drafts, and coupled requests as served (a 2x2 tree, all 6 of its drafts).
Prints tokens/s, the speedup over plain sampling and tau per config, and how
many coupled outputs equal plain sampling's (all of them, by construction).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from eagle_serve import paths
from eagle_serve.local import build_local_engine
from eagle_serve.requests import SamplingParams, acceptance_length
from eagle_serve.tokenization import encode_prompt

CONFIGS = {  # name: (sampled_verify, request parameters)
    "plain": ("rejection", dict(num_speculative_tokens=0)),
    "rejection": ("rejection", {}),
    "coupled chains": ("coupled", dict(draft_topk=1, draft_depth=2)),
    "coupled 2x2 tree, k 4": ("coupled", dict(num_speculative_tokens=4)),
    "coupled (2x2 tree, k 6)": ("coupled", {}),
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    target, head = paths.default_target_dir(), paths.default_drafter_dir()
    engines = {mode: build_local_engine(target, head, sampled_verify=mode)
               for mode in ("rejection", "coupled")}
    tokenizer = engines["rejection"].tokenizer
    prompts = paths.read_prompts(args.prompts)[:args.num_prompts]
    totals = {name: dict(tokens=0, seconds=0.0, rounds=0, accepted=0, same=0) for name in CONFIGS}
    for i, prompt in enumerate(tqdm(prompts, unit="prompt")):
        ids, plain = encode_prompt(tokenizer, prompt), None
        for name, (mode, kw) in CONFIGS.items():
            params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                    seed=1000 + i, **kw)
            start = time.perf_counter()
            out = engines[mode].generate([ids], [params])[0]
            t = totals[name]
            t["seconds"] += time.perf_counter() - start
            t["tokens"] += len(out.token_ids)
            t["rounds"] += out.last.num_rounds
            t["accepted"] += out.last.num_accepted_tokens
            plain = out.token_ids if plain is None else plain
            t["same"] += out.token_ids == plain
    base = totals["plain"]["tokens"] / totals["plain"]["seconds"]
    rows = {}
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        rows[name] = dict(tokens_per_s=rate, speedup=rate / base,
                          tau=acceptance_length(t["accepted"], t["rounds"]), same_as_plain=t["same"])
        print(f"{name:>24}: {rate:6.2f} tokens/s  {rate / base:5.2f}x  tau {rows[name]['tau']:.2f}  "
              f"output = plain sampling's: {t['same']}/{len(prompts)}")
    Path(args.json).write_text(json.dumps(dict(vars(args), results=rows), indent=1))
    if args.plot:
        plot(rows, Path(args.plot), f"sampled verification, T={args.temperature:g}, "
                                    f"{len(prompts)} prompts x {args.max_tokens} tokens")


def plot(rows: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    names = list(rows)
    bars = ax.bar(names, [rows[n]["speedup"] for n in names], color="tab:blue")
    for bar, n in zip(bars, names):
        ax.annotate(f"tau {rows[n]['tau']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel("speedup over plain sampling")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

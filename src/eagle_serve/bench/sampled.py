"""Rejection sampling against coupled verification of sampled drafts, in process (no server):

    eagle-serve bench sampled --prompts clients/prompts/heldout.jsonl --num-prompts 8 \\
        --max-tokens 64 [--concurrency 4] --json docs/results/sampled_verify.json \\
        --plot docs/results/sampled_verify.png

`sampled_verify` is a server setting, so one server cannot interleave the modes; in-process
engines on the default model (the served settings, one per mode) can. Each prompt (each wave
of --concurrency prompts, run together) goes through every config in turn, seeded (seed =
1000 + prompt index) at --temperature: plain sampling (k = 0), rejection-sampled chains (mode
`rejection`: a seeded request drafts as if alone), mode `auto` (seeded requests coupled,
drafting by the load), coupled chains of the same length, a coupled 2x2 tree keeping 4 drafts,
and coupled requests as served (`coupled`, shipped: a 2x2 tree, all 6 of its drafts). Prints
tokens/s, the speedup over plain sampling and tau per config, and how many outputs equal plain
sampling's (every coupled one, by construction). Each engine first runs the first wave twice,
unseeded and untimed, so that its measured draft costs are in place (as on a running server).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from eagle_serve import paths
from eagle_serve.core.requests import SamplingParams, acceptance_length
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.local import build_local_engine

CONFIGS = {  # name: (sampled_verify, request parameters)
    "plain": ("rejection", dict(num_speculative_tokens=0)),
    "rejection": ("rejection", {}),
    "auto": ("auto", {}),
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
    p.add_argument("--concurrency", type=int, default=1, help="prompts run together")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    target, head = paths.default_target_dir(), paths.default_drafter_dir()
    engines = {mode: build_local_engine(target, head, sampled_verify=mode)
               for mode in ("rejection", "coupled", "auto")}
    tokenizer = engines["rejection"].tokenizer
    prompts = paths.read_prompts(args.prompts)[:args.num_prompts]
    totals = {name: dict(tokens=0, seconds=0.0, rounds=0, accepted=0, same=0) for name in CONFIGS}
    waves = [range(i, min(i + args.concurrency, len(prompts)))
             for i in range(0, len(prompts), args.concurrency)]
    for engine in engines.values():  # untimed: first calls, and each engine's measured costs
        engine.generate([encode_prompt(tokenizer, prompts[i]) for i in waves[0]] * 2,
                        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature))
    for wave in tqdm(waves, unit="wave"):
        ids, plain = [encode_prompt(tokenizer, prompts[i]) for i in wave], None
        for name, (mode, kw) in CONFIGS.items():
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                     seed=1000 + i, **kw) for i in wave]
            start = time.perf_counter()
            outs = engines[mode].generate(ids, params)
            t = totals[name]
            t["seconds"] += time.perf_counter() - start
            tokens = [out.token_ids for out in outs]
            t["tokens"] += sum(map(len, tokens))
            t["rounds"] += sum(out.last.num_rounds for out in outs)
            t["accepted"] += sum(out.last.num_accepted_tokens for out in outs)
            plain = tokens if plain is None else plain
            t["same"] += sum(a == b for a, b in zip(tokens, plain))
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
        streams = f", {args.concurrency} streams" if args.concurrency > 1 else ""
        plot(rows, Path(args.plot), f"sampled verification, T={args.temperature:g}, "
                                    f"{len(prompts)} prompts x {args.max_tokens} tokens{streams}")


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

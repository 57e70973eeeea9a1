"""Speedup of speculative decoding against plain decoding on the same server, per draft shape.

    python clients/speedup_curve.py --prompts clients/prompts/heldout.jsonl --max-tokens 64 \\
        --configs 0 1 2 3 4 6 4x2x3 --json out/curve.json --plot out/curve.png

A config is `K` (a chain of K drafts; 0 = plain decoding) or `KxTOPKxDEPTH` (a dynamic draft
tree: K nodes verified per round, TOPK children per node, DEPTH levels). bs 1, greedy: the
prompts are sent one at a time, each prompt through every config in turn (round-robin), so
slow drift of the machine hits every config alike. Tokens/s per config = all its tokens over
all its request latencies; speedup = that over config 0's; tau = tokens per verify round.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from eagle_serve.client import grpc_generate
from eagle_serve.paths import read_prompts
from eagle_serve.requests import acceptance_length


def parse_config(text: str) -> dict:
    parts = [int(x) for x in text.split("x")]
    if len(parts) == 1:  # a chain whatever the server's default tree shape
        k = parts[0]
        return {"num_speculative_tokens": k, **({"draft_topk": 1, "draft_depth": k} if k else {})}
    k, topk, depth = parts
    return {"num_speculative_tokens": k, "draft_topk": topk, "draft_depth": depth}


def measure(url: str, prompts: list[str], configs: list[str], max_tokens: int, model: str) -> dict:
    totals = {c: {"tokens": 0, "seconds": 0.0, "rounds": 0, "accepted": 0, "drafted": 0} for c in configs}
    for c in configs:  # warm-up, untimed
        grpc_generate(url, prompts[0], model=model, max_tokens=8, **parse_config(c))
    for prompt in tqdm(prompts, desc="prompts x configs", unit="prompt"):
        for c in configs:
            gen = grpc_generate(url, prompt, model=model, max_tokens=max_tokens, **parse_config(c))
            if gen.error:
                raise SystemExit(f"{c}: {gen.error}")
            t = totals[c]
            t["tokens"] += len(gen.output_ids)
            t["seconds"] += gen.latency_s
            t["rounds"] += gen.counters.get("num_rounds", 0)
            t["accepted"] += gen.counters.get("num_accepted_tokens", 0)
            t["drafted"] += gen.counters.get("num_draft_tokens", 0)
    base = totals[configs[0]]["tokens"] / totals[configs[0]]["seconds"]
    out = {}
    for c, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        out[c] = {**t, "tokens_per_s": round(tps, 2), "speedup": round(tps / base, 3),
                  "tau": round(acceptance_length(t["accepted"], t["rounds"]), 3) if t["rounds"] else 1.0}
    return out


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(names, [results[n]["speedup"] for n in names],
                  color=["grey" if n == names[0] else "tab:blue" for n in names])
    for bar, n in zip(bars, names):
        ax.annotate(f"tau {results[n]['tau']:.2f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("config: k (chain) or k x topk x depth (tree)")
    ax.set_ylabel(f"speedup vs {names[0]} (tokens/s ratio)")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=["0", "1", "2", "3", "4"],
                   help="the first is the baseline (use 0)")
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="spec_decode", help="ensemble or spec_decode")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    p.add_argument("--title", default="speculative vs plain decoding, bs 1, greedy")
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    results = measure(args.url, prompts, args.configs, args.max_tokens, args.model)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    for c, r in results.items():
        print(f"{c:>10}: {r['tokens_per_s']:6.2f} tok/s  speedup {r['speedup']:.2f}x  tau {r['tau']:.2f}")
    if args.plot:
        plot(results, Path(args.plot), args.title)


if __name__ == "__main__":
    main()

"""Speedup of speculative decoding against plain decoding on the same server, per draft shape.

    eagle-serve bench serve --prompts clients/prompts/heldout.jsonl --max-tokens 64 \\
        --configs 0 1 2 3 4 6 4x2x3 --json out/curve.json --plot out/curve.png

A config is `K` (a chain of K drafts; 0 = plain decoding), `KxTOPKxDEPTH` (a dynamic draft
tree: K nodes verified per round, TOPK children per node, DEPTH levels), `default` (the
server's defaults), `head` (the defaults with the lookup draft sources off), or a peer run
in this process, one stream only (bench.peers): `hf` (Hugging Face `generate` on the same
weights, in `--hf-dtype`) or `llama.cpp` (llama-cpp-python on the default target's GGUF file,
or `--gguf`). The prompts go in groups of `--concurrency` (1: one at a time), each group
through every config in turn (round-robin, the order reversed every other group), so drift of
the machine hits every config alike. Tokens/s per config = its tokens over its request
latencies (groups: their wall time); speedup = that over the first config's, with a 95%
interval (`speedup_interval`: the groups resampled, each config's drift-paired runs together, so
a case whose interval holds 1.00 is not told apart from plain decoding by this run; it is the
spread between one run's groups, and whole runs differ by more); tau = tokens per verify round;
greedy outputs are checked against the first config's.
"""
from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eagle_serve import paths
from eagle_serve.bench.peers import PEERS, make_peer
from eagle_serve.client import grpc_generate, metrics
from eagle_serve.core.requests import acceptance_length
from eagle_serve.paths import read_prompts
from eagle_serve.spec.lookup import SOURCES

NAMED = {"default": {},                                              # the server's defaults
         "head": {"context_lookup": False, "corpus_lookup": False}}  # ... drafting from the head alone


RESAMPLES, LEVEL = 2000, 0.95  # speedup_interval's bootstrap


def speedup_interval(base: list[tuple[int, float]], other: list[tuple[int, float]],
                     level: float = LEVEL, resamples: int = RESAMPLES, seed: int = 0) -> tuple[float, float]:
    """A percentile bootstrap interval of other's speedup over base. base, other: (tokens,
    seconds) of each group, in the same order (group g ran through both configs back to back);
    each resample draws groups with replacement, the same groups for both configs, and takes
    their tokens over their seconds, as `measure` does for the whole run."""
    b, o = np.asarray(base, dtype=np.float64), np.asarray(other, dtype=np.float64)  # [G, 2]
    picks = np.random.default_rng(seed).integers(0, len(b), size=(resamples, len(b)))  # [S, G]
    speedups = (o[picks, 0].sum(1) / o[picks, 1].sum(1)) / (b[picks, 0].sum(1) / b[picks, 1].sum(1))
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(speedups, [tail, 100 - tail])
    return float(lo), float(hi)


def parse_config(text: str) -> dict:
    if text in PEERS:
        return {}
    if text in NAMED:
        return NAMED[text]
    parts = [int(x) for x in text.split("x")]
    if len(parts) == 1:  # a chain whatever the server's default tree shape
        k = parts[0]
        return {"num_speculative_tokens": k, **({"draft_topk": 1, "draft_depth": k} if k else {})}
    k, topk, depth = parts
    return {"num_speculative_tokens": k, "draft_topk": topk, "draft_depth": depth}


def measure(url: str, prompts: list[str], configs: list[str], max_tokens: int, model: str,
            concurrency: int = 1, sampling: dict | None = None, seeded: bool = True,
            peer_args: tuple[str, str, str | None] | None = None, ignore_eos: bool = False, mixed: bool = False) -> dict:
    """Each group of `concurrency` prompts runs through every config in turn (its prompts as
    concurrent streams); tokens/s = a config's tokens over its groups' wall time. Sampled
    requests carry a seed per prompt unless `seeded` is false. peer_args: the peers' (target
    folder, hf dtype, GGUF file or None) (default: the default target, bf16, its GGUF file).
    ignore_eos: every request emits max_tokens (as vLLM's and SGLang's serving benchmarks'
    --ignore-eos), so that configs whose sampled outputs differ still run the same work: a
    group's wall time is its longest stream's, and a group whose other streams stop early emits
    fewer tokens in that time. mixed: every other stream of a group (the 2nd, 4th, ...) is
    sampled, the rest greedy, as traffic of both kinds shares the batch; only the greedy
    streams' outputs are compared (`compared`), and `speedup_by_kind` is each kind's tokens
    over its requests' latencies against the first config's (a group's wall time is its
    slowest stream's: where one kind gains and the other waits on its verify rows, the group's
    speedup shows the slower kind, the latencies both)."""
    sampling = sampling or {}
    named_peers = [c for c in configs if c in PEERS]
    if named_peers and concurrency != 1:
        raise SystemExit(f"the {named_peers[0]} peer runs one stream: use --concurrency 1")
    peers = {c: make_peer(c, *(peer_args or (str(paths.default_target_dir()), "bfloat16", None)))
             for c in named_peers}
    totals = {c: {"tokens": 0, "seconds": 0.0, "rounds": 0, "accepted": 0, "drafted": 0,
                  "same_as_first": 0, "compared": 0, "requests": 0} for c in configs}
    by_group: dict[str, list[tuple[int, float]]] = {c: [] for c in configs}  # (tokens, seconds)
    per_kind = {c: {k: [0, 0.0] for k in ("greedy", "sampled")} for c in configs}  # tokens, s
    def generate(config: str, prompt: str, **params):
        if config in peers:
            return peers[config](prompt, **params)
        return grpc_generate(url, prompt, model=model, **params, **parse_config(config))

    for c in configs:  # warm-up, untimed
        generate(c, prompts[0], max_tokens=8)
    eos = {"ignore_eos": True} if ignore_eos else {}

    def stream_sampling(i: int) -> dict:  # the i-th stream of a group
        return sampling if not mixed or i % 2 else {}
    groups = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
    with futures.ThreadPoolExecutor(concurrency) as pool:
        for n, group in enumerate(tqdm(groups, desc="prompt groups x configs", unit="group")):
            outputs = {}
            for c in (configs if n % 2 == 0 else configs[::-1]):  # drift within a group cancels
                def run(i_prompt):
                    i, prompt = i_prompt
                    params = stream_sampling(i)
                    return generate(c, prompt, max_tokens=max_tokens, **eos,
                                    **({"seed": 1000 * n + i} if params and seeded else {}), **params)
                start = time.perf_counter()
                gens = list(pool.map(run, enumerate(group)))
                wall = time.perf_counter() - start
                for gen in gens:
                    if gen.error:
                        raise SystemExit(f"{c}: {gen.error}")
                outputs[c] = [g.output_ids for g in gens]
                t = totals[c]
                seconds = wall if concurrency > 1 else gens[0].latency_s
                t["seconds"] += seconds
                by_group[c].append((sum(len(g.output_ids) for g in gens), seconds))
                t["requests"] += len(gens)
                for i, gen in enumerate(gens):
                    kind = per_kind[c]["sampled" if stream_sampling(i) else "greedy"]
                    kind[0], kind[1] = kind[0] + len(gen.output_ids), kind[1] + gen.latency_s
                    t["tokens"] += len(gen.output_ids)
                    t["rounds"] += gen.counters.get("num_rounds", 0)
                    t["accepted"] += gen.counters.get("num_accepted_tokens", 0)
                    t["drafted"] += gen.counters.get("num_draft_tokens", 0)
            compared = [i for i in range(len(group)) if not (mixed and stream_sampling(i))]
            for c, outs in outputs.items():
                totals[c]["same_as_first"] += sum(outs[i] == outputs[configs[0]][i] for i in compared)
                totals[c]["compared"] += len(compared)
    base = totals[configs[0]]["tokens"] / totals[configs[0]]["seconds"]
    out = {}
    for c, t in totals.items():
        tps = t["tokens"] / t["seconds"]
        out[c] = {**t, "tokens_per_s": round(tps, 2), "speedup": round(tps / base, 3),
                  "speedup_interval": [round(x, 3) for x in speedup_interval(by_group[configs[0]], by_group[c])],
                  "tau": round(acceptance_length(t["accepted"], t["rounds"]), 3)}
        if mixed:  # each kind's tokens over its requests' latencies, against the first config's
            out[c]["speedup_by_kind"] = {
                k: round(tokens / s / (per_kind[configs[0]][k][0] / per_kind[configs[0]][k][1]), 3)
                for k, (tokens, s) in per_kind[c].items()}
    return out


def interval(result: dict) -> str:
    """A config's speedup interval as printed: "0.97-1.08"."""
    lo, hi = result["speedup_interval"]
    return f"{lo:.2f}-{hi:.2f}"


def by_kind(result: dict) -> str:
    """A mixed case's speedup of each kind's requests (their latencies), else ''."""
    kinds = result.get("speedup_by_kind")
    return f"; greedy {kinds['greedy']:.2f}x, sampled {kinds['sampled']:.2f}x" if kinds else ""


def interval_errors(results: list[dict]) -> list[list[float]]:
    """matplotlib's yerr (below, above each speedup) from the results' intervals."""
    return [[max(r["speedup"] - r["speedup_interval"][0], 0.0) for r in results],
            [max(r["speedup_interval"][1] - r["speedup"], 0.0) for r in results]]


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    speedups = [results[n]["speedup"] for n in names]
    bars = ax.bar(names, speedups, color=["grey" if n == names[0] else "tab:blue" for n in names])
    ax.errorbar(names, speedups, yerr=interval_errors([results[n] for n in names]), fmt="none",
                ecolor="black", capsize=3, lw=0.8, label=f"{LEVEL:.0%} interval (groups resampled)")
    for bar, n in zip(bars, names):
        ax.annotate(f"tau {results[n]['tau']:.2f}", (bar.get_x() + bar.get_width() / 2,
                    results[n]["speedup_interval"][1]), ha="center", va="bottom", fontsize=8)
    ax.legend(loc="lower right", fontsize=8)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("config: k (chain), k x topk x depth (tree), or a named one")
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
    p.add_argument("--title")
    p.add_argument("--concurrency", type=int, default=1, help="concurrent streams per config")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled requests, seeded per prompt (outputs differ by config)")
    p.add_argument("--unseeded", action="store_true",
                   help="sampled requests without a seed (as most chat clients send them)")
    p.add_argument("--mixed", action="store_true", help="every other stream of a group sampled at "
                   "--temperature, the rest greedy (--concurrency 2 or more)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="every request emits --max-tokens (sampled outputs differ by config)")
    p.add_argument("--hf-target", default=str(paths.default_target_dir()),
                   help="the peers' model folder (the served target's): hf's weights, both's tokenizer")
    p.add_argument("--hf-dtype", default="bfloat16", help="the hf config's dtype")
    p.add_argument("--gguf", help="the llama.cpp config's GGUF file (default: the default target's)")
    p.add_argument("--metrics-url", help="also report the accepted tokens per draft source "
                   "(the server's Prometheus counters, before and after)")
    args = p.parse_args(argv)
    if args.mixed and (args.concurrency < 2 or not args.temperature):
        raise SystemExit("--mixed needs --concurrency 2 or more and a --temperature above 0")
    kind = f"temperature {args.temperature}" if args.temperature else "greedy"
    args.title = args.title or (f"speculative vs plain decoding, {args.concurrency} stream(s), "
                                + (f"greedy + {kind}" if args.mixed else kind))
    prompts = read_prompts(args.prompts)
    before = source_counts(args.metrics_url) if args.metrics_url else None
    results = measure(args.url, prompts, args.configs, args.max_tokens, args.model, args.concurrency,
                      {"temperature": args.temperature} if args.temperature else None,
                      seeded=not args.unseeded,
                      peer_args=(args.hf_target, args.hf_dtype, args.gguf),
                      ignore_eos=args.ignore_eos, mixed=args.mixed)
    if before is not None:
        after = source_counts(args.metrics_url)
        results["accepted_by_source"] = {s: after[s] - before[s] for s in after}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    for c in args.configs:
        r = results[c]
        print(f"{c:>10}: {r['tokens_per_s']:6.2f} tok/s  speedup {r['speedup']:.2f}x ({LEVEL:.0%} "
              f"{interval(r)})  tau {r['tau']:.2f}"
              f"  output same as {args.configs[0]}: {r['same_as_first']}/{r['compared']}"
              + by_kind(r))
    if before is not None:
        print("accepted draft tokens by source:", results["accepted_by_source"])
    if args.plot:
        plot({c: results[c] for c in args.configs}, Path(args.plot), args.title)


def source_counts(metrics_url: str) -> dict[str, float]:
    m = metrics(metrics_url)
    return {s: m.get(f'eagle_spec_decode_accepted_tokens_by_source_total{{source="{s}"}}', 0.0)
            for s in SOURCES}


if __name__ == "__main__":
    main()

"""Speculative against plain decoding in every serving case: greedy and sampled, 1/4/8 streams,
64 and 128 tokens, through a running server.

    python clients/speedup_matrix.py --prompts clients/prompts/heldout.jsonl \\
        --json docs/matrix.json --plot docs/matrix.png

Each case runs speedup_curve.measure: the prompts go in groups of the case's concurrency, each
group through every config in turn (reversed every other group), so drift hits every config alike.
A case of several streams runs the prompts as many times over as makes at least MIN_GROUPS groups
(20 prompts: 2 passes at 4 streams, 4 at 8): with the 3 groups of one pass at 8 streams, plain
decoding against a server drafting nothing measured 0.89x once, the order of the configs
unbalanced and a drifting 2-core machine's few minutes in each.
Sampled requests carry no seed unless --seeded, and ignore EOS: their outputs differ by config,
and a group of streams runs as long as its longest one, so a config whose other streams happened
to stop early would seem slower for doing less work (plain decoding against a server drafting
nothing measured 0.92x at 4 streams that way).
Prints a Markdown table (speedup, tau, and for greedy and seeded cases whether every output
equals plain decoding's); the JSON is rewritten after each case.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from eagle_serve.paths import read_prompts
from speedup_curve import measure  # this script's folder is on sys.path

TEMPERATURES = (0.0, 0.7)
CONCURRENCY = (1, 4, 8)
MAX_TOKENS = (64, 128)
MIN_GROUPS = 10  # groups of concurrent prompts per case (an even number balances the order)


def case_prompts(prompts: list[str], concurrency: int) -> list[str]:
    """The prompts of a case: as many passes over them as make MIN_GROUPS groups of
    `concurrency` (one pass for a single stream, whose groups are the prompts)."""
    if concurrency == 1:
        return prompts
    return prompts * -(-MIN_GROUPS * concurrency // len(prompts))


def case_name(temperature: float, concurrency: int, max_tokens: int) -> str:
    kind = f"temperature {temperature:g}" if temperature else "greedy"
    return f"{kind}, {concurrency} stream{'s' if concurrency > 1 else ''}, {max_tokens} tokens"


def table(results: dict, configs: list[str]) -> str:
    head = "| case | plain tokens/s | " + " | ".join(f"`{c}` speedup (tau)" for c in configs[1:])
    lines = [head + " | output = plain |", "|---" * (len(configs) + 2) + "|"]
    for name, r in results.items():
        base = r[configs[0]]
        cells = [f"{r[c]['speedup']:.2f}x ({r[c]['tau']:.2f})" for c in configs[1:]]
        same = ("(sampled)" if r["temperature"] and not r.get("seeded") else  # else: must be equal
                ", ".join(f"{r[c]['same_as_first']}/{r[c]['requests']}" for c in configs[1:]))
        lines.append(f"| {name} | {base['tokens_per_s']:.2f} | " + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def plot(results: dict, configs: list[str], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(results)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / (len(configs) - 1)
    for j, c in enumerate(configs[1:]):
        xs = [i + j * width for i in range(len(names))]
        bars = ax.bar(xs, [results[n][c]["speedup"] for n in names], width, label=c)
        for bar, n in zip(bars, names):
            ax.annotate(f"{results[n][c]['speedup']:.2f}", (bar.get_x() + bar.get_width() / 2,
                        bar.get_height()), ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels([n.replace("temperature ", "T=").replace(", ", "\n") for n in names], fontsize=7)
    ax.set_ylabel(f"speedup vs {configs[0]} (tokens/s ratio)")
    ax.set_title("speculative vs plain decoding per serving case")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--configs", nargs="+", default=["0", "default"], help="the first is the baseline")
    p.add_argument("--temperatures", type=float, nargs="+", default=TEMPERATURES)
    p.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY)
    p.add_argument("--max-tokens", type=int, nargs="+", default=MAX_TOKENS)
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="spec_decode", help="ensemble or spec_decode")
    p.add_argument("--seeded", action="store_true", help="sampled requests carry a seed (coupled, "
                   "as the server ships, their output is then plain sampling's)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    results = {}
    for temperature, concurrency, max_tokens in itertools.product(
            args.temperatures, args.concurrency, args.max_tokens):
        name = case_name(temperature, concurrency, max_tokens)
        print(name, flush=True)
        sampling = {"temperature": temperature} if temperature else None
        r = measure(args.url, case_prompts(prompts, concurrency), args.configs, max_tokens, args.model,
                    concurrency, sampling, args.seeded, ignore_eos=bool(temperature))
        results[name] = {**r, "temperature": temperature, "concurrency": concurrency,
                         "max_tokens": max_tokens, "seeded": bool(temperature and args.seeded),
                         "ignore_eos": bool(temperature)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results, args.configs))
    if args.plot:
        plot(results, args.configs, Path(args.plot))


if __name__ == "__main__":
    main()

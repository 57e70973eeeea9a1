"""Speculative against plain decoding in every serving case: greedy and sampled, 1/4/8 streams,
64 and 128 tokens, and greedy and sampled streams mixed in one batch, through a running server.

    eagle-serve bench matrix --prompts clients/prompts/heldout.jsonl \\
        --json docs/results/matrix.json --plot docs/results/matrix.png

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
A mixed case ("greedy + temperature T") runs every other stream of a group sampled at T, the rest
greedy (ignoring EOS too), for each concurrency above 1 (--mixed-temperatures; none to leave it out);
its row adds each kind's speedup by its requests' latencies (a group lasts as long as its slowest
stream, so the group's speedup is the slower kind's).
Prints a Markdown table (speedup with its 95% interval over the case's groups, tau, and for
greedy and seeded cases whether every output equals plain decoding's); the JSON is rewritten
after each case, and the plot draws each interval on its bar.
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

from eagle_serve.bench.serve import LEVEL, by_kind, interval, interval_errors, measure
from eagle_serve.paths import read_prompts

TEMPERATURES = (0.0, 0.7)
MIXED_TEMPERATURES = (0.7,)  # the sampled half of a mixed case's streams
CONCURRENCY = (1, 4, 8)
MAX_TOKENS = (64, 128)
MIN_GROUPS = 10  # groups of concurrent prompts per case (an even number balances the order)


def case_prompts(prompts: list[str], concurrency: int) -> list[str]:
    """The prompts of a case: as many passes over them as make MIN_GROUPS groups of
    `concurrency` (one pass for a single stream, whose groups are the prompts)."""
    if concurrency == 1:
        return prompts
    return prompts * -(-MIN_GROUPS * concurrency // len(prompts))


def case_name(temperature: float, concurrency: int, max_tokens: int, mixed: bool = False) -> str:
    kind = f"temperature {temperature:g}" if temperature else "greedy"
    kind = f"greedy + {kind}" if mixed else kind
    return f"{kind}, {concurrency} stream{'s' if concurrency > 1 else ''}, {max_tokens} tokens"


def cases(args) -> list[tuple[float, int, int, bool]]:
    """(temperature, concurrency, max_tokens, mixed) of every case, the mixed ones last."""
    plain = [(t, c, m, False) for t, c, m in itertools.product(
        args.temperatures, args.concurrency, args.max_tokens)]
    mixed = [(t, c, m, True) for t, c, m in itertools.product(
        args.mixed_temperatures, args.concurrency, args.max_tokens) if c > 1]
    return plain + mixed


def table(results: dict, configs: list[str]) -> str:
    head = "| case | plain tokens/s | " + " | ".join(f"`{c}` speedup [{LEVEL:.0%} interval] (tau)"
                                                  for c in configs[1:])
    lines = [head + " | output = plain |", "|---" * (len(configs) + 2) + "|"]
    for name, r in results.items():
        base = r[configs[0]]
        cells = [f"{r[c]['speedup']:.2f}x [{interval(r[c])}] ({r[c]['tau']:.2f})" + by_kind(r[c])
                 for c in configs[1:]]
        same = ", ".join(f"{r[c]['same_as_first']}/{r[c]['compared']}" for c in configs[1:])
        if r.get("mixed"):  # only its greedy streams' outputs are compared
            same = f"{same} greedy"
        elif r["temperature"] and not r.get("seeded"):  # else: every output must be equal
            same = "(sampled)"
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
        speedups = [results[n][c]["speedup"] for n in names]
        bars = ax.bar(xs, speedups, width, label=c)
        ax.errorbar(xs, speedups, yerr=interval_errors([results[n][c] for n in names]), fmt="none",
                    ecolor="black", capsize=2, lw=0.8,
                    label=f"{LEVEL:.0%} interval (groups resampled)" if j == 0 else None)
        for bar, n in zip(bars, names):
            ax.annotate(f"{results[n][c]['speedup']:.2f}", (bar.get_x() + bar.get_width() / 2,
                        results[n][c]["speedup_interval"][1]), ha="center", va="bottom", fontsize=7)
        mixed = [(x, results[n][c]["speedup_by_kind"]) for x, n in zip(xs, names)
                 if "speedup_by_kind" in results[n][c]]
        for kind, marker in (("greedy", "^"), ("sampled", "v")) if mixed else ():  # its kinds
            ax.scatter([x for x, _ in mixed], [k[kind] for _, k in mixed], marker=marker,
                       color="black", zorder=3, s=18,
                       label=f"{c}: its {kind} requests (latency)" if j == 0 else None)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))])
    ax.set_xticklabels([n.replace("temperature ", "T=").replace(" + ", "\n+").replace(", ", "\n")
                        for n in names], fontsize=7)
    ax.set_ylabel(f"speedup vs {configs[0]} (tokens/s ratio)")
    ax.set_title("speculative vs plain decoding per serving case")
    top = max(max([r[c]["speedup_interval"][1], *r[c].get("speedup_by_kind", {}).values()])
              for r in results.values() for c in configs[1:])
    ax.set_ylim(0, 1.3 * top)  # room above the bars for the legend
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--configs", nargs="+", default=["0", "default"], help="the first is the baseline")
    p.add_argument("--temperatures", type=float, nargs="*", default=TEMPERATURES,
                   help="greedy (0) and sampled cases (none: the mixed cases alone)")
    p.add_argument("--concurrency", type=int, nargs="+", default=CONCURRENCY)
    p.add_argument("--max-tokens", type=int, nargs="+", default=MAX_TOKENS)
    p.add_argument("--mixed-temperatures", type=float, nargs="*", default=MIXED_TEMPERATURES,
                   help="a mixed case per value and concurrency above 1 (none: no mixed cases)")
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--model", default="spec_decode", help="ensemble or spec_decode")
    p.add_argument("--seeded", action="store_true", help="sampled requests carry a seed (coupled, "
                   "as the server ships, their output is then plain sampling's)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot")
    args = p.parse_args(argv)
    prompts = read_prompts(args.prompts)
    results = {}
    for temperature, concurrency, max_tokens, mixed in cases(args):
        name = case_name(temperature, concurrency, max_tokens, mixed)
        print(name, flush=True)
        sampling = {"temperature": temperature} if temperature else None
        r = measure(args.url, case_prompts(prompts, concurrency), args.configs, max_tokens, args.model,
                    concurrency, sampling, args.seeded, ignore_eos=bool(temperature), mixed=mixed)
        results[name] = {**r, "temperature": temperature, "concurrency": concurrency,
                         "max_tokens": max_tokens, "seeded": bool(temperature and args.seeded),
                         "ignore_eos": bool(temperature), "mixed": mixed}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(table(results, args.configs))
    if args.plot:
        plot(results, args.configs, Path(args.plot))


if __name__ == "__main__":
    main()

"""How much speculation can gain at most on this machine, by concurrency (in process, no server):

    eagle-serve bench ceiling [--streams 1 2 4 8] [--drafts 0 1 2 3 4] [--context 200]
        [--temperature 0] [--overhead-ms 0 3] [--draft-ms 0] [--repeats 9] [--speedups 1.3 1.8]
        [--json F.json] [--plot F.png]

Times the default target's served forward for B requests at once, each verifying 1 + d rows (its
next token and d drafts): greedy rows take the screened LM head as the server's do, sampled ones
(--temperature > 0) every logit and the probabilities. Configs are interleaved, medians of
--repeats. A row verifies one token at most, so with free drafts (lookups; a drafter call costs
more) and a chain whose drafts are each kept with chance a given the ones before,

    ceiling(B, a) = max over d of (1 + a + ... + a^d) * (T(B, 0) + o) / (T(B, d) + o)

bounds the speedup of any draft source that good over plain decoding, where o is a round's cost
outside the forward (--overhead-ms: ~3 ms through the server on a 2-core EPYC, a round of
`round_split.py` less this forward); --draft-ms adds what drafting costs a round that drafts
(a drafter call, where the head drafts). a = 1 (every draft right) bounds every draft source and shape:
past it, only a cheaper verify row helps. --speedups prints the least a each concurrency needs
for each speedup. docs/performance.md quotes it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import time
from dataclasses import asdict, dataclass

import torch

from eagle_serve import paths
from eagle_serve.core.interfaces import RaggedBatch, RowSampling
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.tokenization import encode_prompt, load_tokenizer
from eagle_serve.models.dtypes import torch_dtype
from eagle_serve.models.target import TargetModel

PAGE = 16  # tokens a KV page
ACCEPTANCE = (0.5, 0.8, 1.0)  # ~this project's lookups and head / published heads / every draft


@dataclass
class Ceiling:
    streams: int
    acceptance: float
    overhead_ms: float
    drafts: int         # the d that reaches it
    speedup: float      # over plain decoding at the same concurrency


def text_tokens(tokenizer, count: int) -> torch.Tensor:
    """[count] int64: the held-out prompts' tokens, one after another (real text, so the logits
    are as peaked as a request's and the screened LM head keeps as few candidates)"""
    ids: list[int] = []
    for prompt in itertools.cycle(paths.read_prompts(paths.HELDOUT_PROMPTS)):
        if len(ids) >= count:
            return torch.tensor(ids[:count])
        ids += encode_prompt(tokenizer, prompt)


def chain_batch(tables: list[list[int]], pool: PagePool, tokens: torch.Tensor, start: int,
                rows: int) -> RaggedBatch:
    """One request per page table, each with `rows` new tokens at positions start..start+rows-1
    (a causal chain; prefill when start is 0)."""
    positions = torch.arange(start, start + rows).repeat(len(tables))
    slots = [pool.slot(t, p) for t in tables for p in range(start, start + rows)]
    return RaggedBatch(tokens[start:start + rows].repeat(len(tables)), positions,
                       torch.arange(0, len(tables) * rows + 1, rows),
                       torch.full((len(tables),), start + rows), torch.tensor(tables),
                       torch.tensor(slots), max_query_len=rows)


def time_forwards(streams_list, drafts_list, context: int, temperature: float,
                  repeats: int) -> dict[tuple[int, int], float]:
    """-> (B, d): median ms of the served forward of B requests at `context`, 1 + d rows each"""
    folder = paths.default_target_dir()
    width, most = 1 + max(drafts_list), max(streams_list)
    pages = most * ((context + width) // PAGE + 1)
    model = TargetModel(folder, dtype=torch_dtype("auto", target_dir=folder), num_pages=pages)
    pool, tables = PagePool(pages, PAGE), [[] for _ in range(most)]
    for table in tables:
        pool.grow(table, context + width)
    tokens = text_tokens(load_tokenizer(folder), context + width)
    model.hidden_states(chain_batch(tables, pool, tokens, 0, context))  # the contexts' KV
    cases = [(b, d) for b in streams_list for d in drafts_list]
    batches = {(b, d): chain_batch(tables[:b], pool, tokens, context, 1 + d) for b, d in cases}
    scored = {(b, d): (torch.arange(b * (1 + d)), row_sampling(b * (1 + d), temperature)) for b, d in cases}
    times: dict = {}
    for rep in range(repeats + 1):  # the first pass warms every shape up, untimed
        for b, d in cases:
            start = time.perf_counter()
            model.forward(batches[(b, d)], *scored[(b, d)])
            if rep:
                times.setdefault((b, d), []).append((time.perf_counter() - start) * 1e3)
    return {case: sorted(ts)[len(ts) // 2] for case, ts in times.items()}


def row_sampling(rows: int, temperature: float) -> RowSampling:
    """Every row at `temperature` (0: greedy), top-k and top-p off, a seed a row."""
    return RowSampling(torch.full((rows,), temperature), torch.zeros(rows, dtype=torch.int64),
                       torch.ones(rows), torch.arange(rows))


def ceilings(times: dict[tuple[int, int], float], acceptance=ACCEPTANCE,
             overheads=(0.0,), draft_ms: float = 0.0) -> list[Ceiling]:
    """The best speedup over plain decoding that chains kept at each acceptance can reach."""
    return [Ceiling(b, a, o, *reversed(bound(times, b, a, o, draft_ms)))
            for b in sorted({b for b, _ in times}) for o in overheads for a in acceptance]


def chain_speedup(times: dict[tuple[int, int], float], streams: int, drafts: int, a: float,
                  overhead: float, draft_ms: float = 0.0) -> float:
    """Tokens a round (1 + a + ... + a^d) over the round's cost (draft_ms more where it drafts),
    against plain decoding's."""
    tokens = sum(a ** i for i in range(drafts + 1))
    cost = times[(streams, drafts)] + overhead + (draft_ms if drafts else 0.0)
    return tokens * (times[(streams, 0)] + overhead) / cost


def bound(times: dict[tuple[int, int], float], streams: int, a: float, overhead: float,
          draft_ms: float = 0.0) -> tuple[float, int]:
    """-> (the best speedup chains kept with chance a reach at `streams`, the d reaching it)"""
    return max((chain_speedup(times, streams, d, a, overhead, draft_ms), d)
               for s, d in times if s == streams)


def needed_acceptance(times: dict[tuple[int, int], float], streams: int, speedup: float,
                      overhead: float, draft_ms: float = 0.0) -> float | None:
    """The least per-draft acceptance whose bound reaches `speedup` (None: not even a = 1)."""
    if bound(times, streams, 1.0, overhead, draft_ms)[0] < speedup:
        return None
    low, high = 0.0, 1.0  # the bound grows with a
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (low, mid) if bound(times, streams, mid, overhead, draft_ms)[0] >= speedup else (mid, high)
    return high


def plot(times, out_path: str, overhead: float, draft_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    streams = sorted({b for b, _ in times})
    fig, axes = plt.subplots(1, len(streams), figsize=(4 * len(streams), 3.6), sharey=True, squeeze=False)
    for ax, b in zip(axes[0], streams):
        drafts = sorted(d for s, d in times if s == b)
        for a in ACCEPTANCE:
            ax.plot(drafts, [chain_speedup(times, b, d, a, overhead, draft_ms) for d in drafts], marker="o",
                    label=f"a = {a}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{b} stream{'s' * (b > 1)}")
        ax.set_xlabel("drafts verified per request")
    axes[0][0].set_ylabel("speedup bound over plain decoding")
    axes[0][-1].legend()
    cost = f"drafts {draft_ms:g} ms a round" if draft_ms else "free drafts"
    fig.suptitle(f"Draft chains kept with chance a ({cost}, round overhead {overhead:g} ms)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--drafts", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--overhead-ms", type=float, nargs="+", default=[0.0, 3.0])
    parser.add_argument("--draft-ms", type=float, default=0.0,
                        help="what drafting costs a round that drafts (0: lookups; a drafter call: its ms)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--speedups", type=float, nargs="*", default=[],
                        help="also print the least acceptance each concurrency needs to reach these")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="a PNG of the bound by drafts (the last --overhead-ms)")
    args = parser.parse_args(argv)
    if 0 not in args.drafts:
        parser.error("--drafts must hold 0 (plain decoding, the base)")
    drafts = sorted(set(args.drafts))
    times = time_forwards(args.streams, drafts, args.context, args.temperature, args.repeats)
    print(f"forward ms (B requests x (1 + d) rows, context {args.context}, temperature {args.temperature:g})")
    print("B \\ d " + "".join(f"{d:>9d}" for d in drafts))
    for b in args.streams:
        print(f"{b:5d} " + "".join(f"{times[(b, d)]:9.1f}" for d in drafts))
    found = ceilings(times, overheads=args.overhead_ms, draft_ms=args.draft_ms)
    print("ceiling: streams, overhead ms, acceptance -> best speedup (drafts per request)")
    for c in found:
        print(f"  {c.streams} stream(s), o {c.overhead_ms:g} ms, a {c.acceptance:g}: {c.speedup:.2f}x (d {c.drafts})")
    needed = [{"streams": b, "overhead_ms": o, "speedup": x, "acceptance": needed_acceptance(times, b, x, o, args.draft_ms)}
              for x in args.speedups for b in args.streams for o in args.overhead_ms]
    for n in needed:
        a = n["acceptance"]
        print(f"  {n['speedup']:g}x at {n['streams']} stream(s), o {n['overhead_ms']:g} ms needs "
              + (f"a >= {a:.2f}" if a is not None else "more than every draft right"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"context": args.context, "temperature": args.temperature, "draft_ms": args.draft_ms,
                       "forward_ms": [{"streams": b, "drafts": d, "ms": t} for (b, d), t in times.items()],
                       "ceilings": [asdict(c) for c in found], "needed": needed}, f, indent=1)
    if args.plot:
        plot(times, args.plot, args.overhead_ms[-1], args.draft_ms)


if __name__ == "__main__":
    main()

"""Benchmark a running server against plain decoding and against Hugging Face `generate`.

    eagle-serve bench modes --prompts clients/prompts/heldout.jsonl --max-tokens 128 \\
        --modes vanilla,eagle,hf,hf-lookup --json out/bench.json --plot out/bench.png

Modes: `vanilla` = the server with num_speculative_tokens 0 (the baseline every speedup is
measured against); `eagle` = the server with its default k (or --k) and draft-tree shape (or
--draft-topk/--draft-depth; comma lists sweep every combination, one mode each, named e.g.
`eagle-topk4-depth3`); `hf` = transformers
`generate` (greedy unless --temperature) in this process on the same weights and dtype, with
the same chat template; `hf-lookup` = the same with prompt-lookup decoding.

tokens_per_s = generated tokens / wall time, prompts sent one after another; with
--concurrency the prompts are also sent by that many clients at once (aggregate tokens/s).
Per-position acceptance comes from the server's metrics (before/after deltas), so other
traffic on the server during a run skews it.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from eagle_serve import paths
from eagle_serve.client import grpc_generate, metrics
from eagle_serve.core.requests import acceptance_length

SERVER_MODES = ("vanilla", "eagle")
HF_MODES = ("hf", "hf-lookup")
POSITION_KEY = re.compile(r'^eagle_spec_decode_accepted_tokens_per_position_total\{position="(\d+)"\}$')


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True, help='JSONL, one {"prompt": "..."} per line')
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--modes", default="vanilla,eagle",
                   help="comma list of " + ",".join(SERVER_MODES + HF_MODES))
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--plot", help="PNG: tokens/s per mode, acceptance per position, concurrency")
    p.add_argument("--url", default="localhost:8001", help="gRPC host:port of the server")
    p.add_argument("--metrics-url",
                   help="host:port of the metrics endpoint (default: --url's host, port 8002)")
    p.add_argument("--concurrency", help="comma list of client counts, e.g. 1,4,8")
    p.add_argument("--temperature", type=float, help="sample at this temperature (default greedy)")
    p.add_argument("--k", type=int, help="num_speculative_tokens of eagle mode (default: the "
                   "server's); with draft trees, the nodes verified per round")
    p.add_argument("--draft-topk", help="eagle mode: children per draft-tree node, a comma list "
                   "sweeps (1 = chain; default: the server's)")
    p.add_argument("--draft-depth", help="eagle mode: draft-tree depth, a comma list sweeps "
                   "(default: the server's)")
    p.add_argument("--target", default=str(paths.default_target_dir()), help="HF folder for hf modes")
    p.add_argument("--dtype", default="auto", help="hf modes: float32|float64|bfloat16|float16|auto "
                   "(auto = what the server runs for this target, models.checkpoints.torch_dtype)")
    p.add_argument("--prompt-lookup-tokens", type=int, default=10,
                   help="hf-lookup: prompt_lookup_num_tokens")
    p.add_argument("--warmup", type=int, default=1, help="untimed requests per mode first")
    args = p.parse_args(argv)
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = set(args.modes) - set(SERVER_MODES + HF_MODES)
    if unknown or not args.modes:
        p.error(f"unknown modes {sorted(unknown)}; choose from {SERVER_MODES + HF_MODES}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")] if args.concurrency else []
    args.variants = eagle_variants(args.draft_topk, args.draft_depth)
    if "eagle" in args.modes:
        at = args.modes.index("eagle")
        args.modes[at:at + 1] = list(args.variants)
    args.url = args.url.split("://", 1)[-1].rstrip("/")
    args.metrics_url = args.metrics_url or f"{args.url.rsplit(':', 1)[0]}:8002"
    return args


def eagle_variants(topks: str | None, depths: str | None) -> dict[str, dict]:
    """Eagle modes -> their tree parameters: one `eagle` mode, or one per (topk, depth) pair."""
    parse = lambda text: [int(x) for x in text.split(",")] if text else [None]  # noqa: E731
    pairs = [(t, d) for t in parse(topks) for d in parse(depths)]
    if len(pairs) == 1:
        return {"eagle": {"draft_topk": pairs[0][0], "draft_depth": pairs[0][1]}}
    name = lambda t, d: "eagle" + (f"-topk{t}" if t else "") + (f"-depth{d}" if d else "")  # noqa: E731
    return {name(t, d): {"draft_topk": t, "draft_depth": d} for t, d in pairs}


def is_eagle(mode: str) -> bool:
    return mode == "eagle" or mode.startswith("eagle-")


@dataclass
class Run:
    """Requests of one mode at one concurrency."""
    outputs: list[list[int]]
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    counters: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    def report(self) -> dict:
        drafts, rounds = self.counters.get("num_draft_tokens", 0), self.counters.get("num_rounds", 0)
        accepted = self.counters.get("num_accepted_tokens", 0)
        out = {"tokens_per_s": self.num_tokens / self.wall_s,
               "acceptance_length": acceptance_length(accepted, rounds) if drafts else None,
               "num_requests": len(self.outputs), "num_output_tokens": self.num_tokens,
               "wall_s": self.wall_s}
        if self.ttft_s:
            out["ttft_ms"], out["tpot_ms"] = percentiles(self.ttft_s), percentiles(self.tpot_s)
        return out


def percentiles(seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        return {"p50": None, "p90": None, "p99": None}
    ms = np.asarray(seconds) * 1000.0
    return {f"p{q}": float(np.percentile(ms, q)) for q in (50, 90, 99)}


# ---- server modes ----

def server_params(mode: str, args: argparse.Namespace) -> dict:
    if mode == "vanilla":
        return dict(max_tokens=args.max_tokens, num_speculative_tokens=0, stream=True,
                    temperature=args.temperature)
    return dict(max_tokens=args.max_tokens, num_speculative_tokens=args.k, stream=True,
                temperature=args.temperature, **args.variants[mode])


def run_server(args, mode: str, prompts: list[str], concurrency: int) -> Run:
    """Every prompt once (cycled to at least `concurrency` requests), `concurrency` at a time."""
    params = server_params(mode, args)
    prompts = [prompts[i % len(prompts)] for i in range(max(len(prompts), concurrency))]
    seeds = range(len(prompts)) if args.temperature else [None] * len(prompts)
    bar = tqdm(total=len(prompts), desc=f"{mode} x{concurrency}", unit="req", leave=False)

    def one(i: int):
        gen = check(grpc_generate(args.url, prompts[i], seed=seeds[i], **params), mode)
        bar.update()
        return gen
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        gens = list(pool.map(one, range(len(prompts))))
    wall_s = time.perf_counter() - started
    bar.close()
    run = Run([g.output_ids for g in gens], wall_s)
    for g in gens:
        if g.ttft_s is not None:
            run.ttft_s.append(g.ttft_s)
        if len(g.output_ids) > 1:
            run.tpot_s.append((g.latency_s - g.ttft_s) / (len(g.output_ids) - 1))
        for name, value in g.counters.items():
            run.counters[name] = run.counters.get(name, 0) + value
    return run


def warm_up(args, mode: str, prompt: str) -> None:
    for _ in range(args.warmup):
        check(grpc_generate(args.url, prompt, **{**server_params(mode, args), "max_tokens": 8}), mode)


def check(gen, mode: str):
    if gen.error is not None:
        raise SystemExit(f"bench: {mode} request failed: {gen.error}")
    return gen


def read_metrics(url: str) -> dict[str, float] | None:
    try:
        return metrics(url)
    except OSError as error:
        print(f"bench: no metrics from {url} ({error}); per-position acceptance left out",
              file=sys.stderr)
        return None


def position_acceptance(url: str, before: dict | None, run: Run, k: int | None) -> list[float] | None:
    """Accepted drafts at position (tree depth) j per verify round (j = 1..k), from metric
    deltas; the sum plus one is the acceptance length. Waits briefly for the engine to publish
    its last round."""
    if before is None:
        return None
    rounds_key = "eagle_spec_decode_rounds_total"
    deadline = time.monotonic() + 3.0
    while True:
        after = read_metrics(url)
        if after is None:
            return None
        rounds = after.get(rounds_key, 0.0) - before.get(rounds_key, 0.0)
        if rounds >= run.counters.get("num_rounds", 0) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    per_position = {}
    for key, value in after.items():
        if m := POSITION_KEY.match(key):
            per_position[int(m.group(1))] = (value - before.get(key, 0.0)) / rounds if rounds else 0.0
    drafts, client_rounds = run.counters.get("num_draft_tokens", 0), run.counters.get("num_rounds", 0)
    if k is None:  # the server's default: the mean drafts per round, rounded up
        k = math.ceil(drafts / client_rounds) if client_rounds else 0
    return [per_position.get(j, 0.0) for j in range(1, k + 1)]


# ---- Hugging Face modes ----

class HFRunner:
    """transformers `generate` on the target folder, the server's chat template and EOS ids."""

    def __init__(self, folder: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        from eagle_serve.core.tokenization import eos_token_ids, load_tokenizer
        from eagle_serve.models.dtypes import torch_dtype

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = torch_dtype(dtype, self.device == "cuda", Path(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        self.model = model.to(self.device).eval()
        self.tokenizer = load_tokenizer(folder)
        self.eos = list(eos_token_ids(folder))

    def config(self, max_tokens: int, temperature: float | None, lookup: int | None):
        from transformers import GenerationConfig

        sample = bool(temperature)
        return GenerationConfig(max_new_tokens=max_tokens, do_sample=sample,
                                temperature=temperature if sample else None,
                                top_k=0 if sample else None, top_p=1.0 if sample else None,
                                eos_token_id=self.eos or None,
                                pad_token_id=self.eos[0] if self.eos else None,
                                prompt_lookup_num_tokens=lookup)

    def generate(self, prompt: str, config, seed: int | None = None) -> list[int]:
        from eagle_serve.core.tokenization import encode_prompt

        torch = self.torch
        ids = torch.tensor([encode_prompt(self.tokenizer, prompt)], device=self.device)
        if seed is not None:
            torch.manual_seed(seed)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        if self.device == "cuda":
            torch.cuda.synchronize()
        return out[0, ids.shape[1]:].tolist()


def run_hf(runner: HFRunner, args, mode: str, prompts: list[str]) -> Run:
    lookup = args.prompt_lookup_tokens if mode == "hf-lookup" else None
    config = runner.config(args.max_tokens, args.temperature, lookup)
    for _ in range(args.warmup):
        runner.generate(prompts[0], runner.config(8, args.temperature, lookup))
    outputs, started = [], time.perf_counter()
    for i, prompt in enumerate(tqdm(prompts, desc=mode, unit="req", leave=False)):
        outputs.append(runner.generate(prompt, config, seed=i if args.temperature else None))
    return Run(outputs, time.perf_counter() - started)


# ---- report ----

def bench(args, prompts: list[str]) -> dict:
    modes, runner = {}, None
    for mode in args.modes:
        if mode in SERVER_MODES or is_eagle(mode):
            warm_up(args, mode, prompts[0])
            before = read_metrics(args.metrics_url) if is_eagle(mode) else None
            run = run_server(args, mode, prompts, 1)
            report = {**run.report(), "outputs": run.outputs}
            if is_eagle(mode):
                report.update({k: v for k, v in args.variants[mode].items() if v is not None})
                report["accepted_per_round_by_position"] = position_acceptance(
                    args.metrics_url, before, run, args.variants[mode]["draft_depth"] or args.k)
                if report["acceptance_length"] is None:
                    print("bench: eagle mode drafted nothing (the server's default k is 0?): "
                          "pass --k", file=sys.stderr)
            if args.concurrency:
                report["by_concurrency"] = {
                    str(c): report_without_outputs(report) if c == 1
                    else run_server(args, mode, prompts, c).report() for c in args.concurrency}
        else:
            runner = runner or HFRunner(args.target, args.dtype)
            run = run_hf(runner, args, mode, prompts)
            report = {**run.report(), "outputs": run.outputs}
        modes[mode] = report
    return {"modes": modes, "settings": settings(args, prompts)}


def report_without_outputs(report: dict) -> dict:
    return {k: v for k, v in report.items()
            if k not in ("outputs", "accepted_per_round_by_position", "by_concurrency")}


def settings(args, prompts: list[str]) -> dict:
    return {"prompts": args.prompts, "num_prompts": len(prompts), "max_tokens": args.max_tokens,
            "temperature": args.temperature, "k": args.k, "draft_topk": args.draft_topk,
            "draft_depth": args.draft_depth, "url": args.url,
            "target": args.target if any(m in HF_MODES for m in args.modes) else None,
            "dtype": args.dtype, "concurrency": args.concurrency}


def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(result: dict) -> str:
    modes = result["modes"]
    base = modes.get("vanilla", {}).get("tokens_per_s")
    w = max([10] + [len(name) + 4 for name in modes])
    rows = [f"{'mode':{w}s} {'tokens/s':>9s} {'speedup':>8s} {'accept':>7s} {'TTFT p50':>9s} "
            f"{'TPOT p50':>9s}  (ms)"]
    for name, m in modes.items():
        speedup = m["tokens_per_s"] / base if base else None
        rows.append(f"{name:{w}s} {m['tokens_per_s']:9.1f} {fmt(speedup, '.2f'):>8s} "
                    f"{fmt(m['acceptance_length'], '.2f'):>7s} "
                    f"{fmt(m.get('ttft_ms', {}).get('p50')):>9s} "
                    f"{fmt(m.get('tpot_ms', {}).get('p50')):>9s}")
    for name, m in modes.items():
        for c, r in m.get("by_concurrency", {}).items():
            rows.append(f"{name + ' x' + c:{w}s} {r['tokens_per_s']:9.1f} {'':>8s} "
                        f"{fmt(r['acceptance_length'], '.2f'):>7s} "
                        f"{fmt(r['ttft_ms']['p50']):>9s} {fmt(r['tpot_ms']['p50']):>9s}")
    return "\n".join(rows)


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    eagle = next((name for name in modes if is_eagle(name)), None)
    positions = (modes.get(eagle) or {}).get("accepted_per_round_by_position")
    concurrent = {n: m["by_concurrency"] for n, m in modes.items() if m.get("by_concurrency")}
    panels = 1 + bool(positions) + bool(concurrent)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4), squeeze=False)
    axes = list(axes[0])
    ax = axes.pop(0)
    ax.bar(list(modes), [m["tokens_per_s"] for m in modes.values()], color="tab:blue")
    ax.set(title="tokens/s (concurrency 1)", ylabel="generated tokens / s")
    if positions:
        ax = axes.pop(0)
        ax.bar(range(1, len(positions) + 1), positions, color="tab:green")
        ax.set_xticks(range(1, len(positions) + 1))
        length = modes[eagle]["acceptance_length"]
        ax.set(title=f"{eagle}: accepted per round by draft position (AL {fmt(length, '.2f')})",
               xlabel="draft position (tree depth)", ylabel="P(accepted)", ylim=(0, 1))
        ax.title.set_fontsize(9)
    if concurrent:
        ax = axes.pop(0)
        for name, by_c in concurrent.items():
            cs = sorted(by_c, key=int)
            ax.plot([int(c) for c in cs], [by_c[c]["tokens_per_s"] for c in cs], marker="o", label=name)
            ax.set_xticks([int(c) for c in cs])
        ax.set(title="aggregate tokens/s by concurrency", xlabel="concurrent clients",
               ylabel="tokens / s")
        ax.legend()
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    prompts = paths.read_prompts(args.prompts)
    if not prompts:
        raise SystemExit(f"bench: no prompts in {args.prompts}")
    result = bench(args, prompts)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())

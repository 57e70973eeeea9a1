"""Drafters compared in process: each prompt (or each group of --concurrency prompts, run as one
batch) through plain decoding and the default draft policy with each drafter folder (a head,
and its corpus-index.npz if it has one) in turn, greedy (or --temperature T: sampled, each
prompt with its own seed, so under the shipped coupled verification every config's output must
still be plain sampling's; `--policy sampled_verify=rejection` configs draw other tokens).

    eagle-serve bench engine --prompts clients/prompts/heldout.jsonl --max-tokens 128 \\
        --drafters drafters/eagle3-SmolLM2-135M-Instruct OTHER_FOLDER [--concurrency 4] [--every-logit] \\
        [--kernels-from REV] [--fma-kernels] [--policy max_draft_batch=0 [lookup_tokens=8 ...]] \\
        [--temperature 0.7]

Every drafter runs on its own engine over the same target in this process, one group at a time
through every config (reversed every other group), so drift hits all alike; the speedups are
against plain decoding in the same run. In process a drafter call costs less than through
Triton (no BLS hop), so the policy may draft more here than a server does: use this to compare
drafters, speedup_matrix.py for serving.
--every-logit adds plain decoding and the first drafter on the same engine with its greedy
tokens from every logit of the LM head instead of the screened few (eagle_serve.cpu.argmax):
the same tokens, the screen's gain.
--kernels-from REV adds plain decoding and the first drafter on the same engine with the layers
(the decoder stack, eagle_serve.models.cpu_stack) run by git revision REV's C++ kernels: a kernel
change's gain on whole requests, where eagle-serve bench forward times single forwards.
--fma-kernels adds plain decoding and the first drafter on a second engine whose target runs
its Q4_1 linears on cpu.cpp's FMA kernels instead of AMX tiles (on CPUs with them,
eagle_serve/kernels/cpu_amx.cpp); its outputs are compared with its own plain decoding's.
--policy NAME=VALUE ... adds, for each, the first drafter on the same engine with that draft
policy setting (an EngineConfig field the draft policy reads, eagle_serve.spec.policy) instead of
the default's: a policy change's gain on whole requests, beside the default in the same run.
--kv-cache-gib G sizes each engine's target KV cache (default: the served size, zeroed at load).
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from eagle_serve import paths
from eagle_serve.bench.forward import kernels_at
from eagle_serve.core.requests import SamplingParams, acceptance_length
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.cpu.argmax import ScreenedArgmax
from eagle_serve.engine import Engine
from eagle_serve.kernels.cpu import without_amx_tiles
from eagle_serve.local import build_local_engine
from eagle_serve.models import cpu_stack
from eagle_serve.settings import CacheSettings, EngineConfig, ServingSettings, setting_sections


@dataclass(frozen=True)
class Config:
    """One column of the comparison: an engine, its k (0: plain decoding, None: its default),
    its LM-head screen (None: every logit), the kernels its layers run on, the config whose
    outputs its own must equal (plain decoding on the same target arithmetic) and the settings
    its draft policy reads (None: the engine's own)."""
    name: str
    engine: Engine
    k: int | None
    screen: ScreenedArgmax | None
    kernels: Callable
    baseline: str = "plain"
    policy: EngineConfig | None = None

    def generate(self, group: list[list[int]], max_tokens: int, temperature: float = 0.0,
                 seeds: list[int] | None = None):
        """seeds: one per prompt (sampled requests)"""
        self.engine.target.screen = self.screen
        cpu_stack.cpu_kernels = self.kernels
        self.engine.policy.config = self.policy or self.engine.config
        return self.engine.generate(group, [
            SamplingParams(max_tokens=max_tokens, num_speculative_tokens=self.k, temperature=temperature,
                           seed=seed) for seed in seeds or [None] * len(group)])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--drafters", nargs="+", required=True, help="drafter folders")
    p.add_argument("--target", default="default")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=1, help="prompts run together as one batch")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--kv-cache-gib", type=float, default=CacheSettings.kv_cache_gib,
                   help="each engine's target KV cache (the served size by default)")
    p.add_argument("--every-logit", action="store_true",
                   help="also plain decoding and the first drafter with every logit computed")
    p.add_argument("--kernels-from", metavar="REV",
                   help="also plain decoding and the first drafter on REV's layer kernels")
    p.add_argument("--fma-kernels", action="store_true",
                   help="also plain decoding and the first drafter with the target's Q4_1 linears "
                        "on the FMA kernels, not AMX tiles")
    p.add_argument("--policy", nargs="+", default=[], metavar="NAME=VALUE",
                   help="also the first drafter with each of these draft policy settings")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample at this temperature (prompt i with seed i) instead of greedy")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    for setting in args.policy:  # refused before any model loads
        policy_setting(EngineConfig.served(), setting)
    target = paths.resolve_model_path(args.target)
    engines = {d: build_local_engine(target, d, kv_cache_gib=args.kv_cache_gib) for d in args.drafters}
    first = next(iter(engines.values()))
    this_tree = cpu_stack.cpu_kernels
    configs = [Config("plain", first, 0, first.target.screen, this_tree)]
    configs += [Config(d, e, None, e.target.screen, this_tree) for d, e in engines.items()]
    same_engine = [("plain", 0), (args.drafters[0], None)]
    if args.every_logit:  # the same engine with its screen off: no difference but the screen
        configs += [Config(f"{n}, every logit", first, k, None, this_tree) for n, k in same_engine]
    if args.kernels_from:  # the same engine, its layers on another revision's kernels
        other = kernels_at(args.kernels_from)
        configs += [Config(f"{n}, kernels of {args.kernels_from}", first, k, first.target.screen,
                           lambda: other) for n, k in same_engine]
    for setting in args.policy:  # the same engine, its draft policy set otherwise
        configs.append(Config(f"{args.drafters[0]}, {setting}", first, None, first.target.screen,
                              this_tree, policy=policy_setting(first.config, setting)))
    if args.fma_kernels:  # another engine: the kernels are chosen as the target loads
        with without_amx_tiles():
            fma = build_local_engine(target, args.drafters[0], kv_cache_gib=args.kv_cache_gib)
        configs += [Config(f"{n}, FMA kernels", fma, k, fma.target.screen, this_tree, "plain, FMA kernels")
                    for n, k in same_engine]
    prompts = [encode_prompt(first.tokenizer, text) for text in paths.read_prompts(args.prompts)]
    for c in configs:  # warm-up, untimed
        c.generate([prompts[0]], 8)
    totals = {c.name: {"s": 0.0, "tokens": 0, "rounds": 0, "accepted": 0, "same": 0} for c in configs}
    groups = [prompts[i:i + args.concurrency] for i in range(0, len(prompts), args.concurrency)]
    for i, group in enumerate(tqdm(groups, desc="prompt groups x configs", unit="group")):
        outputs = {}
        seeds = list(range(i * args.concurrency, i * args.concurrency + len(group)))
        for c in configs if i % 2 == 0 else configs[::-1]:  # drift hits all alike
            start = time.perf_counter()
            outs = c.generate(group, args.max_tokens, args.temperature, seeds)
            t = totals[c.name]
            t["s"] += time.perf_counter() - start
            t["tokens"] += sum(len(out.token_ids) for out in outs)
            t["rounds"] += sum(out.last.num_rounds for out in outs)
            t["accepted"] += sum(out.last.num_accepted_tokens for out in outs)
            outputs[c.name] = [out.token_ids for out in outs]
        for c in configs:
            totals[c.name]["same"] += sum(a == b for a, b in zip(outputs[c.name], outputs[c.baseline]))
    base = totals["plain"]["tokens"] / totals["plain"]["s"]
    for name, t in totals.items():
        speed = t["tokens"] / t["s"]
        print(f"{name}: {speed:.1f} tokens/s  {speed / base:.2f}x plain  "
              f"tau {acceptance_length(t['accepted'], t['rounds']):.2f}  "
              f"output = its plain decoding's {t['same']}/{len(prompts)}")


def policy_setting(config: EngineConfig, setting: str) -> EngineConfig:
    """`config` with one setting set from "NAME=VALUE" (as a spec_decode parameter), validated."""
    name, _, value = setting.partition("=")
    section = setting_sections(EngineConfig).get(name)
    if section is None or not value:
        raise SystemExit(f"--policy {setting!r}: expected NAME=VALUE with NAME a setting the engine uses")
    try:  # parsed as the server parses its spec_decode parameters
        parsed = getattr(getattr(ServingSettings.from_parameters({name: value}), section), name)
        changed = config.with_values(**{name: parsed})
    except ValueError as e:
        raise SystemExit(f"--policy {setting!r}: {e}") from None
    return changed


if __name__ == "__main__":
    main()

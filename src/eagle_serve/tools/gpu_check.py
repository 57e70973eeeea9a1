"""`make gpu-check`: run once on a GPU machine (or in the container) to see the GPU path work.

    python -m eagle_serve.tools.gpu_check [--target DIR] [--drafter DIR|none] [--dtype auto]
                                    [--num-prompts 5] [--max-tokens 64] [--require-identical]

1. kernels: every variant the served models launch is compiled (kernels.warmup), timed;
2. each kernel against its PyTorch reference on the device, at the served model's shapes
   (exact where the kernel is exact, a float tolerance for attention and probabilities);
3. row invariance, measured: one query's attention alone vs inside a larger batch (another
   tile), and one row of a linear layer alone vs among k + 1 rows: greedy speculative output
   equals plain decoding bitwise only where the target's forward is row-invariant;
4. the in-process engine on the first prompts of clients/prompts/heldout.jsonl: plain
   decoding (k = 0) vs the settings of spec_decode/configs/gpu.pbtxt, each prompt (or group of
   4) through both in turn, the order reversed every other group, for greedy requests alone,
   seeded temperature-0.7 requests alone and greedy requests 4 at a time: tokens/s of each,
   the speedup, tau and whether the outputs are identical (greedy, and coupled sampling:
   plain seeded sampling's tokens whatever is drafted);
5. how many kernels compiled during step 4 (0: the warm-up covered every launch);
6. plain greedy decoding on the three forward paths, prompt by prompt in turn: the PyTorch
   layers, the fused layer kernels (eagle_serve.kernels.layer_ops), and those replayed as CUDA
   graphs (models.graphs): tokens/s, the kernels one decode forward launches, and whether the
   outputs agree;
7. the whole forward's row invariance: a prompt's last token decoded alone vs as the first of
   2-64 verify rows: the largest logit difference, and the top two logits where the argmax
   parts.

8. through Triton (eagle_serve.tools.gpu_server): the real tritonserver serving the same
   models (configs/gpu.pbtxt on a GPU, CPU instances elsewhere), plain decoding against the
   default through gRPC for the cases of step 4 (skip with --no-server; --url HOST:PORT checks
   a server already running instead, e.g. the compose one).

`--out DIR` writes the results as gpu_check.json and a plot, gpu_check.png.

Without a GPU it says so and runs the same checks on CPU: the kernels through Triton's
interpreter, the engine on the CPU. Exit status 1 when a kernel disagrees with its reference,
or with --require-identical when an output differs (see docs/gpu.md for what holds where).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:  # before anything imports triton: its kernels then run on CPU tensors
    os.environ.setdefault("TRITON_INTERPRET", "1")

from eagle_serve import paths  # noqa: E402
from eagle_serve.core.requests import SamplingParams, acceptance_length  # noqa: E402
from eagle_serve.core.tokenization import encode_prompt, eos_token_ids, load_tokenizer  # noqa: E402
from eagle_serve.kernels import attention_ref, warmup  # noqa: E402
from eagle_serve.kernels import layer_ops as lo  # noqa: E402
from eagle_serve.kernels import paged_attention as pa
from eagle_serve.kernels import rejection as rj
from eagle_serve.kernels import sampling as sm  # noqa: E402
from eagle_serve.kernels import workspace as ws
from eagle_serve.local import build_local_engine  # noqa: E402
from eagle_serve.models.dtypes import torch_dtype  # noqa: E402
from eagle_serve.settings import EngineConfig, ServingSettings  # noqa: E402
from eagle_serve.tools.gpu_forward import forward_invariance, path_comparison  # noqa: E402
from eagle_serve.tools.gpu_server import CASES, through_server, through_triton  # noqa: E402

GPU_CONFIG = paths.REPO_ROOT / "model_repository" / "spec_decode" / "configs" / "gpu.pbtxt"
KERNELS = (lo._add_rms_norm_kernel, lo._rope_write_kv_kernel, lo._silu_mul_kernel, pa._paged_attention_kernel,
           sm._probs_kernel, sm._sample_kernel,
           rj._greedy_accept_kernel, rj._recover_kernel, rj._random_accept_kernel,
           ws._scatter_rows_kernel, ws._gather_rows_kernel)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def gpu_settings() -> ServingSettings:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(GPU_CONFIG.read_text(), model_config_pb2.ModelConfig())
    return ServingSettings.from_parameters({k: v.string_value for k, v in config.parameters.items()})


def compiled_count(device: torch.device) -> int | None:
    """Kernel binaries in Triton's in-process caches (None under the interpreter)."""
    if device.type != "cuda":
        return None
    return sum(len(k.device_caches[device.index or 0][0]) for k in KERNELS)


def attention_batch(q_heads: int, kv_heads: int, head_dim: int, dtype, device, gen):
    """A decode request, a verify request of 4 and a 3-node draft tree over a shuffled cache."""
    page, lens = 16, [37, 70, 21]  # new tokens: 1, 4 and 3 (cu below)
    pages = [-(-n // page) for n in lens]
    k_cache = torch.randn(sum(pages) + 2, page, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(sum(pages) + 2, page, kv_heads, head_dim, generator=gen).to(device, dtype)
    order = torch.randperm(sum(pages) + 2, generator=gen)
    tables, start = torch.full((3, max(pages)), -1, dtype=torch.int64), 0
    for b, count in enumerate(pages):
        tables[b, :count], start = order[start:start + count], start + count
    cu = torch.tensor([0, 1, 5, 8])
    q = torch.randn(8, q_heads, head_dim, generator=gen).to(device, dtype)
    tree = torch.ones(3, 4, 4, dtype=torch.bool).tril()
    tree[2, 2, 1] = False  # node 2 is a sibling of node 1
    to = lambda t: t.to(device)  # noqa: E731
    return q, k_cache, v_cache, to(tables), to(cu), to(torch.tensor(lens)), to(tree)


def kernel_checks(q_heads, kv_heads, head_dim, hidden, intermediate, vocab, dtype,
                  device) -> dict[str, str | None]:
    """{check: None if it passed, else what differed}."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    out: dict[str, str | None] = {}

    def exact(name, got, want):
        same = all(torch.equal(g, w) for g, w in zip(got, want))
        out[name] = None if same else "differs from the reference"

    def close(name, got, want, tol):
        err = (got.float() - want.float()).abs().max().item()
        out[name] = None if err <= tol else f"max |error| {err:.3g} > {tol}"

    q, k_cache, v_cache, tables, cu, lens, tree = attention_batch(q_heads, kv_heads, head_dim,
                                                                  dtype, device, gen)
    # q, k, v as the target passes them: views of its fused q/k/v projection
    widths = [q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qn, kn, vn = (t.view(7, -1, head_dim) for t in rand(7, sum(widths)).to(dtype).split(widths, -1))
    cos, sin = rand(7, head_dim).to(dtype), rand(7, head_dim).to(dtype)
    slots = torch.tensor([5, -1, 40, 41, 3, -1, 17], device=device)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    exact("rope_write_kv", [lo.rope_write_kv_triton(qn, kn, vn, cos, sin, *caches[0], slots), *caches[0]],
          [lo.rope_write_kv_ref(qn, kn, vn, cos, sin, *caches[1], slots), *caches[1]])
    x, r, w = rand(5, hidden).to(dtype), rand(5, hidden).to(dtype), rand(hidden).to(dtype)
    (normed, total), (normed_ref, total_ref) = lo.add_rms_norm_triton(x, r, w, 1e-5), lo.add_rms_norm_ref(x, r, w, 1e-5)
    exact("add_rms_norm: the sum", [total], [total_ref])
    close("add_rms_norm", normed, normed_ref, TOLERANCE[dtype])
    gate_up = rand(5, 2 * intermediate).to(dtype)
    close("silu_mul", lo.silu_mul_triton(gate_up), lo.silu_mul_ref(gate_up), TOLERANCE[dtype])
    scale = head_dim ** -0.5
    for mask in (None, tree):
        got = pa.paged_attention_triton(q, k_cache, v_cache, tables, cu, lens, scale, mask)
        want = attention_ref.paged_attention_ref(q.float(), k_cache.float(), v_cache.float(), tables,
                                                 cu, lens, scale, mask)
        close("paged_attention" + (" (tree)" if mask is not None else ""), got, want,
              TOLERANCE[dtype])
    # top-p keeps ties differently from the reference's sort: float32 logits have none; the
    # served dtype's logits are checked with top-k only (ties kept alike)
    temp, top_k = torch.tensor([0.7, 1.0, 1.3, 1.0], device=device), torch.tensor([0, 50, 0, 7], device=device)
    for logits, top_p, name in [(rand(4, vocab) * 4, [1.0, 1.0, 0.9, 0.8], "compute_probs"),
                                ((rand(4, vocab) * 4).to(dtype), [1.0] * 4,
                                 f"compute_probs ({str(dtype).removeprefix('torch.')}, top-k)")]:
        top_p = torch.tensor(top_p, device=device)
        close(name, sm.compute_probs_triton(logits, temp, top_k, top_p),
              sm.compute_probs_ref(logits, temp, top_k, top_p), 1e-5)
    hot = torch.tensor([3, vocab - 1, 0], device=device)
    one_hot = torch.nn.functional.one_hot(hot, vocab).float()
    exact("sample (one-hot)", [sm.sample_triton(one_hot, [1, 2, 3], [0, 5, 9], sm.SAMPLE)], [hot])
    drafts, cu_d = torch.tensor([3, 8, 8, 1, 2], device=device), torch.tensor([0, 3, 3, 5], device=device)
    argmax = torch.tensor([3, 8, 9, 4, 6, 1, 7, 7], device=device)
    exact("greedy_accept", rj.greedy_accept_triton(drafts, cu_d, argmax),
          [t.to(device) for t in rj.greedy_accept_ref(drafts.cpu(), cu_d.cpu(), argmax.cpu())])
    p = torch.nn.functional.one_hot(torch.tensor([3, 8, 5, 4, 2, 6, 7, 9]), vocab).float().to(device)
    qd = torch.nn.functional.one_hot(drafts.cpu(), vocab).float().to(device)
    seeds, positions = [1, 2, 3], [10, 20, 30]
    exact("random_accept (forced)", rj.random_accept_triton(drafts, cu_d, p, qd, seeds, positions),
          [t.to(device) for t in rj.random_accept_ref(drafts.cpu(), cu_d.cpu(), p.cpu(), qd.cpu(),
                                                      seeds, positions)])
    store, rows = rand(40, vocab), rand(3, vocab)
    slots = torch.tensor([7, 0, 39], device=device)
    stores = [store.clone(), store.clone()]
    ws.scatter_rows_triton(stores[0], slots, rows)
    ws.scatter_rows_ref(stores[1], slots, rows)
    exact("scatter_rows / gather_rows", [stores[0], ws.gather_rows_triton(stores[0], slots)],
          [stores[1], ws.gather_rows_ref(stores[1], slots)])
    return out


def row_invariance(q_heads, kv_heads, head_dim, hidden, dtype, device) -> dict[str, float]:
    """Max |difference| of one row computed alone vs within a larger batch (0: bitwise equal)."""
    gen = torch.Generator().manual_seed(1)
    q, k_cache, v_cache, tables, cu, lens, _ = attention_batch(q_heads, kv_heads, head_dim,
                                                               dtype, device, gen)
    scale = head_dim ** -0.5
    alone = pa.paged_attention_triton(q[:1], k_cache, v_cache, tables[:1], cu[:2], lens[:1], scale)
    wide = torch.tensor([0, 1, 21], device=device)  # the same decode query next to 20 queries
    other = torch.randn(20, q_heads, head_dim, generator=gen).to(device, dtype)
    batched = pa.paged_attention_triton(torch.cat([q[:1], other]), k_cache, v_cache, tables[:2],
                                        wide, torch.tensor([37, 70], device=device), scale)
    linear = torch.nn.Linear(hidden, 4 * hidden, bias=False).to(device, dtype)
    x = torch.randn(9, hidden, generator=gen).to(device, dtype)
    with torch.inference_mode():
        one, nine = linear(x[:1]), linear(x)[:1]
    diff = lambda a, b: (a.float() - b.float()).abs().max().item()  # noqa: E731
    return {"attention: 1 query alone vs beside 20 (another tile)": diff(alone[0], batched[0]),
            "linear: 1 row alone vs among 9 rows": diff(one, nine)}


@dataclass
class Comparison:
    """One case of step 4: plain decoding against the default over the same prompts."""
    plain: float = 0.0     # tokens/s
    default: float = 0.0   # tokens/s
    tau: float = 0.0       # the default's tokens per verify round
    same: int = 0          # outputs equal to plain decoding's
    exact: bool = True     # whether they must be (greedy, coupled sampling)


def engine_comparison(engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Comparison]:
    """Per case of CASES: each group of prompts through plain decoding and the default in turn
    (reversed every other group, so drift hits both alike)."""
    results = {}
    for case, temperature, concurrency in CASES:
        groups = [prompts[i:i + concurrency] for i in range(0, len(prompts), concurrency)]
        sampled = dict(temperature=temperature, ignore_eos=True) if temperature else {}
        params = [[SamplingParams(max_tokens=max_tokens, num_speculative_tokens=k,
                                  **(sampled | {"seed": 1000 + i} if sampled else {}))
                   for k in (0, None)] for i in range(len(groups))]  # [group][plain, default]
        for p in params[0]:  # untimed: first-call costs
            engine.generate(groups[0], p)
        seconds, tokens, outputs = [0.0, 0.0], [0, 0], [[], []]
        rounds = accepted = 0
        for i, group in enumerate(groups):
            for m in (0, 1) if i % 2 == 0 else (1, 0):
                start = time.perf_counter()
                done = engine.generate(group, params[i][m])
                seconds[m] += time.perf_counter() - start
                tokens[m] += sum(len(out.token_ids) for out in done)
                outputs[m] += [out.token_ids for out in done]
                if m:
                    rounds += sum(out.last.num_rounds for out in done)
                    accepted += sum(out.last.num_accepted_tokens for out in done)
        results[case] = Comparison(
            plain=tokens[0] / seconds[0], default=tokens[1] / seconds[1],
            tau=acceptance_length(accepted, rounds), same=sum(a == b for a, b in zip(*outputs)),
            exact=not temperature or engine.policy.coupled(params[0][1]))
    return results


def write_results(folder: Path, results: dict) -> None:
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu_check.json").write_text(json.dumps(results, indent=1))
    panels = [("in process", results["engine"])] + (
        [("through Triton", results["through_triton"])] if results.get("through_triton") else [])
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(6 * (1 + len(panels)), 4))
    paths_ = results["forward_paths"]
    axes[0].bar(list(paths_), [v["tokens_per_s"] for v in paths_.values()], color="tab:blue")
    axes[0].set_ylabel("tokens/s, plain greedy decoding")
    axes[0].set_title(f"forward paths ({results['device']}, {results['dtype']})", fontsize=9)
    for ax, (where, cases) in zip(axes[1:], panels):
        x = range(len(cases))
        ax.bar([i - 0.2 for i in x], [c["plain"] for c in cases.values()], 0.4, label="k = 0")
        ax.bar([i + 0.2 for i in x], [c["default"] for c in cases.values()], 0.4, label="default")
        ax.set_xticks(list(x), list(cases), fontsize=8)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"plain decoding vs the default (speculative), {where}", fontsize=9)
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "gpu_check.png", dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=str(paths.default_target_dir()))
    parser.add_argument("--drafter", default=str(paths.default_drafter_dir()), help="or none")
    parser.add_argument("--dtype", default="auto", help="auto = bfloat16 on a GPU, as served")
    parser.add_argument("--num-prompts", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--require-identical", action="store_true")
    parser.add_argument("--out", default=None, help="folder for gpu_check.json and gpu_check.png")
    parser.add_argument("--no-server", action="store_true", help="skip step 8 (through Triton)")
    parser.add_argument("--url", default=None,
                        help="step 8 on the server at this gRPC address (serving --target and --drafter) "
                             "instead of one started for it")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if ON_GPU else "cpu")
    settings = gpu_settings().with_values(dtype=args.dtype)
    if not ON_GPU:  # tiny models through the interpreter: 256 pages hold them; the config's
        settings = settings.with_values(num_target_pages=256)  # GiB would be zeroed for nothing
    dtype = torch_dtype(args.dtype, ON_GPU, Path(args.target))
    print(f"device: {torch.cuda.get_device_name() if ON_GPU else 'no GPU: CPU, kernels through the interpreter'}"
          f"; torch {torch.__version__}, dtype {str(dtype).removeprefix('torch.')}", flush=True)

    drafter = None if args.drafter == "none" else args.drafter
    engine = build_local_engine(args.target, drafter, dtype=dtype, device=device,
                                config=EngineConfig.from_settings(settings.resolved(Path(args.target), dtype.itemsize),
                                                                  eos_token_ids(args.target)))
    print("1. kernel warm-up:", end=" ", flush=True)
    reports = [warmup.warm_target(engine.target), warmup.warm_engine(engine)]
    if engine.drafter is not None:
        reports.append(warmup.warm_drafter(engine.drafter))
    if ON_GPU:
        print(f"{sum(r.launches for r in reports)} launches in {sum(r.seconds for r in reports):.1f} s")
    else:
        print("skipped (nothing to compile on CPU)")

    cfg = engine.target.config
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, engine.target.head_dim)
    check_dtype = torch.float32 if dtype == torch.float64 else dtype
    failures = 0
    print("2. kernels vs references:")
    checks = kernel_checks(*heads, cfg.hidden_size, cfg.intermediate_size, engine.target.vocab_size,
                           check_dtype, device)
    for name, problem in checks.items():
        failures += problem is not None
        print(f"   {name:28s} {'ok' if problem is None else 'FAIL: ' + problem}")
    print("3. row invariance (max |difference|, 0 = bitwise equal):")
    for name, value in row_invariance(*heads, cfg.hidden_size, check_dtype, device).items():
        print(f"   {name:52s} {value:.3g}")

    tokenizer = load_tokenizer(args.target)
    texts = paths.read_prompts(paths.HELDOUT_PROMPTS)[:args.num_prompts]
    prompts = [encode_prompt(tokenizer, text) for text in texts]
    before = compiled_count(device)
    results = engine_comparison(engine, prompts, args.max_tokens)
    after = compiled_count(device)
    print(f"4. engine, {len(prompts)} prompts, {args.max_tokens} tokens, plain (k=0) and the default "
          f"(k={settings.drafting.num_speculative_tokens}, topk {settings.drafting.draft_topk}, depth "
          f"{settings.drafting.draft_depth}) in turn:")
    for case, r in results.items():
        print(f"   {case:26s} k=0 {r.plain:7.1f} tokens/s, default {r.default:7.1f} "
              f"({r.default / r.plain:.2f}x, tau {r.tau:.2f}), outputs identical to k=0: "
              f"{r.same}/{len(prompts)}" + ("" if r.exact else " (rejection-sampled: need not be)"))
        if args.require_identical and r.exact and r.same < len(prompts):
            failures += 1
    print("5. kernels compiled during the engine runs:",
          "n/a (interpreter)" if before is None else after - before)
    print("6. plain greedy decoding per forward path:", flush=True)
    paths_ = path_comparison(engine, prompts, args.max_tokens)
    for name, r in paths_.items():
        print(f"   {name:22s} {r['tokens_per_s']:7.1f} tokens/s, {r['launches']:4d} launches a decode "
              f"forward, outputs equal to the fused path's: {r['same_as_fused']}/{len(prompts)}")
    print("7. one token through the whole forward, alone vs first of n rows:")
    invariance = forward_invariance(engine.target, prompts[0])
    for n, r in invariance.items():
        print(f"   n={n:3d} max |logit difference| {r['max_diff']:.3g}, argmax "
              + ("equal" if r["argmax_equal"] else f"differs: top-2 {r['top2_alone']} vs {r['top2_among']}"))
    served = {}
    if not args.no_server:
        name = str(dtype).removeprefix("torch.")
        where = f"the server at {args.url}" if args.url else "configs/gpu.pbtxt" if ON_GPU else "CPU instances"
        print(f"8. through Triton ({where}), {len(texts)} prompts, plain (k=0) and the default in turn, "
              f"through gRPC:", flush=True)
        if args.url:
            served = through_server(args.url, texts, args.max_tokens)
        else:
            with tempfile.TemporaryDirectory() as work:
                served = through_triton(Path(work), args.target, drafter, name, ON_GPU, texts, args.max_tokens)
        for case, r in served.items():
            print(f"   {case:26s} k=0 {r['plain']:7.1f} tokens/s, default {r['default']:7.1f} "
                  f"({r['default'] / r['plain']:.2f}x, tau {r['tau']:.2f}), outputs identical to k=0: "
                  f"{r['same']}/{r['compared']}")
            failures += args.require_identical and r["same"] < r["compared"]
    print("gpu-check:", "FAILED" if failures else "passed")
    if args.out:
        write_results(Path(args.out), dict(
            device=torch.cuda.get_device_name() if ON_GPU else "cpu", dtype=str(dtype), torch=torch.__version__,
            kernel_checks={k: v or "ok" for k, v in checks.items()}, failures=failures,
            engine={case: vars(r) for case, r in results.items()}, forward_paths=paths_,
            forward_invariance=invariance, through_triton=served,
            compiled_during_runs=None if before is None else after - before))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

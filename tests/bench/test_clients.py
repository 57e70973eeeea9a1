"""The shipped clients run as users run them: generate.py and `eagle-serve bench` as subprocesses against
the real server (most benches in this process, on the worker's imports), locust through
load_tests/run.sh, and the compose file's structure."""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from triton_pool import default_server, tiny_server

from eagle_serve import paths

ROOT = paths.REPO_ROOT
MODES = ("vanilla", "eagle", "hf", "hf-lookup")
LOCUST = str(Path(sys.executable).with_name("locust"))


def run(args: list[str], timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, **kwargs)


def bench_in_process(capsys, name: str, *args: str) -> str:
    """The stdout of `eagle-serve bench NAME ARGS` run in this process (the command's entry point
    runs as a subprocess in the tests of other benches; here the worker's imports are reused)."""
    import importlib

    assert importlib.import_module(f"eagle_serve.bench.{name}").main(list(args)) in (0, None)
    return capsys.readouterr().out


def generate(*args: str) -> subprocess.CompletedProcess:
    return run([sys.executable, "clients/generate.py", *args])


def prompts_file(tmp_path: Path, prompts: list[str] = ("Name a color.", "Write a haiku about the sea.")
                 ) -> Path:
    """A prompts.jsonl of these prompts (the clients' --prompts format) in tmp_path."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


@pytest.mark.server
def test_generate_cli_prints_the_answer_over_grpc_stream_http_and_sse(triton_server):
    server = default_server(triton_server)
    prompt, common = "What is the capital of France?", ["--max-tokens", "24"]
    grpc = generate("--url", server.grpc_url, "--num-speculative-tokens", "2", *common, prompt)
    http = generate("--protocol", "http", "--url", server.http_url, "--num-speculative-tokens", "0",
                    *common, prompt)
    sse = generate("--protocol", "http", "--stream", "--url", f"http://{server.http_url}", *common,
                   prompt)
    texts = []
    for got in (grpc, http, sse):
        assert got.returncode == 0, got.stderr
        text, summary = got.stdout.rstrip("\n").rsplit("\n", 1)
        texts.append(text)
        assert "Paris" in text
        assert summary.startswith("[tokens ") and "tokens/s" in summary
        assert "time to first token" in summary
    assert texts[0] == texts[1] == texts[2]
    assert "acceptance length n/a" in http.stdout  # k = 0 drafts nothing
    assert "acceptance length n/a" not in grpc.stdout


@pytest.mark.server
def test_generate_cli_exits_nonzero_with_the_servers_error(triton_server):
    server = default_server(triton_server)
    bad_grpc = generate("--url", server.grpc_url, "--top-p", "1.5", "Hi")
    bad_http = generate("--protocol", "http", "--url", server.http_url, "--top-p", "1.5", "Hi")
    for got in (bad_grpc, bad_http):
        assert got.returncode == 1 and "top_p" in got.stderr
    unreachable = generate("--url", "localhost:1", "Hi")
    assert unreachable.returncode == 1 and "error" in unreachable.stderr


@pytest.mark.server
def test_bench_modes_agree_token_for_token_on_the_float64_tiny_model(triton_server, tiny_models,
                                                                      tmp_path, capsys):
    server = tiny_server(triton_server, tiny_models, "eagle3")  # its default k is 3
    prompts = prompts_file(tmp_path)
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    stdout = bench_in_process(capsys, "modes", "--prompts", str(prompts), "--max-tokens", "12",
                              "--modes", ",".join(MODES), "--json", str(out), "--plot", str(png),
                              "--url", server.grpc_url, "--metrics-url", server.metrics_url,
                              "--concurrency", "1,2", "--target", str(tiny_models["target"]),
                              "--dtype", "float64")
    modes = json.loads(out.read_text())["modes"]
    assert set(modes) == set(MODES)
    outputs = [modes[m]["outputs"] for m in MODES]
    assert len(outputs[0]) == 2 and all(0 < len(o) <= 12 for o in outputs[0])
    assert all(o == outputs[0] for o in outputs)  # eagle == vanilla == hf == hf-lookup
    for name, mode in modes.items():
        assert mode["tokens_per_s"] > 0
        assert (mode["acceptance_length"] is None) == (name != "eagle")
    assert modes["eagle"]["acceptance_length"] >= 1.0
    assert len(modes["eagle"]["accepted_per_round_by_position"]) == 3
    for name in ("vanilla", "eagle"):
        mode = modes[name]
        for key in ("ttft_ms", "tpot_ms"):
            assert set(mode[key]) == {"p50", "p90", "p99"} and mode[key]["p50"] > 0
        assert set(mode["by_concurrency"]) == {"1", "2"}
        assert all(c["tokens_per_s"] > 0 for c in mode["by_concurrency"].values())
    assert png.stat().st_size > 10_000
    assert "vanilla" in stdout and "hf-lookup" in stdout  # the printed table


def test_speedup_matrix_runs_every_case_with_identical_greedy_output_and_full_length_sampled_output(
        triton_server, tiny_models, tmp_path):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    prompts = prompts_file(tmp_path)
    out, png = tmp_path / "matrix.json", tmp_path / "matrix.png"
    got = run([sys.executable, "-m", "eagle_serve", "bench", "matrix", "--prompts", str(prompts),
               "--temperatures", "0", "0.7", "--concurrency", "1", "2", "--max-tokens", "8",
               "--url", server.grpc_url, "--json", str(out), "--plot", str(png)])
    assert got.returncode == 0, got.stderr[-3000:]
    cases = json.loads(out.read_text())
    assert len(cases) == 5 and all(c["default"]["tokens_per_s"] > 0 for c in cases.values())
    requests = {1: 2, 2: 20}  # 2 streams: the prompts 10 times over, 10 groups (MIN_GROUPS)
    greedy = [c for c in cases.values() if not c["temperature"]]
    assert all(c["default"]["same_as_first"] == c["default"]["compared"] == requests[c["concurrency"]]
               for c in greedy)
    sampled = [c for c in cases.values() if c["temperature"]]
    assert all(c[k]["tokens"] == requests[c["concurrency"]] * 8
               for c in sampled for k in ("0", "default"))  # EOS ignored
    mixed = cases["greedy + temperature 0.7, 2 streams, 8 tokens"]  # 1 greedy + 1 sampled stream
    assert mixed["mixed"] and mixed["default"]["same_as_first"] == mixed["default"]["compared"] == 10
    assert set(mixed["default"]["speedup_by_kind"]) == {"greedy", "sampled"}
    assert all(x > 0 for x in mixed["default"]["speedup_by_kind"].values())
    assert all(lo <= c["default"]["speedup"] <= hi for c in cases.values()
               for lo, hi in [c["default"]["speedup_interval"]])
    assert "| greedy, 2 streams, 8 tokens |" in got.stdout and png.stat().st_size > 10_000
    assert "| greedy + temperature 0.7, 2 streams, 8 tokens |" in got.stdout


def test_speedup_curve_runs_hf_generate_as_a_peer_interleaved_with_the_server(triton_server, tiny_models,
                                                                             tmp_path, capsys):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    prompts = prompts_file(tmp_path)
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    stdout = bench_in_process(capsys, "serve", "--prompts", str(prompts), "--max-tokens", "8",
                              "--configs", "0", "default", "hf", "--url", server.grpc_url, "--json", str(out),
                              "--plot", str(png), "--hf-target", str(tiny_models["target"]), "--hf-dtype", "float64")
    results = json.loads(out.read_text())
    assert results["hf"]["tokens_per_s"] > 0 and results["hf"]["tau"] == 0
    assert results["0"]["speedup_interval"] == [1.0, 1.0] and png.stat().st_size > 10_000
    assert all(lo <= results[c]["speedup"] <= hi for c in ("default", "hf")
               for lo, hi in [results[c]["speedup_interval"]])
    assert all(results[c]["same_as_first"] == 2 for c in ("default", "hf"))  # float64: HF's tokens
    assert re.search(r"hf: +[0-9.]+ tok/s", stdout)
    from eagle_serve.bench.serve import main  # the refusals

    for args, message in ((["--configs", "0", "hf", "--concurrency", "2"], "one stream"),
                          (["--mixed", "--temperature", "0.7"], "--concurrency 2 or more")):
        with pytest.raises(SystemExit, match=message):
            main(["--prompts", str(prompts), "--url", server.grpc_url, "--json", str(out), *args])


def test_speedup_interval_resamples_the_groups_paired_across_configs():
    from eagle_serve.bench.serve import speedup_interval
    base = [(64, 1.0), (64, 1.4), (32, 0.5), (64, 0.9), (64, 1.2), (48, 0.8)]
    # twice as fast on every group, however much the groups themselves drift: exactly 2x
    assert speedup_interval(base, [(n, s / 2) for n, s in base]) == pytest.approx((2.0, 2.0))
    # the same run against itself: exactly 1x (each resample takes the same groups of both)
    assert speedup_interval(base, base) == pytest.approx((1.0, 1.0))
    # noisy, 1.1x on average: with a fixed seed the same interval every time; it holds the
    # run's own estimate and 1.1 but not 1.0 at these 50 groups, and the 90% one lies inside it
    rng = np.random.default_rng(7)
    base = [(64, float(s)) for s in rng.uniform(0.8, 1.6, 50)]
    other = [(n, s / 1.1 * float(e)) for (n, s), e in zip(base, rng.normal(1.0, 0.05, 50))]
    lo, hi = speedup_interval(base, other)
    tokens_per_s = lambda groups: sum(n for n, _ in groups) / sum(s for _, s in groups)  # noqa: E731
    whole = tokens_per_s(other) / tokens_per_s(base)
    assert (lo, hi) == speedup_interval(base, other) and lo < whole < hi and lo < 1.1 < hi and lo > 1.0
    lo90, hi90 = speedup_interval(base, other, level=0.9)
    assert lo < lo90 < hi90 < hi


def test_speculation_ceiling_bounds_chains_by_the_forwards_cost_of_their_rows():
    from eagle_serve.bench.ceiling import bound, ceilings, needed_acceptance
    times = {(1, 0): 10.0, (1, 1): 10.0, (1, 2): 16.0, (4, 0): 20.0, (4, 1): 40.0, (4, 2): 60.0}
    assert bound(times, 1, 1.0, 0.0) == (2.0, 1)             # 2 tokens for the price of 1
    assert bound(times, 1, 0.5, 0.0) == (1.5, 1)
    # a drafter call's cost is paid once a round: it makes the longer chain the better one
    assert bound(times, 1, 1.0, 0.0, draft_ms=5.0) == (pytest.approx(30 / 21), 2)
    assert bound(times, 4, 1.0, 0.0)[0] == pytest.approx(1.0)  # compute-bound: nothing to win
    assert bound(times, 4, 1.0, 20.0)[0] == pytest.approx(1.5)  # ... but a fixed round cost helps
    assert needed_acceptance(times, 1, 1.5, 0.0) == pytest.approx(0.5)
    assert needed_acceptance(times, 4, 1.2, 0.0) is None
    found = ceilings(times, acceptance=(0.5, 1.0), overheads=(0.0, 20.0))
    assert [(c.streams, c.acceptance, c.overhead_ms) for c in found][:4] == [
        (1, 0.5, 0.0), (1, 1.0, 0.0), (1, 0.5, 20.0), (1, 1.0, 20.0)]
    assert all(c.speedup >= 1.0 for c in found)  # d = 0 (plain decoding) is always a choice


def test_speculation_ceiling_times_the_default_targets_served_forward(tmp_path):
    """(in this process: `eagle-serve bench ceiling` with these arguments)"""
    from eagle_serve.bench.ceiling import main

    main(["--streams", "1", "2", "--drafts", "0", "1", "--repeats", "1", "--speedups", "1.1",
          "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png")])
    report = json.loads((tmp_path / "c.json").read_text())
    assert {(f["streams"], f["drafts"]) for f in report["forward_ms"]} == {(1, 0), (1, 1), (2, 0), (2, 1)}
    assert all(f["ms"] > 0 for f in report["forward_ms"])
    assert len(report["ceilings"]) == 2 * 2 * 3 and len(report["needed"]) == 2 * 2
    assert (tmp_path / "c.png").stat().st_size > 0


def test_bench_expands_a_draft_tree_sweep_into_one_eagle_mode_per_shape():
    from eagle_serve.bench import modes as bench
    args = bench.parse_args(["--prompts", "p.jsonl", "--max-tokens", "8", "--json", "o.json",
                             "--modes", "vanilla,eagle,hf", "--draft-topk", "1,4",
                             "--draft-depth", "3"])
    assert args.modes == ["vanilla", "eagle-topk1-depth3", "eagle-topk4-depth3", "hf"]
    assert bench.server_params("eagle-topk4-depth3", args)["draft_topk"] == 4
    assert bench.server_params("vanilla", args)["num_speculative_tokens"] == 0
    single = bench.parse_args(["--prompts", "p.jsonl", "--max-tokens", "8", "--json", "o.json",
                               "--draft-topk", "2"])
    assert single.modes == ["vanilla", "eagle"] and single.variants["eagle"]["draft_topk"] == 2


@pytest.mark.server
def test_bench_sweeps_draft_trees_with_the_same_greedy_output(triton_server, tiny_models, tmp_path, capsys):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    prompts = prompts_file(tmp_path, ["Name a color.", "List three prime numbers."])
    out = tmp_path / "bench.json"
    stdout = bench_in_process(capsys, "modes", "--prompts", str(prompts), "--max-tokens", "10",
                              "--modes", "vanilla,eagle", "--json", str(out), "--url", server.grpc_url,
                              "--metrics-url", server.metrics_url, "--k", "6", "--draft-topk", "1,3",
                              "--draft-depth", "3", "--warmup", "0")
    modes = json.loads(out.read_text())["modes"]
    assert list(modes) == ["vanilla", "eagle-topk1-depth3", "eagle-topk3-depth3"]
    assert all(m["outputs"] == modes["vanilla"]["outputs"] for m in modes.values())
    for name in ("eagle-topk1-depth3", "eagle-topk3-depth3"):
        assert modes[name]["acceptance_length"] >= 1.0
        assert len(modes[name]["accepted_per_round_by_position"]) == 3
    assert modes["eagle-topk3-depth3"]["draft_topk"] == 3
    assert "eagle-topk3-depth3" in stdout


def locust_run(tmp_path: Path, server, seconds: int, *user_classes: str):
    env = {**os.environ, "OUT_DIR": str(tmp_path), "GRPC_PORT": str(server.grpc_port),
           "LOCUST": LOCUST}
    got = run(["load_tests/run.sh", "2", "2", f"{seconds}s", f"http://{server.http_url}",
               *user_classes], timeout=240, env=env)
    with open(tmp_path / "locust_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    return got, rows


@pytest.mark.server
def test_locust_default_user_posts_generate_for_3_seconds_without_failures(triton_server, tiny_models,
                                                                         tmp_path):
    got, rows = locust_run(tmp_path, tiny_server(triton_server, tiny_models, "eagle3"), 3)
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert set(rows) == {("POST", "/generate"), ("", "Aggregated")}  # the HTTP user only
    assert int(rows["", "Aggregated"]["Request Count"]) > 0
    assert int(rows["", "Aggregated"]["Failure Count"]) == 0
    assert (tmp_path / "report.html").stat().st_size > 0


@pytest.mark.server
def test_locust_grpc_stream_user_reports_ttft_and_inter_token_latency(triton_server, tiny_models,
                                                                      tmp_path):
    got, rows = locust_run(tmp_path, tiny_server(triton_server, tiny_models, "eagle3"), 3,
                           "GrpcStreamUser")
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    names = {name for kind, name in rows if kind == "grpc"}
    assert names == {"stream", "time_to_first_token", "inter_token_latency", "tokens_per_s"}
    assert int(rows["", "Aggregated"]["Failure Count"]) == 0


def test_locust_run_script_fails_when_requests_fail(tmp_path):
    """Nothing listens on port 1: every request fails, so the run must exit non-zero."""
    env = {**os.environ, "OUT_DIR": str(tmp_path), "LOCUST": LOCUST}
    got = run(["load_tests/run.sh", "1", "1", "3s", "http://localhost:1"], timeout=120, env=env)
    assert got.returncode != 0


VOLUME = re.compile(r"^(?:\$\{\w+:-(?P<default>[^}]*)\}|(?P<host>[^:$]+))"
                    r":(?P<container>[^:]+)(?::ro|:rw)?$")


def host_and_container(volume: str) -> tuple[str, str]:
    """A compose short-syntax volume; a `${VAR:-default}` host path gives its default."""
    m = VOLUME.match(volume)
    assert m, volume
    return m["default"] or m["host"], m["container"]


def test_compose_serves_the_gpu_configs_on_one_reserved_gpu():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    service = compose["services"]["triton"]
    assert service["build"]["dockerfile"] == "docker/Dockerfile"
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    size, unit = int(service["shm_size"][:-2]), service["shm_size"][-2:].lower()
    assert unit == "gb" and size >= 1
    assert {p.split(":")[0] for p in service["ports"]} == {"8000", "8001", "8002", "9000"}
    mounts = dict(host_and_container(v) for v in service["volumes"])
    assert mounts["./models"] == "/models"
    command = service["command"]  # arguments of the image's entry point (the supervisor)
    repo = next(a.split("=", 1)[1] for a in command if a.startswith("--model-repository="))
    assert mounts["./model_repository"] == repo
    assert "--model-config-name=gpu" in (ROOT / "docker" / "Dockerfile").read_text()
    for model in ("eagle_target", "eagle_drafter", "spec_decode"):
        assert (ROOT / "model_repository" / model / "configs" / "gpu.pbtxt").exists()


def drafter_ab(tiny_models, tmp_path: Path, prompts: list[str], max_tokens: int, *args: str,
               drafters: tuple[str, ...] = ("eagle3",), capsys=None) -> str:
    """The stdout of eagle-serve bench engine on the tiny target and these tiny drafters, over these
    prompts: as a user runs it, or with `capsys` in this process."""
    argv = ["--prompts", str(prompts_file(tmp_path, prompts)), "--max-tokens", str(max_tokens),
            "--target", str(tiny_models["target"]), "--drafters", *(str(tiny_models[d]) for d in drafters),
            "--kv-cache-gib", "0.05", *args]  # ~1,600 pages of the tiny target: room to spare
    if capsys is not None:
        from eagle_serve.bench.engine import main
        main(argv)
        return capsys.readouterr().out
    got = run([sys.executable, "-m", "eagle_serve", "bench", "engine", *argv])
    assert got.returncode == 0, got.stderr
    return got.stdout


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_drafter_ab_compares_drafters_in_process_with_output_equal_to_plain_decoding(
        tiny_models, tmp_path, capsys, concurrency):
    """(the batched run with every option as a user runs it, the single stream in this process)"""
    out = drafter_ab(tiny_models, tmp_path, ["Hello there", "Count to five"], 12, "--concurrency", concurrency,
                     *["--every-logit", "--kernels-from", "HEAD", "--fma-kernels",
                       "--policy", "max_draft_batch=1", "lookup_tokens=0"] * (concurrency == "2"),
                     drafters=("eagle3", "eagle1"), capsys=capsys if concurrency == "1" else None)
    lines = [line for line in out.splitlines() if "tokens/s" in line]
    names = ["plain", str(tiny_models["eagle3"]), str(tiny_models["eagle1"])]
    names += ["plain, every logit", f"{tiny_models['eagle3']}, every logit",
              "plain, kernels of HEAD", f"{tiny_models['eagle3']}, kernels of HEAD",
              f"{tiny_models['eagle3']}, max_draft_batch=1", f"{tiny_models['eagle3']}, lookup_tokens=0",
              "plain, FMA kernels", f"{tiny_models['eagle3']}, FMA kernels"] * (concurrency == "2")
    assert [line.split(": ")[0] for line in lines] == names
    assert all(line.endswith("output = its plain decoding's 2/2") for line in lines)


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_drafter_ab_samples_each_prompt_with_its_own_seed_so_every_config_equals_plain_sampling(
        tiny_models, tmp_path, capsys, concurrency):
    out = drafter_ab(tiny_models, tmp_path, ["Hello there", "Count to five", "Why?"], 12, "--temperature", "0.9",
                     "--concurrency", concurrency, "--policy", "sampled_lookup_tokens=0", capsys=capsys)
    lines = [line for line in out.splitlines() if "tokens/s" in line]
    assert len(lines) == 3
    assert all(line.endswith("output = its plain decoding's 3/3") for line in lines)


@pytest.mark.parametrize("setting", ["no_such_setting=1", "max_draft_batch=-1", "lookup_tokens"])
def test_drafter_ab_refuses_a_policy_setting_it_cannot_apply(tiny_models, tmp_path, setting):
    """(in process: the command line is the one above, its exit message is what is checked)"""
    from eagle_serve.bench.engine import main

    with pytest.raises(SystemExit) as exit_:
        main(["--prompts", str(prompts_file(tmp_path, ["Hello there"])), "--max-tokens", "4",
              "--target", str(tiny_models["target"]), "--drafters", str(tiny_models["eagle3"]),
              "--policy", setting])
    assert exit_.value.code != 0 and setting.split("=")[0] in str(exit_.value.code)

"""Soak test: a long locust run against a live server, checked for failures, leaks and memory.

    python -m eagle_serve.tools.soak --duration 600 --users 8        # against `make serve`'s ports
    python -m eagle_serve.tools.soak --duration 60 --server-pid PID  # the one tritonserver to watch

Runs locust's `SoakUser` (load_tests/locustfile.py: mixed parameters, ~10% of streams
cancelled, ~5% intentional bad requests that must be refused with a message), samples the
server's metrics and the resident memory of every model process (the Python backend stubs
under tritonserver) every few seconds, then waits (with a deadline) for the server to go idle
and compares KV pages and draft slots with their values before the run.
Writes soak.json (the report), soak.png (memory and load over time) and locust's CSVs to --out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from eagle_serve import paths
from eagle_serve.client import metrics
from eagle_serve.server.processes import find_server, model_processes

LOCUSTFILE = paths.REPO_ROOT / "load_tests" / "locustfile.py"
IDLE = ('eagle_kv_pages_free{pool="target"}', 'eagle_kv_pages_free{pool="drafter"}',
        "eagle_draft_slots_free")
def rss_mib(procs: dict[str, psutil.Process]) -> dict[str, float]:
    out = {}
    for name, proc in procs.items():
        try:
            out[name] = proc.memory_info().rss / 2**20
        except psutil.Error:
            out[name] = float("nan")  # the process died: the report shows it
    return out


def idle_values(metrics_url: str) -> dict[str, float]:
    m = metrics(metrics_url)
    return {k: m.get(k, float("nan")) for k in IDLE + ("eagle_requests_running", "eagle_requests_waiting")}


def _quiet(metrics_url: str, deadline_s: float = 30.0) -> dict[str, float]:
    """Wait until nothing runs or waits (earlier clients may still be finishing); -> values."""
    end = time.monotonic() + deadline_s
    while True:
        now = idle_values(metrics_url)
        if now["eagle_requests_running"] == 0 and now["eagle_requests_waiting"] == 0 \
                or time.monotonic() > end:
            return now
        time.sleep(0.5)


def wait_idle(metrics_url: str, before: dict[str, float], deadline_s: float) -> dict[str, float]:
    """Poll until pages and slots are back to `before` and nothing runs; -> last values."""
    end = time.monotonic() + deadline_s
    while True:
        now = idle_values(metrics_url)
        if all(now[k] == before[k] for k in IDLE) and now["eagle_requests_running"] == 0 \
                and now["eagle_requests_waiting"] == 0 or time.monotonic() > end:
            return now
        time.sleep(0.5)


def run_soak(host: str, grpc_port: int, metrics_port: int, server_pid: int, *, duration_s: int,
             users: int, out: Path, sample_s: float = 5.0, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    metrics_url = f"{host}:{metrics_port}"
    server = psutil.Process(server_pid)
    procs = model_processes(server)
    before = _quiet(metrics_url)
    samples = [{"t": 0.0, "rss_mib": rss_mib(procs), **idle_values(metrics_url)}]
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "-u", str(users),
           "-r", str(users), "-t", f"{duration_s}s", "--host", f"http://{host}",
           "--stop-timeout", "120", "--only-summary", "--csv", str(out / "locust"), "SoakUser"]
    env = {**os.environ, "GRPC_PORT": str(grpc_port)}
    started = time.monotonic()
    with open(out / "locust.log", "w") as locust_log:
        locust = subprocess.Popen(cmd, env=env, stdout=locust_log, stderr=subprocess.STDOUT)
        while locust.poll() is None:
            time.sleep(sample_s)
            t = time.monotonic() - started
            samples.append({"t": round(t, 1), "rss_mib": rss_mib(procs), **idle_values(metrics_url)})
            log(f"soak {t:5.0f}/{duration_s} s: running {samples[-1]['eagle_requests_running']:.0f}, "
                f"rss " + ", ".join(f"{k} {v:.0f} MiB" for k, v in samples[-1]["rss_mib"].items()))
    after = wait_idle(metrics_url, before, deadline_s=60)
    report = {
        "duration_s": duration_s, "users": users,
        "requests": _locust_counts(out / "locust_stats.csv"),
        "leaked": {k: before[k] - after[k] for k in IDLE},
        "idle_before": before, "idle_after": after,
        "rss_mib": {name: {"start": samples[0]["rss_mib"][name],
                           "after_first_minute": _first_after(samples, 60.0)["rss_mib"][name],
                           "end": samples[-1]["rss_mib"][name],
                           "growth": samples[-1]["rss_mib"][name] - samples[0]["rss_mib"][name]}
                    for name in procs},
        "model_processes_alive": {name: p.is_running() for name, p in procs.items()},
        "locust_exit_code": locust.returncode,
    }
    (out / "soak.json").write_text(json.dumps({**report, "samples": samples}, indent=1))
    plot(samples, out / "soak.png")
    return report


def _first_after(samples: list[dict], t: float) -> dict:
    return next((s for s in samples if s["t"] >= t), samples[-1])


def _locust_counts(stats_csv: Path) -> dict[str, dict[str, int]]:
    """{request name: {"count", "failures"}} from locust's stats CSV (incl. "Aggregated")."""
    import csv
    if not stats_csv.exists():
        return {}
    with open(stats_csv) as f:
        return {row["Name"]: {"count": int(row["Request Count"]), "failures": int(row["Failure Count"])}
                for row in csv.DictReader(f)}


def plot(samples: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    t = [s["t"] / 60 for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for name in samples[0]["rss_mib"]:
        top.plot(t, [s["rss_mib"][name] for s in samples], label=name)
    top.set_ylabel("resident memory (MiB)")
    top.legend(fontsize=8)
    top.set_title("soak: model process memory and load")
    bottom.plot(t, [s["eagle_requests_running"] for s in samples], label="running")
    bottom.plot(t, [s["eagle_requests_waiting"] for s in samples], label="waiting")
    bottom.plot(t, [s['eagle_kv_pages_free{pool="target"}'] for s in samples], label="free target pages")
    bottom.set_yscale("symlog")
    bottom.set_xlabel("minutes")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle_serve.tools.soak")
    parser.add_argument("--host", default="localhost")
    parser.add_argument("--http-port", type=int, default=int(os.environ.get("HTTP_PORT", 8000)))
    parser.add_argument("--grpc-port", type=int, default=int(os.environ.get("GRPC_PORT", 8001)))
    parser.add_argument("--metrics-port", type=int, default=int(os.environ.get("METRICS_PORT", 8002)))
    parser.add_argument("--server-pid", type=int, default=None)
    parser.add_argument("--duration", type=int, default=600, help="seconds")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("out/soak"))
    args = parser.parse_args(argv)
    if args.server_pid is None:
        server = find_server(args.http_port)
        if server is None:
            raise SystemExit(f"no tritonserver with HTTP port {args.http_port}; pass --server-pid")
        args.server_pid = server.pid
    report = run_soak(args.host, args.grpc_port, args.metrics_port, args.server_pid, duration_s=args.duration,
                      users=args.users, out=args.out)
    print(json.dumps(report, indent=1))
    unexpected = sum(v["failures"] for k, v in report["requests"].items() if k != "Aggregated")
    leaked = any(v != 0 for v in report["leaked"].values())
    sys.exit(1 if unexpected or leaked or not all(report["model_processes_alive"].values()) else 0)


if __name__ == "__main__":
    main()

"""Shared fixtures. `triton_server(name, models=None, overrides=None, model_config_name=None)`
starts (once per name while in use: triton_pool.ServerPool) the real tritonserver on a copy of
model_repository/ and returns a `triton_pool.TritonServer` (http_url, grpc_url, metrics_url,
log_path, repo). A failing test that used one gets the tail of its log in the report.
`tiny_models` are the float64 tiny Llama (write_tiny_tokenizer's tokenizer and ChatML
template) and its random heads that `triton_pool.tiny_server` serves (exact greedy equality
holds). `kernels_on_cpu` sends every kernel dispatcher down its
GPU path (the Triton kernel, through the interpreter).
"""
import gc
import itertools
import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton: kernel tests
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs a worker per core: one torch thread each, and OpenMP threads (a served
    # target's two) sleep while they wait instead of spinning on the core the other worker needs
    os.environ.update(OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", GOMP_SPINCOUNT="0")
# the test folders mirror the package's layers; a module may import another's helpers by name
sys.path[:0] = [str(d) for d in sorted(Path(__file__).parent.iterdir())
                if d.is_dir() and not d.name.startswith(("_", "."))]

import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from triton_pool import ServerPool  # noqa: E402

from eagle_serve.server.launch import TritonServer  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # in case torch set up its threads before OMP_NUM_THREADS was set
# The tests allocate millions of short-lived objects (the Triton interpreter's above all): at
# Python's default thresholds a collection runs every 700 allocations and a full one, walking
# torch's and transformers' millions of objects, every few seconds. Those imported so far are
# frozen out of the walks, and the young generation collected less often.
gc.freeze()
gc.set_threshold(50_000, 20, 20)


def _patch_the_language_once_per_launch() -> None:
    """Triton's interpreter patches triton.language for a launch (restored after it), and again,
    unrestored, at every call of a @jit function inside the kernel (tl.sum too), in every program
    instance: each a scan of the language's modules (inspect.getmembers), the interpreter's
    largest overhead. Here a launch patches both modules a kernel and the functions it calls see
    (tl and tl.core), and the calls inside it skip the scan: the same code runs. (Triton is
    pinned: an upgrade that renames these internals fails here, at once.)"""
    from types import SimpleNamespace

    from triton.runtime import interpreter

    patch, run, launches = interpreter._patch_lang, interpreter.GridExecutor.__call__, []
    both = SimpleNamespace(__globals__={"tl": interpreter.tl, "core": interpreter.tl.core})

    def launch(self, *args, **kwargs):
        launches.append(False)  # whether its own patch (its first) was made
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    def patch_lang(fn):
        if not launches:
            return patch(fn)
        if launches[-1]:
            return None  # a call inside the kernel: its caller ignores the scope
        launches[-1] = True
        return patch(both)
    interpreter._patch_lang, interpreter.GridExecutor.__call__ = patch_lang, launch


def _map_dtypes_to_numpy_from_one_table() -> None:
    """The interpreter maps a language dtype to numpy's (_get_np_dtype) through a table of 19
    dtypes that it builds, hashing each, at every call: some 60,000 calls in one engine test's
    generation. Here each dtype's mapping is looked up once, by its name (a block's: its
    element's): the same mapping."""
    from triton.runtime import interpreter

    lookup, table = interpreter._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, interpreter.tl.block_type):
            tt_dtype = tt_dtype.element_ty
        found = table.get(tt_dtype.name)
        if found is None:
            found = table[tt_dtype.name] = lookup(tt_dtype)
        return found
    interpreter._get_np_dtype = get_np_dtype


if os.environ["TRITON_INTERPRET"] == "1":
    _patch_the_language_once_per_launch()
    _map_dtypes_to_numpy_from_one_table()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    from eagle_serve.testing import make_random_head, make_tiny_llama

    root = tmp_path_factory.mktemp("served-models")
    target = make_tiny_llama(root / "tiny-llama")
    return {"target": target,
            "eagle3": make_random_head(root / "eagle3", target, 3, draft_vocab_size=4096),
            "eagle1": make_random_head(root / "eagle1", target, 1, fc_bias=True, fmt="bin")}


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """Every dispatcher runs its Triton kernel (the GPU path), on CPU tensors too, through the
    interpreter (impl "ref" still the ref)."""
    from eagle_serve.testing import force_gpu_kernels

    force_gpu_kernels(monkeypatch)


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("tritonserver"))
    yield pool
    pool.close()


@pytest.fixture(scope="module", autouse=True)
def _servers_know_the_module(request):
    """The pool keeps the servers the running module asked for, and through a SHARED_SERVERS
    unit those its modules all ask for (autouse: set before the module's own fixtures ask)."""
    pool = request.getfixturevalue("triton_server")
    pool.module = request.module.__name__
    pool.keep = KEEP_LIVE.get(_UNIT.get(request.node.nodeid), set())
    pool.max_module = 2 + len(pool.keep)


def pytest_collection_modifyitems(items):
    """Work units (a module, or a SHARED_SERVERS unit) in the order the workers take them
    (pytest_xdist_make_scheduler): those that start servers alternating with those holding
    slow tests, then the rest, each group by its number of tests, largest first. The long
    units first and the many short ones last keep both workers busy to the end; alternating
    keeps the two workers from starting servers at the same time."""
    units: dict[str, list] = {}
    for item in items:
        units.setdefault(_unit_of(item.nodeid), []).append(item)

    def marked(unit: str, name: str) -> bool:
        return any(item.get_closest_marker(name) for item in units[unit])

    def by_size(names) -> list[str]:
        return sorted(names, key=lambda unit: -len(units[unit]))

    server = by_size(u for u in units if marked(u, "server") or u in SHARED_SERVERS)
    slow = by_size(u for u in units if u not in server and marked(u, "slow"))
    rest = by_size(u for u in units if u not in server and u not in slow)
    alternating = [u for pair in itertools.zip_longest(server, slow) for u in pair if u is not None]
    items[:] = [item for unit in alternating + rest
                for item in sorted(units[unit], key=lambda item: _IN_UNIT.get(item.nodeid.split("::")[0], 0))]


# Modules asking for the same servers, each first for the one the module before it asked for
# last: one xdist work unit, so that one worker runs them one after the other and its pool
# starts those servers once (the tiny one, asked for by each, once in the run). The default
# model's server takes twice a tiny one's start.
SHARED_SERVERS = {
    "shared-servers": ("tests/bench/test_clients.py", "tests/triton_backend/test_server_e2e.py",
                       "tests/triton_backend/test_triton_clients.py", "tests/openai_api/test_openai_server.py",
                       "tests/openai_api/test_openai_sampling.py", "tests/openai_api/test_openai_structured.py",
                       "tests/server/test_reliability.py", "tests/tools/test_gpu_check.py",
                       "tests/server/test_hardening.py"),  # last: its hang tests end their servers
    "prepost": ("tests/triton_backend/test_preprocess_postprocess_server.py",
                "tests/server/test_health.py"),  # last: it kills a model process
}
# Servers the modules of a unit ask for again and again: kept live through it, beside two
# others (the default model's ~3 GB, a tiny one's ~1.8 GB)
KEEP_LIVE = {"shared-servers": {"default", "tiny64-eagle3", "tiny64-eagle1"}}
_UNIT = {module: unit for unit, modules in SHARED_SERVERS.items() for module in modules}
_IN_UNIT = {module: i for modules in SHARED_SERVERS.values() for i, module in enumerate(modules)}


def _unit_of(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return _UNIT.get(module, module)


def pytest_xdist_make_scheduler(config, log):
    """--dist loadfile, but the modules of each SHARED_SERVERS entry are one unit, and units are
    handed out in collection order (pytest_collection_modifyitems), not by their size."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByServer(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)
    config.option.loadscopereorder = False
    return ByServer(config, log)


def servers_used(item) -> list[TritonServer]:
    """Servers a test received directly, else every server of the pool it had access to."""
    values = list(getattr(item, "funcargs", {}).values())
    direct = [v for v in values if isinstance(v, TritonServer)]
    pools = [v for v in values if isinstance(v, ServerPool)]
    return direct or [s for pool in pools for s in pool.servers.values()]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for server in servers_used(item):
            report.sections.append((f"tritonserver '{server.name}' log tail ({server.log_path})",
                                    server.log_tail()))
    return report


# tiny float64 models shared by the engine tests (built once per run, no downloads)
@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from eagle_serve.testing import make_tiny_llama
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "target")


@pytest.fixture(scope="session")
def eagle1_head(tmp_path_factory, tiny_target):
    from eagle_serve.testing import make_random_head
    return make_random_head(tmp_path_factory.mktemp("h1") / "eagle1", tiny_target, 1, fc_bias=True)


@pytest.fixture(scope="session")
def eagle3_head(tmp_path_factory, tiny_target):
    from eagle_serve.testing import make_random_head
    return make_random_head(tmp_path_factory.mktemp("h3") / "eagle3", tiny_target, 3,
                            draft_vocab_size=4096)


@pytest.fixture(scope="session")
def prompts():
    """8 prompts of mixed lengths (3 .. 45 tokens) of the tiny models' ids."""
    from eagle_serve.testing import TINY_VOCAB

    rng = random.Random(1234)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in (3, 45, 17, 8, 30, 5, 22, 11)]


@pytest.fixture(scope="session")
def hf_greedy(tiny_target):
    """HF transformers `generate`, greedy, on the same float64 weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from eagle_serve import testing
    model = AutoModelForCausalLM.from_pretrained(str(tiny_target), dtype=torch.float64).eval()
    cache: dict[tuple, list[int]] = {}

    def run(prompt: list[int], max_new_tokens: int) -> list[int]:
        key = (tuple(prompt), max_new_tokens)
        if key not in cache:
            cache[key] = testing.hf_generate_greedy(model, prompt, max_new_tokens)
        return cache[key]
    return run

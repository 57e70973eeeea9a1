"""Serving settings: one place, the `parameters` of `spec_decode/config.pbtxt`, which state only
what differs from these defaults (the shipped configuration states none: a test checks).

The settings are frozen dataclasses by concern (models, cache, scheduler, drafting, limits, API,
CPU threads), each field documented once, here; a config's keys are the field names, unique
across the sections, so `max_running` in a config.pbtxt is `settings.scheduler.max_running`.
`eagle_target` and `eagle_drafter` read the same block (from the spec_decode folder of their
repository), so model folders, dtype and cache sizes can never disagree between the process
that allocates pages and the processes that hold the KV tensors. `EngineConfig` holds the
sections the engine uses; the in-process engine (`eagle_serve.local`, the CLI, the trainer's
eval) starts from the same defaults, so it runs what the server runs.
Imports no torch: preprocess and postprocess read the tokenizer folder through here.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

from eagle_serve import paths

DType = Literal["auto", "float32", "float64", "bfloat16", "float16"]
DrafterWeights = Literal["trained", "q8_0", "q8_0_a8"]  # see checkpoints.load_drafter
TargetActivations = Literal["fp32", "int8"]  # see target.TargetModel
SampledVerify = Literal["auto", "rejection", "coupled"]
ToolCallTemplate = Literal["auto", "model", "hermes"]
DTYPE_NAMES = get_args(DType)
DRAFTER_WEIGHTS = get_args(DrafterWeights)
TARGET_ACTIVATIONS = get_args(TargetActivations)

# What one request may ask for: a tree's children per node and depth (its nodes are bounded by
# max_speculative_tokens), so that a client sets the draft's cost only within these.
MAX_DRAFT_TOPK = 8
MAX_DRAFT_DEPTH = 8

CORPUS_INDEX_FILE = "corpus-index.npz"   # beside a head: its lookup corpus (eagle_serve.spec.lookup)


def default_corpus_index(drafter_dir: Path | None) -> Path | None:
    """The corpus index shipped beside a head, if it has one."""
    path = drafter_dir and Path(drafter_dir) / CORPUS_INDEX_FILE
    return path if path and path.exists() else None


class _Section:
    """A frozen group of settings: a Literal field takes only its values; `check` says what else
    a valid group needs (ValueError naming the field)."""

    def __post_init__(self):
        hints = get_type_hints(type(self))
        for f in fields(self):
            choices = get_args(hints[f.name]) if get_origin(hints[f.name]) is Literal else ()
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {choices}, got {getattr(self, f.name)!r}")
        self.check()

    def check(self) -> None:
        pass

    def _in_range(self, names: tuple[str, ...], low: float, high: float, note: str = "") -> None:
        for name in names:
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"{name} must be in [{low:g}, {high:g}]{note}, got {getattr(self, name)}")


@dataclass(frozen=True)
class ModelSettings(_Section):
    """Which models serve, and in which arithmetic."""
    target_model: str = "default"              # HF folder; "default" = SmolLM2-135M-Instruct
    drafter_model: str = "default-drafter"     # EAGLE head folder; "none" = no drafter
    dtype: DType = "auto"                      # auto = bfloat16 on GPU and on CPUs with
    #                                            native bf16 (AVX512-BF16/AMX) except for a
    #                                            target of GGUF blocks, else float32
    drafter_weights: DrafterWeights = "q8_0_a8"  # "q8_0": on CPU in fp32 the head's linears are
    #                                            rounded to Q8_0 (a quarter of the bytes per
    #                                            draft step); "q8_0_a8": and their inputs to 8
    #                                            bits; "trained": as trained
    target_activations: TargetActivations = "fp32"  # "int8": a GGUF target's linears on inputs
    #                                            rounded to 8 bits (llama.cpp's arithmetic;
    #                                            faster, not the fp32 forward's bits)
    lookup_corpus: str = "default"             # corpus index (.npz); "default" = the drafter's
    #                                            corpus-index.npz if it has one; "none" = off
    cuda_graphs: bool = True                   # on a GPU, the target's decode and verify
    #                                            forwards replay CUDA graphs (models.graphs)


@dataclass(frozen=True)
class CacheSettings(_Section):
    """The KV pages of both models and the draft workspace."""
    page_size: int = 16
    kv_cache_gib: float = 1.0                  # the target's KV cache, in GiB: its pages hold
    #                                            this many bytes of its keys and values
    num_target_pages: int = 0                  # KV pages of the target (x page_size positions);
    #                                            0 = as many as kv_cache_gib holds
    num_drafter_pages: int = 0                 # 0 = as many as the target's
    num_draft_slots: int = 256                 # draft tokens in flight
    enable_prefix_caching: bool = True         # requests share the KV pages of a common prefix
    #                                            (eagle_serve.core.prefix_cache)


@dataclass(frozen=True)
class SchedulerSettings(_Section):
    """What runs in a round and what waits."""
    max_running: int = 8                       # requests in one round
    max_waiting: int = 64                      # queued beyond that; more -> "server busy"
    max_model_len: int = 0                     # prompt + output tokens of a request; 0 = the
    #                                            target's own context (max_position_embeddings)
    max_num_batched_tokens: int = 256          # rows one round computes at most: running
    #                                            requests' decode and verify rows first, then
    #                                            prompts in chunks (0 = whole prompts at once)

    def check(self) -> None:
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 0 (0 = no limit), "
                             f"got {self.max_num_batched_tokens}")


@dataclass(frozen=True)
class DraftSettings(_Section):
    """The draft policy: what each request drafts, from which source, and when not to."""
    num_speculative_tokens: int = 8            # default k of a request (tree: nodes verified)
    max_speculative_tokens: int = 8            # the most a request may ask for
    draft_topk: int = 4                        # default children per draft-tree node (1 = chain)
    draft_depth: int = 3                       # default draft-tree depth (0 = k)
    max_tree_batch: int = 1                    # trees only while <= this many requests run (0 = always)
    draft_min_prob: float = 0.05               # greedy drafts below this path probability are not
    #                                            verified (the first always is); 0 = off; with
    #                                            costs, no draft below what pays for its row
    draft_expand_prob: float = 0.5             # draft deeper only while a draft reaches this; 0 = off
    sampled_draft_depth: int = 2               # sampled requests draft chains up to this long
    #                                            (a request's draft_depth or k overrides/caps it)
    sampled_draft_min_prob: float = 0.0        # a sampled chain stops where the product of its
    #                                            drafter distributions' top probabilities falls
    #                                            below this (the first draft included); 0 = off;
    #                                            with costs, where it no longer pays for its row
    draft_call_cost: float = 0.20              # what a drafting round costs (the drafter call),
    draft_step_cost: float = 0.05              # and each drafted chain position, as shares of a
    #                                            plain decoding round: a request drafts the chain
    #                                            its measured acceptance pays for, or nothing for
    #                                            a while (both 0 = fixed shapes, never off)
    draft_batch_cost: float = 0.08             # added to draft_step_cost per further running
    #                                            request (verify rows stop being free)
    measured_draft_costs: bool = True          # once measured, the drafter call's and a verify
    #                                            row's cost on this machine replace the three
    #                                            above (not for seeded rejection-sampled requests)
    max_draft_batch: int = 4                   # no drafting while more requests run (seeded
    #                                            sampled ones excepted); 0 = no limit
    max_sampled_draft_batch: int = 1           # the same for sampled requests (their verify
    #                                            rows cost more); 0 = no limit
    lookup_tokens: int = 6                     # longest branch each lookup source adds to a greedy
    #                                            draft tree (0 = no lookup drafts)
    sampled_lookup_tokens: int = 3             # the same beside a sampled request's chain (0 = off)
    sampled_verify: SampledVerify = "coupled"  # how sampled drafts are verified: "coupled"
    #                                            (drafts are the drafter's guesses at the
    #                                            target's own seeded sample, a request without a
    #                                            seed given a random one, kept while they equal
    #                                            it; they draft trees, below), "rejection"
    #                                            (rejection sampling of drafts drawn from q), or
    #                                            "auto": requests with a seed coupled, others
    #                                            rejection-sampled
    coupled_draft_topk: int = 2                # children per node of a coupled request's tree
    #                                            (depth sampled_draft_depth; 1 = chains; a
    #                                            request's draft_topk overrides it)

    def check(self) -> None:
        self._in_range(("draft_topk", "coupled_draft_topk"), 1, MAX_DRAFT_TOPK)
        self._in_range(("draft_depth",), 0, MAX_DRAFT_DEPTH, " (0 = k)")
        self._in_range(("sampled_draft_depth",), 1, MAX_DRAFT_DEPTH)
        self._in_range(("lookup_tokens", "sampled_lookup_tokens"), 0, self.max_speculative_tokens)
        self._in_range(("draft_min_prob", "draft_expand_prob", "sampled_draft_min_prob"), 0, 1)
        self._in_range(("draft_call_cost", "draft_step_cost", "draft_batch_cost"), 0, 10)
        for name in ("max_tree_batch", "max_draft_batch", "max_sampled_draft_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")


@dataclass(frozen=True)
class LimitSettings(_Section):
    """What one request may send, and how long anything may take."""
    max_input_bytes: int = 65536               # a request's text_input (preprocess and the
    #                                            direct path)
    model_call_timeout_s: float = 120.0        # a target/drafter call slower than this means a
    #                                            stuck model process: the server restarts
    request_timeout_s: float = 600.0           # a request unfinished after this fails (0 = never)
    max_queue_time_s: float = 120.0            # a request waiting longer to start fails (0 = never)


@dataclass(frozen=True)
class ApiSettings(_Section):
    """How text requests are read."""
    apply_chat_template: bool = True           # what a text_input request without that input
    #                                            gets (false: callers that template themselves)
    tool_call_template: ToolCallTemplate = "auto"  # how the OpenAI server shows tools to the model:
    #                                            "model" (its chat template renders `tools`),
    #                                            "hermes" (<tools>/<tool_call> turns written in,
    #                                            openai_api.tools), "auto": the model's if its
    #                                            template mentions tools, else hermes


@dataclass(frozen=True)
class CpuSettings(_Section):
    """Torch CPU threads of the model processes: they run one after another in a round, and
    threads beyond the work oversubscribe the cores, so spec_decode (bookkeeping and sampling)
    runs one."""
    target_threads: int = 0                    # of eagle_target (0 = all cores)
    drafter_threads: int = 1                   # of eagle_drafter (small matrices: 1 is enough)


@functools.cache
def setting_sections(cls) -> dict[str, str]:
    """{setting name: the section field of `cls` (ServingSettings or EngineConfig) holding it}:
    a config name finds its group."""
    hints = get_type_hints(cls)
    return {f.name: section.name for section in fields(cls) if isinstance(hints[section.name], type)
            and issubclass(hints[section.name], _Section) for f in fields(hints[section.name])}


def _with(obj, values: dict):
    """`obj` (ServingSettings or EngineConfig) with settings replaced by their config names (or
    its own other fields by theirs)."""
    where = setting_sections(type(obj))
    own = {f.name for f in fields(obj)} - set(where.values())
    unknown = set(values) - set(where) - own
    if unknown:
        raise ValueError(f"unknown settings: {sorted(unknown)}")
    groups: dict[str, dict] = {}
    for name, value in values.items():
        if name not in own:
            groups.setdefault(where[name], {})[name] = value
    changed = {group: replace(getattr(obj, group), **new) for group, new in groups.items()}
    return replace(obj, **changed, **{name: values[name] for name in own & set(values)})


@dataclass(frozen=True)
class ServingSettings:
    model: ModelSettings = field(default_factory=ModelSettings)
    cache: CacheSettings = field(default_factory=CacheSettings)
    scheduler: SchedulerSettings = field(default_factory=SchedulerSettings)
    drafting: DraftSettings = field(default_factory=DraftSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    cpu: CpuSettings = field(default_factory=CpuSettings)

    @classmethod
    def of(cls, **values) -> "ServingSettings":
        """The defaults with some settings changed, by their config names."""
        return cls().with_values(**values)

    def with_values(self, **values) -> "ServingSettings":
        """These settings with some changed, by their config names (`max_running=4`)."""
        return _with(self, values)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ServingSettings":
        """A config's `parameters` (string values) -> settings."""
        where = setting_sections(cls)
        unknown = set(params) - set(where) - {"FORCE_CPU_ONLY_INPUT_TENSORS"}
        if unknown:
            raise ValueError(f"unknown spec_decode parameters: {sorted(unknown)}")
        values = {}
        for name, value in params.items():
            if name in where:
                kind = get_type_hints(get_type_hints(cls)[where[name]])[name]
                cast = {int: int, float: float, bool: parse_bool}.get(kind)
                try:
                    values[name] = cast(value) if cast else value
                except ValueError:
                    raise ValueError(f"spec_decode parameter {name}: not a {kind.__name__}: {value!r}") from None
        return cls.of(**values)

    def resolved(self, target_dir: Path, dtype_bytes: int) -> "ServingSettings":
        """These settings with what depends on the target filled in: max_model_len 0 -> its
        context; page counts 0 -> what kv_cache_gib holds of its KV (dtype_bytes: the size of
        its dtype's element). Every process of a server resolves the same numbers."""
        cfg, cache = _text_config(target_dir), self.cache
        pages = cache.num_target_pages
        if not pages:
            heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            page_bytes = 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes * cache.page_size
            pages = max(1, int(cache.kv_cache_gib * 2 ** 30 // page_bytes))
        return self.with_values(max_model_len=self.scheduler.max_model_len or _context(cfg),
                                num_target_pages=pages, num_drafter_pages=cache.num_drafter_pages or pages)

    def kv_summary(self) -> str:
        """What a resolved cache holds, for the log at start."""
        cache = self.cache
        return (f"KV cache: {cache.num_target_pages} pages of {cache.page_size} = "
                f"{cache.num_target_pages * cache.page_size} tokens; max_model_len {self.scheduler.max_model_len}")

    def model_dirs(self, repo_dir: Path) -> tuple[Path, Path | None]:
        target = paths.resolve_model_path(self.model.target_model or "default", repo_dir)
        if self.model.drafter_model in ("", "none"):
            return target, None
        return target, paths.resolve_model_path(self.model.drafter_model, repo_dir)

    def corpus_index_path(self, repo_dir: Path, drafter_dir: Path | None) -> Path | None:
        """The lookup corpus index to load, if any."""
        corpus, drafting = self.model.lookup_corpus, self.drafting
        if corpus in ("", "none") or drafter_dir is None or (
                drafting.lookup_tokens == 0 and drafting.sampled_lookup_tokens == 0):
            return None
        if corpus == "default":
            return default_corpus_index(drafter_dir)
        return paths.resolve_model_path(corpus, repo_dir)

    def apply_threads(self, role: str) -> None:
        """This process's torch threads (CpuSettings): role "target", "drafter" or "engine"."""
        import torch
        n = getattr(self.cpu, f"{role}_threads", 1)
        torch.set_num_threads(n if n > 0 else (os.cpu_count() or 1))


def setting_names() -> list[str]:
    """Every setting's config name."""
    return list(setting_sections(ServingSettings))


@dataclass(frozen=True)
class EngineConfig:
    """The sections of the settings the engine uses, plus the EOS ids of the target. Build it
    with `from_settings` or `served(**overrides)`."""
    cache: CacheSettings
    scheduler: SchedulerSettings
    drafting: DraftSettings
    limits: LimitSettings
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_settings(cls, settings: ServingSettings, eos_token_ids: tuple[int, ...] = ()) -> "EngineConfig":
        """settings: resolved (ServingSettings.resolved)."""
        assert settings.cache.num_target_pages and settings.scheduler.max_model_len, "settings not resolved"
        return cls(settings.cache, settings.scheduler, settings.drafting, settings.limits, tuple(eos_token_ids))

    @classmethod
    def served(cls, **overrides) -> "EngineConfig":
        """The shipped defaults with some settings replaced by their config names (tests,
        library use); with no target to size them from, 512 pages a pool and a context of 2048."""
        fixed = ServingSettings.of(num_target_pages=512, num_drafter_pages=512, max_model_len=2048)
        return cls.from_settings(fixed).with_values(**overrides)

    def with_values(self, **values) -> "EngineConfig":
        """This config with some settings changed, by their config names."""
        return _with(self, values)


def model_config(target_dir: Path) -> dict:
    """A model folder's config.json as written (no transformers: a drafter process reads it)."""
    path = Path(target_dir) / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"{target_dir}: the model's config.json is missing")
    return json.loads(path.read_text())


def _text_config(target_dir: Path) -> dict:
    cfg = model_config(target_dir)
    return cfg.get("text_config", cfg)


def _context(cfg: dict) -> int:
    return int(cfg.get("max_position_embeddings") or 2048)


def model_context(target_dir: Path) -> int:
    """The context a target was trained for (its max_position_embeddings)."""
    return _context(_text_config(target_dir))


def model_vocab_size(target_dir: Path) -> int:
    """The rows of a target's LM head (config.json's vocab_size, as AutoConfig reads it)."""
    return int(_text_config(target_dir)["vocab_size"])


# generation_config.json key -> the request field it gives a default (vLLM's
# `--generation-config auto`: what the model's authors chose, where a request sets nothing)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}


def generation_defaults(target_dir: Path) -> dict[str, float | int]:
    """The sampling defaults the target's generation_config.json sets ({} without one)."""
    path = Path(target_dir) / "generation_config.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    return {ours: cfg[theirs] for theirs, ours in GENERATION_DEFAULTS.items() if cfg.get(theirs) is not None}


def parse_bool(value: str) -> bool:
    """A config parameter's "true" / "false" (ValueError for anything else)."""
    word = str(value).strip().lower()
    if word not in ("true", "false"):
        raise ValueError(f"not true or false: {value!r}")
    return word == "true"


def tokenizer_dir(value: str, repo_dir: Path) -> Path:
    """A tokenizer folder parameter; "target" (the default) = spec_decode's target model (the
    default model in a repository without spec_decode)."""
    if value in ("", "target"):
        return repository_settings(repo_dir).model_dirs(Path(repo_dir))[0]
    return paths.resolve_model_path(value, Path(repo_dir))


def repository_settings(repo_dir: Path) -> ServingSettings:
    """spec_decode's settings (read_settings), or the defaults in a repository without
    spec_decode: where preprocess reads its limits and chat-template default, and
    `tokenizer_dir` the target."""
    if not (Path(repo_dir) / "spec_decode" / "config.pbtxt").exists():
        return ServingSettings()
    return read_settings(repo_dir)


CONFIG_NAME_ENV = "EAGLE_MODEL_CONFIG_NAME"  # tritonserver's --model-config-name (eagle_serve.server.serve)


def settings_file(repo_dir: Path) -> Path:
    """The spec_decode config Triton loads: configs/<name>.pbtxt when the server runs with
    --model-config-name=<name> (EAGLE_MODEL_CONFIG_NAME, which eagle_serve.server.serve sets for
    tritonserver and its models) and the repository has it, else config.pbtxt. Every model and
    the OpenAI server read the settings from this one file, so an edit reaches all of them."""
    name = os.environ.get(CONFIG_NAME_ENV)
    alternative = Path(repo_dir) / "spec_decode" / "configs" / f"{name}.pbtxt"
    return alternative if name and alternative.exists() else Path(repo_dir) / "spec_decode" / "config.pbtxt"


def read_settings(repo_dir: Path) -> ServingSettings:
    """The parameters of spec_decode's config that Triton loads (settings_file)."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = settings_file(repo_dir).read_text()
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return ServingSettings.from_parameters(
        {k: v.string_value for k, v in config.parameters.items()})

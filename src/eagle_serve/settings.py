"""Serving settings: one place, the `parameters` of `spec_decode/config.pbtxt`, which state only
what differs from these defaults (the shipped configuration states none: a test checks).

`eagle_target` and `eagle_drafter` read the same block (from the spec_decode folder of their
repository), so model folders, dtype and cache sizes can never disagree between the process
that allocates pages and the processes that hold the KV tensors. `EngineConfig` is the part the
engine uses, taken from the settings by field name; the in-process engine (`eagle_serve.local`,
the CLI, the trainer's eval) starts from the same defaults, so it runs what the server runs.
Imports no torch: preprocess and postprocess read the tokenizer folder through here.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields, replace
from pathlib import Path

from eagle_serve import paths

DTYPE_NAMES = ("auto", "float32", "float64", "bfloat16", "float16")
DRAFTER_WEIGHTS = ("trained", "q8_0", "q8_0_a8")  # see checkpoints.load_drafter
TARGET_ACTIVATIONS = ("fp32", "int8")  # see target.TargetModel


CORPUS_INDEX_FILE = "corpus-index.npz"   # beside a head: its lookup corpus (eagle_serve.spec.lookup)


SAMPLED_VERIFY = ("auto", "rejection", "coupled")
TOOL_CALL_TEMPLATES = ("auto", "model", "hermes")


def check_draft_limits(config) -> None:
    """ValueError unless the draft policy's probability limits are in [0, 1], its costs in
    [0, 10] and sampled_verify one of SAMPLED_VERIFY (ServingSettings and EngineConfig both
    carry them)."""
    if config.sampled_verify not in SAMPLED_VERIFY:
        raise ValueError(f"sampled_verify must be one of {SAMPLED_VERIFY}, got {config.sampled_verify!r}")
    for names, high in ((("draft_min_prob", "draft_expand_prob", "sampled_draft_min_prob"), 1.0),
                        (("draft_call_cost", "draft_step_cost", "draft_batch_cost"), 10.0)):
        for name in names:
            if not 0.0 <= getattr(config, name) <= high:
                raise ValueError(f"{name} must be in [0, {high:g}], got {getattr(config, name)}")


def default_corpus_index(drafter_dir: Path | None) -> Path | None:
    """The corpus index shipped beside a head, if it has one."""
    path = drafter_dir and Path(drafter_dir) / CORPUS_INDEX_FILE
    return path if path and path.exists() else None


@dataclass(frozen=True)
class ServingSettings:
    target_model: str = "default"              # HF folder; "default" = SmolLM2-135M-Instruct
    drafter_model: str = "default-drafter"     # EAGLE head folder; "none" = no drafter
    dtype: str = "auto"                        # auto = bfloat16 on GPU and on CPUs with
    #                                            native bf16 (AVX512-BF16/AMX) except for a
    #                                            target of GGUF blocks, else float32
    page_size: int = 16
    kv_cache_gib: float = 1.0                  # the target's KV cache, in GiB: its pages hold
    #                                            this many bytes of its keys and values
    num_target_pages: int = 0                  # KV pages of the target (x page_size positions);
    #                                            0 = as many as kv_cache_gib holds
    num_drafter_pages: int = 0                 # 0 = as many as the target's
    num_draft_slots: int = 256                 # draft tokens in flight
    max_running: int = 8                       # requests in one round
    max_waiting: int = 64                      # queued beyond that; more -> "server busy"
    max_model_len: int = 0                     # prompt + output tokens of a request; 0 = the
    #                                            target's own context (max_position_embeddings)
    enable_prefix_caching: bool = True         # requests share the KV pages of a common prefix
    #                                            (eagle_serve.core.prefix_cache)
    max_num_batched_tokens: int = 256          # rows one round computes at most: running
    #                                            requests' decode and verify rows first, then
    #                                            prompts in chunks (0 = whole prompts at once)
    num_speculative_tokens: int = 8            # default k of a request (tree: nodes verified)
    max_speculative_tokens: int = 8
    draft_topk: int = 4                        # default children per draft-tree node (1 = chain)
    draft_depth: int = 3                       # default draft-tree depth (0 = k)
    max_draft_topk: int = 8
    max_draft_depth: int = 8
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
    sampled_verify: str = "coupled"            # how sampled drafts are verified: "coupled"
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
    lookup_corpus: str = "default"             # corpus index (.npz); "default" = the drafter's
    #                                            corpus-index.npz if it has one; "none" = off
    max_input_bytes: int = 65536               # text_input limit on the direct path
    apply_chat_template: bool = True           # what a text_input request without that input
    #                                            gets (false: callers that template themselves)
    tool_call_template: str = "auto"           # how the OpenAI server shows tools to the model:
    #                                            "model" (its chat template renders `tools`),
    #                                            "hermes" (<tools>/<tool_call> turns written in,
    #                                            openai_api.tools), "auto": the model's if its
    #                                            template mentions tools, else hermes
    max_stop_strings: int = 32                 # stop strings of one request
    max_stop_bytes: int = 4096                 # their total UTF-8 size
    model_call_timeout_s: float = 120.0        # a target/drafter call slower than this means a
    #                                            stuck model process: the server restarts
    request_timeout_s: float = 600.0           # a request unfinished after this fails (0 = never)
    max_queue_time_s: float = 120.0            # a request waiting longer to start fails (0 = never)
    target_threads: int = 0                    # torch CPU threads of eagle_target (0 = all cores)
    drafter_threads: int = 1                   # of eagle_drafter (small matrices: 1 is enough)
    drafter_weights: str = "q8_0_a8"           # "q8_0": on CPU in fp32 the head's linears are
    #                                            rounded to Q8_0 (a quarter of the bytes per
    #                                            draft step); "q8_0_a8": and their inputs to 8
    #                                            bits; "trained": as trained
    target_activations: str = "fp32"           # "int8": a GGUF target's linears on inputs
    #                                            rounded to 8 bits (llama.cpp's arithmetic;
    #                                            faster, not the fp32 forward's bits)
    engine_threads: int = 1                    # of spec_decode (bookkeeping and sampling)
    cuda_graphs: bool = True                   # on a GPU, the target's decode and verify
    #                                            forwards replay CUDA graphs (models.graphs)

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {DTYPE_NAMES}, got {self.dtype!r}")
        if self.drafter_weights not in DRAFTER_WEIGHTS:
            raise ValueError(f"drafter_weights must be one of {DRAFTER_WEIGHTS}, "
                             f"got {self.drafter_weights!r}")
        if self.target_activations not in TARGET_ACTIVATIONS:
            raise ValueError(f"target_activations must be one of {TARGET_ACTIVATIONS}, "
                             f"got {self.target_activations!r}")
        if self.tool_call_template not in TOOL_CALL_TEMPLATES:
            raise ValueError(f"tool_call_template must be one of {TOOL_CALL_TEMPLATES}, "
                             f"got {self.tool_call_template!r}")
        check_draft_limits(self)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ServingSettings":
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(params) - set(known) - {"FORCE_CPU_ONLY_INPUT_TENSORS"}
        if unknown:
            raise ValueError(f"unknown spec_decode parameters: {sorted(unknown)}")
        values = {}
        for name, value in params.items():
            if name in known:
                cast = {"int": int, "float": float, "bool": parse_bool}.get(
                    getattr(known[name], "__name__", known[name]))
                try:
                    values[name] = cast(value) if cast else value
                except ValueError:
                    raise ValueError(f"spec_decode parameter {name}: not a {known[name]}: {value!r}") from None
        return cls(**values)

    def resolved(self, target_dir: Path, dtype_bytes: int) -> "ServingSettings":
        """These settings with what depends on the target filled in: max_model_len 0 -> its
        context; page counts 0 -> what kv_cache_gib holds of its KV (dtype_bytes: the size of
        its dtype's element). Every process of a server resolves the same numbers."""
        cfg = _text_config(target_dir)
        max_len = self.max_model_len or _context(cfg)
        pages = self.num_target_pages
        if not pages:
            heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
            page_bytes = 2 * cfg["num_hidden_layers"] * heads * head_dim * dtype_bytes * self.page_size
            pages = max(1, int(self.kv_cache_gib * 2 ** 30 // page_bytes))
        return replace(self, max_model_len=max_len, num_target_pages=pages,
                       num_drafter_pages=self.num_drafter_pages or pages)

    def kv_summary(self) -> str:
        """What a resolved cache holds, for the log at start."""
        return (f"KV cache: {self.num_target_pages} pages of {self.page_size} = "
                f"{self.num_target_pages * self.page_size} tokens; max_model_len {self.max_model_len}")

    def model_dirs(self, repo_dir: Path) -> tuple[Path, Path | None]:
        target = paths.resolve_model_path(self.target_model or "default", repo_dir)
        if self.drafter_model in ("", "none"):
            return target, None
        return target, paths.resolve_model_path(self.drafter_model, repo_dir)

    def corpus_index_path(self, repo_dir: Path, drafter_dir: Path | None) -> Path | None:
        """The lookup corpus index to load, if any."""
        if self.lookup_corpus in ("", "none") or drafter_dir is None or (
                self.lookup_tokens == 0 and self.sampled_lookup_tokens == 0):
            return None
        if self.lookup_corpus == "default":
            return default_corpus_index(drafter_dir)
        return paths.resolve_model_path(self.lookup_corpus, repo_dir)

    def apply_threads(self, role: str) -> None:
        """Processes run one after another in a round; threads beyond the work oversubscribe
        the cores (measured 27 s vs 1.4 s for 32 tokens when two processes spun 2 threads each)."""
        import os

        import torch
        n = {"target": self.target_threads, "drafter": self.drafter_threads,
             "engine": self.engine_threads}[role]
        torch.set_num_threads(n if n > 0 else (os.cpu_count() or 1))


@dataclass(frozen=True)
class EngineConfig:
    """The settings the engine uses (names and meanings as in ServingSettings), plus the EOS
    ids of the target. Build it with `from_settings` or `served(**overrides)`."""
    num_speculative_tokens: int
    max_speculative_tokens: int
    max_running: int
    max_waiting: int
    max_model_len: int
    enable_prefix_caching: bool
    max_num_batched_tokens: int
    page_size: int
    num_target_pages: int
    num_drafter_pages: int
    num_draft_slots: int
    draft_topk: int
    draft_depth: int
    max_draft_topk: int
    max_draft_depth: int
    max_tree_batch: int
    draft_min_prob: float
    draft_expand_prob: float
    sampled_draft_depth: int
    sampled_draft_min_prob: float
    draft_call_cost: float
    draft_step_cost: float
    draft_batch_cost: float
    measured_draft_costs: bool
    max_draft_batch: int
    max_sampled_draft_batch: int
    lookup_tokens: int
    sampled_lookup_tokens: int
    sampled_verify: str
    coupled_draft_topk: int
    max_stop_strings: int
    max_stop_bytes: int
    request_timeout_s: float
    max_queue_time_s: float
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_settings(cls, settings: ServingSettings, eos_token_ids: tuple[int, ...] = ()) -> "EngineConfig":
        """settings: resolved (ServingSettings.resolved)."""
        assert settings.num_target_pages and settings.max_model_len, "settings not resolved"
        taken = {f.name: getattr(settings, f.name) for f in fields(cls) if f.name != "eos_token_ids"}
        return cls(**taken, eos_token_ids=tuple(eos_token_ids))

    @classmethod
    def served(cls, **overrides) -> "EngineConfig":
        """The shipped defaults with some fields replaced (tests, library use); with no target
        to size them from, 512 pages a pool and a context of 2048."""
        fixed = replace(ServingSettings(), num_target_pages=512, num_drafter_pages=512, max_model_len=2048)
        return replace(cls.from_settings(fixed), **overrides)

    def validate(self) -> None:
        if not 1 <= self.draft_topk <= self.max_draft_topk:
            raise ValueError(f"draft_topk must be in [1, {self.max_draft_topk}], got {self.draft_topk}")
        if not 0 <= self.draft_depth <= self.max_draft_depth:
            raise ValueError(f"draft_depth must be in [0, {self.max_draft_depth}] (0 = k), "
                             f"got {self.draft_depth}")
        if self.max_num_batched_tokens < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 0 (0 = no limit), "
                             f"got {self.max_num_batched_tokens}")
        if self.max_tree_batch < 0:
            raise ValueError(f"max_tree_batch must be >= 0 (0 = no limit), got {self.max_tree_batch}")
        for name in ("max_draft_batch", "max_sampled_draft_batch"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 = no limit), got {getattr(self, name)}")
        if not 1 <= self.coupled_draft_topk <= self.max_draft_topk:
            raise ValueError(f"coupled_draft_topk must be in [1, {self.max_draft_topk}], "
                             f"got {self.coupled_draft_topk}")
        if not 1 <= self.sampled_draft_depth <= self.max_draft_depth:
            raise ValueError(f"sampled_draft_depth must be in [1, {self.max_draft_depth}], "
                             f"got {self.sampled_draft_depth}")
        for name in ("lookup_tokens", "sampled_lookup_tokens"):
            if not 0 <= getattr(self, name) <= self.max_speculative_tokens:
                raise ValueError(f"{name} must be in [0, {self.max_speculative_tokens}], "
                                 f"got {getattr(self, name)}")
        check_draft_limits(self)


def _text_config(target_dir: Path) -> dict:
    cfg = json.loads((Path(target_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def _context(cfg: dict) -> int:
    return int(cfg.get("max_position_embeddings") or 2048)


def model_context(target_dir: Path) -> int:
    """The context a target was trained for (its max_position_embeddings)."""
    return _context(_text_config(target_dir))


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
        if not (Path(repo_dir) / "spec_decode" / "config.pbtxt").exists():
            return paths.default_target_dir()
        return read_settings(repo_dir).model_dirs(Path(repo_dir))[0]
    return paths.resolve_model_path(value, Path(repo_dir))


def chat_template_default(repo_dir: Path) -> bool:
    """Whether a text request without apply_chat_template gets the chat template: spec_decode's
    setting (true in a repository without spec_decode)."""
    if not (Path(repo_dir) / "spec_decode" / "config.pbtxt").exists():
        return True
    return read_settings(repo_dir).apply_chat_template


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

"""Serving settings: one place, the `parameters` of `spec_decode/config.pbtxt`.

`eagle_target` and `eagle_drafter` read the same block (from the spec_decode folder of their
repository), so model folders, dtype and cache sizes can never disagree between the process
that allocates pages and the processes that hold the KV tensors.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from eagle_serve import paths
from eagle_serve.engine import EngineConfig


@dataclass(frozen=True)
class ServingSettings:
    target_model: str = "default"              # HF folder; "default" = SmolLM2-135M-Instruct
    drafter_model: str = "default-drafter"     # EAGLE head folder; "none" = no drafter
    dtype: str = "auto"                        # auto = bfloat16 on GPU and on CPUs with
    #                                            native bf16 (AVX512-BF16/AMX), else float32
    page_size: int = 16
    num_target_pages: int = 512                # KV pages of the target (x page_size positions)
    num_drafter_pages: int = 512
    num_draft_slots: int = 256                 # draft tokens in flight
    max_running: int = 8                       # requests in one round
    max_waiting: int = 64                      # queued beyond that; more -> "server busy"
    max_model_len: int = 2048
    num_speculative_tokens: int = 0            # default k of a request
    max_speculative_tokens: int = 8
    draft_topk: int = 1                        # default children per draft-tree node (1 = chain)
    draft_depth: int = 0                       # default draft-tree depth (0 = k)
    max_draft_topk: int = 8
    max_draft_depth: int = 8
    max_tree_batch: int = 0                    # trees only while <= this many requests run (0 = always)
    draft_min_prob: float = 0.0                # greedy drafts below this path probability are not
    #                                            verified (the first always is); 0 = off
    draft_expand_prob: float = 0.0             # draft deeper only while a draft reaches this; 0 = off
    max_input_bytes: int = 65536               # text_input limit on the direct path
    max_stop_strings: int = 32                 # stop strings of one request
    max_stop_bytes: int = 4096                 # their total UTF-8 size
    model_call_timeout_s: float = 120.0        # a target/drafter call slower than this means a
    #                                            stuck model process: the server restarts
    request_timeout_s: float = 600.0           # a request unfinished after this fails (0 = never)
    max_queue_time_s: float = 120.0            # a request waiting longer to start fails (0 = never)
    target_threads: int = 0                    # torch CPU threads of eagle_target (0 = all cores)
    drafter_threads: int = 1                   # of eagle_drafter (small matrices: 1 is enough)
    engine_threads: int = 1                    # of spec_decode (bookkeeping and sampling)

    @classmethod
    def from_parameters(cls, params: dict[str, str]) -> "ServingSettings":
        known = {f.name: f.type for f in fields(cls)}
        unknown = set(params) - set(known) - {"FORCE_CPU_ONLY_INPUT_TENSORS"}
        if unknown:
            raise ValueError(f"unknown spec_decode parameters: {sorted(unknown)}")
        values = {}
        for name, value in params.items():
            if name in known:
                cast = {"int": int, "float": float}.get(getattr(known[name], "__name__", known[name]))
                try:
                    values[name] = cast(value) if cast else value
                except ValueError:
                    raise ValueError(f"spec_decode parameter {name}: not a {known[name]}: {value!r}") from None
        return cls(**values)

    def model_dirs(self, repo_dir: Path) -> tuple[Path, Path | None]:
        target = paths.resolve_model_path(self.target_model or "default", repo_dir)
        if self.drafter_model in ("", "none"):
            return target, None
        return target, paths.resolve_model_path(self.drafter_model, repo_dir)

    def draft_pruning(self):
        from eagle_serve.drafter import DraftPruning
        return DraftPruning(self.draft_min_prob, self.draft_expand_prob)

    def torch_dtype(self, on_gpu: bool):
        import torch
        names = {"float32": torch.float32, "float64": torch.float64,
                 "bfloat16": torch.bfloat16, "float16": torch.float16}
        if self.dtype == "auto":
            from eagle_serve.cpu_matmul import native_bf16
            return torch.bfloat16 if on_gpu or native_bf16() else torch.float32
        if on_gpu and self.dtype == "float64":  # the attention kernel accumulates in float32
            raise ValueError("dtype float64 runs on CPU instances only; on a GPU use auto "
                             "(bfloat16), float16 or float32")
        return names[self.dtype]

    def apply_threads(self, role: str) -> None:
        """Processes run one after another in a round; threads beyond the work oversubscribe
        the cores (measured 27 s vs 1.4 s for 32 tokens when two processes spun 2 threads each)."""
        import os

        import torch
        n = {"target": self.target_threads, "drafter": self.drafter_threads,
             "engine": self.engine_threads}[role]
        torch.set_num_threads(n if n > 0 else (os.cpu_count() or 1))

    def engine_config(self, eos_token_ids: tuple[int, ...]) -> EngineConfig:
        return EngineConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            max_speculative_tokens=self.max_speculative_tokens, max_running=self.max_running,
            max_waiting=self.max_waiting, max_model_len=self.max_model_len,
            page_size=self.page_size, num_target_pages=self.num_target_pages,
            num_drafter_pages=self.num_drafter_pages, num_draft_slots=self.num_draft_slots,
            eos_token_ids=eos_token_ids, draft_topk=self.draft_topk, draft_depth=self.draft_depth,
            max_draft_topk=self.max_draft_topk, max_draft_depth=self.max_draft_depth,
            max_tree_batch=self.max_tree_batch, request_timeout_s=self.request_timeout_s,
            max_queue_time_s=self.max_queue_time_s, max_stop_strings=self.max_stop_strings,
            max_stop_bytes=self.max_stop_bytes)


def tokenizer_dir(value: str, repo_dir: Path) -> Path:
    """A tokenizer folder parameter; "target" (the default) = spec_decode's target model (the
    default model in a repository without spec_decode)."""
    if value in ("", "target"):
        if not (Path(repo_dir) / "spec_decode" / "config.pbtxt").exists():
            return paths.default_target_dir()
        return read_settings(repo_dir).model_dirs(Path(repo_dir))[0]
    return paths.resolve_model_path(value, Path(repo_dir))


def read_settings(repo_dir: Path) -> ServingSettings:
    """The parameters of <repo>/spec_decode/config.pbtxt."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    text = (Path(repo_dir) / "spec_decode" / "config.pbtxt").read_text()
    config = text_format.Parse(text, model_config_pb2.ModelConfig())
    return ServingSettings.from_parameters(
        {k: v.string_value for k, v in config.parameters.items()})

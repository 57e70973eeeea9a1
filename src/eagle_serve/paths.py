"""Where things live on disk: the cache folder, the default model folders, the server tree, and
the prompt files (JSONL, one `{"prompt": "..."}` a line) with their one reader.

Knows nothing about models or Triton. `EAGLE_CACHE` overrides the cache folder (default:
`.cache/` in the repository root).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
HELDOUT_PROMPTS = REPO_ROOT / "clients" / "prompts" / "heldout.jsonl"  # never trained on


def cache_dir() -> Path:
    return Path(os.environ.get("EAGLE_CACHE", REPO_ROOT / ".cache")).resolve()


def models_dir() -> Path:
    return cache_dir() / "models"


def default_target_dir() -> Path:
    return models_dir() / DEFAULT_TARGET_NAME


def default_drafter_dir() -> Path:
    """The EAGLE-3 head trained for the default target, shipped in the repository."""
    return REPO_ROOT / "drafters" / "eagle3-SmolLM2-135M-Instruct"


def tritonserver_dir() -> Path:
    return cache_dir() / "tritonserver"


def resolve_model_path(value: str, base: Path | None = None) -> Path:
    """Resolve a config value: "default" names, absolute paths, or paths relative to `base`."""
    if value in ("", "default", "default-target"):
        return default_target_dir()
    if value == "default-drafter":
        return default_drafter_dir()
    path = Path(os.path.expandvars(os.path.expanduser(value)))
    if not path.is_absolute():
        path = (base or REPO_ROOT) / path
    return path.resolve()


def read_prompts(path: str | Path) -> list[str]:
    """The prompts of a JSONL file, one `{"prompt": "..."}` a line (blank lines skipped)."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line)["prompt"] for line in lines if line.strip()]

"""Copy a Triton model repository with only some models and some config parameters changed.

Used by the test fixtures (a server with preprocess + postprocess only, a float64 target) and
by hand:

    python -m eagle_serve.triton_backend.repo_config model_repository /tmp/repo \\
        --models preprocess,postprocess --set postprocess.skip_special_tokens=false
    python -m eagle_serve.triton_backend.repo_config model_repository /repo --set-file settings.conf

Overrides apply to `config.pbtxt` and every alternative config under `configs/`: the string
value of an existing `parameters { key: "K" value: { string_value: "V" } }` is replaced, a
missing one is appended. Relative paths in parameters resolve against the copy, so pass
absolute ones. Edits the text, so comments and layout survive.
"""
from __future__ import annotations

import argparse
import re
import shutil
from pathlib import Path

Overrides = dict[str, dict[str, str]]  # model name -> parameter key -> string value


def quote(value: str) -> str:
    """`value` as a protobuf text-format string literal."""
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def set_parameter(config_text: str, key: str, value: str) -> str:
    """config.pbtxt text with parameter `key` set to `value` (replaced or appended)."""
    pattern = re.compile(r'(key\s*:\s*' + re.escape(quote(key))
                         + r'\s*,?\s*value\s*:?\s*\{\s*string_value\s*:\s*)"(?:[^"\\]|\\.)*"')
    new_text, count = pattern.subn(lambda m: m.group(1) + quote(value), config_text)
    if count:
        return new_text
    block = f"parameters {{ key: {quote(key)} value: {{ string_value: {quote(value)} }} }}\n"
    return config_text + ("" if config_text.endswith("\n") or not config_text else "\n") + block


def model_names(repository: Path) -> list[str]:
    return sorted(p.name for p in Path(repository).iterdir() if (p / "config.pbtxt").exists())


def copy_repository(src: str | Path, dst: str | Path, models: list[str] | None = None,
                    overrides: Overrides | None = None) -> Path:
    """Copy the `models` of repository `src` (all by default) into `dst`, applying
    `overrides`. Returns `dst`. Unknown model names are an error, not silently ignored."""
    src, dst = Path(src), Path(dst)
    available = model_names(src)
    models = available if models is None else list(models)
    overrides = overrides or {}
    unknown = sorted(set(models) - set(available))
    if unknown:
        raise ValueError(f"models {unknown} are not in {src} (it has {available})")
    not_copied = sorted(set(overrides) - set(models))
    if not_copied:
        raise ValueError(f"overrides for models {not_copied} that are not copied")
    dst.mkdir(parents=True, exist_ok=True)
    for name in models:
        shutil.copytree(src / name, dst / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        configs = [dst / name / "config.pbtxt", *sorted((dst / name / "configs").glob("*.pbtxt"))]
        for config in configs:
            text = config.read_text()
            for key, value in overrides.get(name, {}).items():
                text = set_parameter(text, key, value)
            config.write_text(text)
    return dst


def parse_assignments(assignments: list[str]) -> Overrides:
    """["model.key=value", ...] -> {"model": {"key": "value"}}."""
    overrides: Overrides = {}
    for item in assignments:
        target, sep, value = item.partition("=")
        model, dot, key = target.partition(".")
        if not (sep and dot and model and key):
            raise ValueError(f"expected MODEL.KEY=VALUE, got {item!r}")
        overrides.setdefault(model, {})[key] = value
    return overrides


def read_assignments(path: Path) -> list[str]:
    """A settings file: MODEL.KEY=VALUE lines; blank lines and lines starting with # skipped
    (the ConfigMap of deploy/k8s)."""
    lines = (line.strip() for line in Path(path).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path, help="model repository to copy")
    parser.add_argument("dst", type=Path, help="new folder (created; must not hold the models)")
    parser.add_argument("--models", help="comma-separated model names (default: all)")
    parser.add_argument("--set", dest="assignments", action="append", default=[],
                        metavar="MODEL.KEY=VALUE", help="override a config parameter")
    parser.add_argument("--set-file", type=Path, action="append", default=[], metavar="FILE",
                        help="override the parameters of FILE's MODEL.KEY=VALUE lines (# comments)")
    args = parser.parse_args(argv)
    models = args.models.split(",") if args.models else None
    assignments = [a for f in args.set_file for a in read_assignments(f)] + args.assignments
    try:
        dst = copy_repository(args.src, args.dst, models, parse_assignments(assignments))
    except ValueError as error:
        parser.error(str(error))
    print(dst)


if __name__ == "__main__":
    main()

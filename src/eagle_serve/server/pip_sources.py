"""Prints uv's options for the package sources pip is configured with, from `pip config list`
(pip's config files and its PIP_* variables), which uv does not read: `make setup` installs the
pins with uv, in about half pip's time (docs/performance.md), from the same wheel folders
and indexes pip would use (a mirror, or a local torch wheel). Run by path, before this package
is installed: it imports only the standard library."""
from __future__ import annotations

import ast
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links"}
SCOPES = (":env:", "site", "user", "global")  # pip's precedence, first wins


def uv_options(config: str) -> list[str]:
    """`pip config list`'s lines (`global.find-links='/opt/wheels'`, `:env:.index-url='...'`; a
    value may hold several sources, space- or newline-separated) -> uv's options, each source
    once. pip takes one index URL: its environment's, else its site's, user's, global file's."""
    sources: dict[str, list[str]] = {flag: [] for flag in FLAGS.values()}
    index_urls: dict[str, str] = {}
    for line in config.splitlines():
        key, sep, value = line.partition("=")
        scope, _, name = key.rpartition(".")
        flag = FLAGS.get(name)
        if not sep or flag is None:
            continue
        for source in ast.literal_eval(value).split():
            if flag == "--index-url":
                index_urls[scope] = source
            elif source not in sources[flag]:
                sources[flag].append(source)
    scopes = [scope for scope in SCOPES if scope in index_urls]
    sources["--index-url"] = [index_urls[scopes[0]]] if scopes else []
    return [part for flag, found in sources.items() for source in found for part in (flag, source)]


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, check=True).stdout
    print(" ".join(uv_options(listed)))

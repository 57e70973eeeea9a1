"""Structured output: a request's guide (a JSON schema, any JSON, a regex, a choice of strings,
an EBNF or a Lark grammar) compiled against the target's tokenizer, and the matcher that follows the
request's output.

xgrammar (vLLM's and SGLang's default backend) rather than llguidance: its matcher rolls back
over rejected tokens, and finds the continuation a grammar forces (jump-forward), the two things
speculation needs; compiled grammars are cached by the compiler (the same schema compiles once).
Compiling runs in a thread of its own, off the engine's step: the engine admits a request once
its grammar is ready, so a slow compile delays only its own request; guides are bounded in size
and their compile in time.

A token mask applies at every verify row (the target's logits are -inf outside it,
eagle_serve.core.processors), computed on the matcher advanced over the row's own path: the output
is exactly plain constrained decoding's. Drafts the grammar rejects are pruned before
verification (greedy and coupled requests: their drafts are not drawn from q), and the text
the grammar forces joins the draft tree as one more source (lookup.GRAMMAR), in each of its
tokenizations near the root: the masked target picks its own.
"""
from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

GUIDE_TYPES = ("json_schema", "json", "regex", "choice", "ebnf_grammar", "lark")  # TensorRT-LLM's + 2
# JSON-schema keywords and regex constructs xgrammar would ignore (it warns and goes on): refused,
# since the output could break them
UNENFORCED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependentRequired",
                       "uniqueItems", "contains", "minContains", "maxContains", "propertyNames",
                       "unevaluatedProperties", "unevaluatedItems")
UNENFORCED_REGEX = ("(?=", "(?!", "(?<=", "(?<!", "\\1", "\\2")
MAX_GUIDE_BYTES = 64 * 1024
MAX_CHOICES = 256
COMPILE_TIMEOUT_S = 10.0


def check_guide(guide: tuple[str, str]) -> None:
    """Cheap checks before compiling (ValueError naming the problem)."""
    kind, text = guide
    if kind not in GUIDE_TYPES:
        raise ValueError(f"guided_decoding_guide_type must be one of {GUIDE_TYPES}, got {kind!r}")
    if len(text.encode("utf-8")) > MAX_GUIDE_BYTES:
        raise ValueError(f"the guide may be at most {MAX_GUIDE_BYTES} bytes")
    if kind in ("json_schema", "choice"):
        try:
            value = json.loads(text) if text else ({} if kind == "json_schema" else None)
        except json.JSONDecodeError as error:
            raise ValueError(f"the {kind} guide is not valid JSON: {error}") from None
        if kind == "choice" and not (isinstance(value, list) and 0 < len(value) <= MAX_CHOICES
                                     and all(isinstance(c, str) and c for c in value)):
            raise ValueError(f"a choice guide is a JSON list of 1 to {MAX_CHOICES} non-empty strings")
        if kind == "json_schema" and not isinstance(value, (dict, bool)):
            raise ValueError("a JSON schema is an object")
        if kind == "json_schema":
            _check_schema(value)
    elif kind in ("regex", "ebnf_grammar", "lark") and not text:
        raise ValueError(f"the {kind} guide is empty")
    if kind == "regex":
        _check_pattern(text)


def _check_schema(node) -> None:
    """Every keyword the grammar enforces (ValueError naming one it would ignore)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in UNENFORCED_KEYWORDS:
                raise ValueError(f"the JSON schema keyword {key!r} is not supported")
            if key == "pattern" and isinstance(value, str):
                _check_pattern(value)
            if key not in ("properties", "$defs", "definitions", "patternProperties") or not isinstance(value, dict):
                _check_schema(value)
            else:
                for sub in value.values():
                    _check_schema(sub)
    elif isinstance(node, list):
        for item in node:
            _check_schema(item)


def _check_pattern(pattern: str) -> None:
    bad = next((c for c in UNENFORCED_REGEX if c in pattern), None)
    if bad is not None:
        raise ValueError(f"regex construct {bad!r} (lookaround or backreference) is not supported")


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
    """xgrammar's TokenizerInfo of the target's tokenizer, as `from_huggingface` builds it. A
    TextTokenizer (spec_decode's) has no Hugging Face tokenizer to build it from: it is built
    from the one in the model folder once per machine and read back from beside the
    TextTokenizer's own cache file (keyed by it, xgrammar's version and the arguments)."""
    import xgrammar as xgr

    from eagle_serve.core.tokenization import TextTokenizer, load_tokenizer, write_atomically

    def build(hf):
        return xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
    if not isinstance(tokenizer, TextTokenizer):
        return build(tokenizer)
    cached = tokenizer_info_file(tokenizer.cache_file, vocab_size, stop_token_ids)
    if cached.is_file():
        return xgr.TokenizerInfo.deserialize_json(cached.read_text(encoding="utf-8"))
    info = build(load_tokenizer(tokenizer.folder))
    write_atomically(cached, info.serialize_json())
    return info


def tokenizer_info_file(cache_file: str | Path, vocab_size: int, stop_token_ids: tuple[int, ...]) -> Path:
    """Where `tokenizer_info` keeps a TextTokenizer's TokenizerInfo (beside its `cache_file`)."""
    from importlib.metadata import version

    key = f"{version('xgrammar')}-{vocab_size}-{'-'.join(map(str, stop_token_ids))}"
    return Path(cache_file).with_suffix(f".xgrammar-{key}.json")


class Guides:
    """Compiles guides for one target tokenizer, one at a time in a thread of their own."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        import xgrammar as xgr

        self.xgr = xgr
        info = tokenizer_info(tokenizer, vocab_size, stop_token_ids)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=True)
        special = set(info.special_token_ids) | set(stop_token_ids)
        self.token_of = {text: i for i, text in enumerate(info.decoded_vocab)
                         if text and i not in special and i < vocab_size}
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32  # int32 words of a row's bitmask
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")

    def compile(self, guide: tuple[str, str]) -> Future:
        """-> a future of the compiled grammar (ValueError when the guide does not compile)."""
        return self._pool.submit(self._compile, guide)

    def _compile(self, guide: tuple[str, str]):
        kind, text = guide
        c = self.compiler
        try:
            if kind == "json_schema":
                return c.compile_json_schema(text or "{}", any_whitespace=False)
            if kind == "json":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "choice":
                return c.compile_regex("|".join(_regex_escape(s) for s in json.loads(text)))
            if kind == "lark":
                return c.compile_lark(text)
            return c.compile_grammar(text)
        except Exception as error:  # noqa: BLE001 (xgrammar's own errors, for the client)
            raise ValueError(f"the {kind} guide does not compile: {error}") from None

    def matcher(self, compiled) -> "GrammarState":
        return GrammarState(self.xgr.GrammarMatcher(compiled), self.words, self.token_of)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r".^$*+?()[]{}|\/" else ch for ch in text)


class GrammarState:
    """One request's matcher, advanced over its output; masks and drafts are worked out by
    advancing it along a path and rolling it back."""

    def __init__(self, matcher, words: int, token_of: dict[bytes, int] | None = None):
        self.m, self.words = matcher, words
        self.token_of = token_of or {}  # a token's text -> its id
        self.longest = max(map(len, self.token_of), default=0)

    def accept(self, token: int) -> bool:
        """A token the target produced under the mask (one the grammar refuses here is a bug:
        it is reported) -> whether the grammar has ended (it took a stop token)."""
        if not self.m.accept_token(token):
            raise RuntimeError(f"token {token} left the grammar")
        return self.m.is_terminated()

    def masks(self, drafts: list[int], parents: list[int]) -> np.ndarray:
        """[1 + n, words] int32 bitmasks of the request's verify rows: row 0 after the output,
        row 1 + i after the output and the path to draft node i. A node the grammar refuses
        (and its subtree) keeps its parent's mask: its row is never reached."""
        import torch

        out = torch.zeros((1 + len(drafts), self.words), dtype=torch.int32)
        self.m.fill_next_token_bitmask(out, 0)
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)

        def visit(node: int, row: int) -> None:
            for child in children.get(node, []):
                if not self.m.accept_token(drafts[child]):
                    out[1 + child] = out[row]
                    _copy_subtree(children, child, out, row)
                    continue
                if self.m.is_terminated():  # its stop token: the output ends on it
                    out[1 + child] = out[row]
                    _copy_subtree(children, child, out, row)
                else:
                    self.m.fill_next_token_bitmask(out, 1 + child)
                    visit(child, 1 + child)
                self.m.rollback(1)
        visit(-1, 0)
        return out.numpy()

    def prune(self, drafts: list[int], parents: list[int], keys: list) -> tuple[list[int], list[int], list]:
        """The draft tree without the nodes the grammar refuses (and their subtrees)."""
        keep: list[int] = []
        children: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            children.setdefault(p, []).append(i)

        def visit(node: int) -> None:
            for child in children.get(node, []):
                if self.m.accept_token(drafts[child]):
                    keep.append(child)
                    if not self.m.is_terminated():  # after a stop token, nothing follows
                        visit(child)
                    self.m.rollback(1)
        visit(-1)
        keep.sort()  # parents stay before children
        new_index = {old: new for new, old in enumerate(keep)}
        return ([drafts[i] for i in keep], [new_index.get(parents[i], -1) for i in keep],
                [keys[i] for i in keep])

    def forced_tree(self, budget: int) -> tuple[list[int], list[int]]:
        """The ways to write the text the grammar forces next, as a draft tree of at most
        `budget` nodes, level by level (tokens, parents: -1 the root, else an earlier node). The
        target picks its own tokenization of forced text (a masked model may spell a key it
        does not know a few letters at a time), so every tokenization near the root is drafted,
        the longest tokens first."""
        text = self.m.find_jump_forward_string().encode("utf-8")
        tokens: list[int] = []
        parents: list[int] = []
        level = [(-1, 0)]  # (node, bytes of the text it covers)
        while level and len(tokens) < budget:
            nxt = []
            for node, at in level:
                for end in range(min(len(text), at + self.longest), at, -1):
                    token = self.token_of.get(text[at:end])
                    if token is None:
                        continue
                    if len(tokens) == budget:
                        return tokens, parents
                    tokens.append(token)
                    parents.append(node)
                    nxt.append((len(tokens) - 1, end))
            level = nxt
        return tokens, parents


def _copy_subtree(children: dict, node: int, out, row: int) -> None:
    for child in children.get(node, []):
        out[1 + child] = out[row]
        _copy_subtree(children, child, out, row)

"""The offline instruction sets of the head's training data."""
from __future__ import annotations

from eagle_serve import paths
from eagle_serve.train.prompts import build_prompts
from eagle_serve.train.prompts_chat import chat_prompts
from eagle_serve.train.prompts_more import _words, extended_prompts


def test_the_extended_set_is_new_text_and_the_same_for_a_seed():
    extended = extended_prompts(0, paths.HELDOUT_PROMPTS)
    base = set(build_prompts(0, paths.HELDOUT_PROMPTS)) | set(build_prompts(1, paths.HELDOUT_PROMPTS))
    assert len(extended) > 5000 and len(set(extended)) == len(extended)
    assert not set(extended) & base
    assert extended == extended_prompts(0, paths.HELDOUT_PROMPTS)


def test_the_extended_set_leaves_out_what_the_held_out_prompts_are_about():
    everything = set(extended_prompts(0, None))
    kept = set(extended_prompts(0, paths.HELDOUT_PROMPTS))
    held = paths.read_prompts(paths.HELDOUT_PROMPTS)
    assert not kept & {p.strip() for p in held}
    dropped = everything - kept
    assert "What is the capital of France?" in dropped  # held out: the capital of Australia
    assert "What should I pack for a ski trip?" in dropped  # held out: packing for a hiking trip
    assert "Give a recipe for pancakes." in kept
    assert all(any(_words(p) & _words(h) for h in held) for p in dropped)


def test_the_chat_set_is_new_text_away_from_the_held_out_prompts_and_the_same_for_a_seed():
    chat = chat_prompts(0, paths.HELDOUT_PROMPTS)
    others = (set(build_prompts(0, paths.HELDOUT_PROMPTS)) | set(build_prompts(1, paths.HELDOUT_PROMPTS))
              | set(extended_prompts(0, paths.HELDOUT_PROMPTS)))
    assert len(chat) > 5000 and len(set(chat)) == len(chat)
    assert not set(chat) & others
    assert chat == chat_prompts(0, paths.HELDOUT_PROMPTS)
    held = paths.read_prompts(paths.HELDOUT_PROMPTS)
    dropped = set(chat_prompts(0, None)) - set(chat)
    assert "What are the pros and cons of hiking?" in dropped  # held out: packing for a hiking trip
    assert all(any(_words(p) & _words(h) for h in held) for p in dropped)


def test_the_corpus_command_knows_every_prompt_set():
    from eagle_serve.train.__main__ import PROMPT_SETS, prompt_set
    assert prompt_set("chat") is chat_prompts and prompt_set("extended") is extended_prompts
    assert prompt_set("base") is build_prompts and set(PROMPT_SETS) == {"base", "extended", "chat"}

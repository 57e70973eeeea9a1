"""A diverse instruction set assembled offline, for self-distillation of a drafter.

Three sources, no hub: templated requests over embedded topic lists (chat-style tasks: explain,
list, write, compare, advise, code, math), the Python standard library's own docstrings
(summarise / explain code), and the language reference topics shipped with Python
(`pydoc_data`). Deterministic for a seed. Prompts that appear in a held-out file are removed.
"""
from __future__ import annotations

import importlib
import random
import re
from pathlib import Path

from eagle_serve.paths import read_prompts

TOPICS = """the ocean|volcanoes|the moon|black holes|photosynthesis|the water cycle|rainbows|earthquakes|
the immune system|the human heart|sleep|dreams|memory|honey bees|ants|octopuses|whales|wolves|elephants|
penguins|dinosaurs|fossils|the Roman Empire|ancient Egypt|the printing press|the internet|electricity|
magnets|gravity|light|sound|the seasons|climate change|recycling|solar power|wind turbines|batteries|
electric cars|trains|bicycles|airplanes|rockets|satellites|the stock market|inflation|budgeting|
saving money|taxes|coffee|tea|bread|chocolate|pizza|rice|cheese|vegetables|cooking pasta|baking a cake|
gardening|houseplants|trees|forests|deserts|mountains|rivers|islands|cities|villages|libraries|museums|
friendship|kindness|patience|courage|honesty|teamwork|leadership|time management|procrastination|
learning a language|reading books|writing poetry|painting|photography|music|the piano|the guitar|jazz|
chess|soccer|basketball|running|swimming|yoga|meditation|stress|exercise|healthy eating|vitamins|
the brain|neurons|DNA|evolution|cells|bacteria|viruses|vaccines|antibiotics|robots|artificial intelligence|
machine learning|computers|programming|databases|algorithms|sorting|recursion|encryption|passwords|
spreadsheets|email|smartphones|video games|social media|newspapers|democracy|elections|human rights|
the United Nations|maps|compasses|clocks|calendars|the number zero|prime numbers|fractions|geometry|
triangles|circles|probability|statistics|weather forecasts|clouds|snow|thunderstorms|hurricanes|
a rainy day|a lost key|a haunted house|a dragon|a wizard|a detective|a spaceship|a talking cat|
a lighthouse|a train journey|a birthday party|a job interview|moving to a new city|the first day of school|
a picnic|a thunderstorm at night|an old map|a time machine|a small bakery|a friendly robot""".replace("\n", "").split("|")

TASKS = """make a cup of tea|learn to code|write a good essay|prepare for an exam|start running|sleep better|
save money each month|organize a small party|plant tomatoes|clean a laptop keyboard|make new friends|
give a short speech|focus while studying|cook rice|change a bike tire|write a cover letter|keep a journal|
reduce screen time|learn to draw|choose a good book|plan a weekend trip|fix a slow computer|
back up my photos|apologize to a friend|ask for a raise|stay motivated|remember names|learn to swim|
wake up early|set goals for the year""".replace("\n", "").split("|")

PAIRS = [("cats", "dogs"), ("tea", "coffee"), ("trains", "planes"), ("books", "movies"),
         ("Python", "JavaScript"), ("summer", "winter"), ("cities", "the countryside"),
         ("lists", "tuples"), ("renting", "buying a home"), ("email", "phone calls"),
         ("running", "cycling"), ("the sun", "the moon"), ("paper books", "e-readers"),
         ("RAM", "disk storage"), ("weather", "climate"), ("viruses", "bacteria")]

CODE_TASKS = """reverses a string|checks whether a number is prime|returns the largest item of a list|
counts the vowels in a word|computes the factorial of n|merges two sorted lists|removes duplicates from a list|
converts Celsius to Fahrenheit|checks whether a word is a palindrome|sums the digits of a number|
finds the average of a list of numbers|returns the n-th Fibonacci number|sorts a list of names|
counts how often each word appears in a text|flattens a nested list|reads a file and counts its lines""".replace("\n", "").split("|")

TEMPLATES = [
    "What is {t}?", "Explain {t} to a ten-year-old.", "Give me three interesting facts about {t}.",
    "Write a short poem about {t}.", "Write a four-line poem about {t}.",
    "Write a short story about {t}.", "Describe {t} in one paragraph.",
    "Why is {t} important?", "What are the pros and cons of {t}?",
    "Write a haiku about {t}.", "Summarize what people should know about {t}.",
    "Tell me a fun fact about {t}.", "How would you explain {t} in simple words?",
    "Write a short blog post introduction about {t}.", "List five words related to {t}.",
    "Write a tweet about {t}.", "What questions do children often ask about {t}?",
    "Write a short dialogue between two friends about {t}.",
]


def templated(rng: random.Random) -> list[str]:
    out = [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    out += [f"How do I {x}?" for x in TASKS] + [f"Give me tips to {x}." for x in TASKS]
    out += [f"Write a step-by-step guide to {x}." for x in TASKS]
    out += [f"Compare {a} and {b}." for a, b in PAIRS] + [f"What is the difference between {a} and {b}?" for a, b in PAIRS]
    out += [f"Write a Python function that {c}." for c in CODE_TASKS]
    out += [f"Explain how to write a program that {c}." for c in CODE_TASKS]
    for _ in range(150):
        a, b = rng.randint(2, 999), rng.randint(2, 99)
        out.append(rng.choice([f"What is {a} plus {b}?", f"What is {a} times {b}?",
                               f"What is {a} minus {b}?", f"Is {a} an even number?",
                               f"If I have {a} apples and give away {b}, how many are left?"]))
    return out


DOC_MODULES = ("builtins", "math", "os.path", "json", "random", "itertools", "collections",
               "re", "string", "statistics", "datetime", "functools", "shutil", "textwrap",
               "heapq", "bisect", "fractions", "decimal", "operator", "pathlib", "csv", "glob",
               "time", "calendar", "difflib", "secrets", "hashlib", "base64", "zlib", "copy")


def stdlib_docstrings(limit: int, rng: random.Random) -> list[str]:
    """Explain/summarise prompts from the docstrings of the standard library's functions."""
    docs = []
    for mod in DOC_MODULES:
        module = importlib.import_module(mod)
        for name in sorted(dir(module)):
            obj = getattr(module, name, None)
            doc = getattr(obj, "__doc__", None)
            if callable(obj) and isinstance(doc, str) and 40 < len(doc) < 600 and not name.startswith("_"):
                docs.append((f"{mod}.{name}", " ".join(doc.split())))
    rng.shuffle(docs)
    forms = ["Explain what the Python function {n} does: {d}",
             "Summarize this documentation in one sentence: {d}",
             "Rewrite this description in plain English: {d}"]
    return [rng.choice(forms).format(n=n, d=d) for n, d in docs[:limit]]


def language_topics(limit: int, rng: random.Random) -> list[str]:
    from pydoc_data.topics import topics
    out = []
    for text in topics.values():
        paragraphs = [" ".join(p.split()) for p in re.split(r"\n\s*\n", text)]
        out += [f"Explain this passage about Python: {p}" for p in paragraphs if 80 < len(p) < 500]
    rng.shuffle(out)
    return out[:limit]


def build_prompts(seed: int = 0, heldout: Path | None = None, docstrings: int = 800,
                  language: int = 300) -> list[str]:
    rng = random.Random(seed)
    prompts = templated(rng) + stdlib_docstrings(docstrings, rng) + language_topics(language, rng)
    banned = set()
    if heldout is not None and Path(heldout).exists():
        banned = {p.strip() for p in read_prompts(heldout)}
    unique = sorted({p.strip() for p in prompts} - banned)
    rng.shuffle(unique)
    return unique

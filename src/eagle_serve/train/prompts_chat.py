"""A third instruction set, disjoint from the other two: the extended set's subjects asked in other
forms (pros and cons, how it works, haiku, dialogue, riddle, ...), and further chat requests
(advice, comparisons, rewriting, notes and messages, definitions, ideas), so the corpus of the
target's own answers, which the server's corpus lookup drafts from, covers more of what users ask.

Held-out prompts stay held out as in `prompts_more`: a prompt about what a held-out prompt is
about (half or more of its subject words in it) is dropped.
"""
from __future__ import annotations

import random
from pathlib import Path

from eagle_serve.train.prompts_more import SUBJECTS, _away_from, _split

FORMS = ["What are the pros and cons of {t}?", "What is the science behind {t}?", "Write a haiku about {t}.",
         "Give me five interesting questions to ask about {t}.", "Write a tweet about {t}.",
         "What would the world be like without {t}?", "Write a short dialogue between two friends about {t}.",
         "What are three fun facts about {t} for kids?", "Write a riddle about {t}.",
         "Describe {t} in one paragraph.", "What makes {t} important?", "What is the future of {t}?",
         "Write a motivational quote inspired by {t}.", "Create a short lesson plan about {t}.",
         "What questions do people often ask about {t}?", "List five words related to {t}.",
         "Write a newspaper headline about {t}.", "What is a good book title about {t}?"]

GOALS = _split("""sleep better|save money on groceries|stop procrastinating|wake up earlier|drink less coffee|
make friends in a new city|be more productive in the morning|keep my desk tidy|remember people's names|
stay focused while studying|feel less stressed at work|eat more vegetables|spend less time on my phone|
write better emails|become a better listener|prepare for a long flight|keep my plants alive in winter|
cook healthy meals on a budget|learn to swim as an adult|get better at math|improve my posture|
stay warm in a cold apartment|make my home smell nice|be on time more often|organize my photos|
keep a conversation going|say no politely|ask for a raise|handle a difficult coworker|
plan a surprise party|choose a good laptop|keep my car clean|reduce my energy bill|
get back into reading|stick to an exercise routine|calm down before an exam|
teach my child to ride a bike|make my own bread|clean my oven|care for a new puppy""")

ADVICE_FORMS = ["How can I {t}?", "What is the easiest way to {t}?", "Give me a simple plan to {t}.",
                "What are some tips to {t}?"]

PAIRS = _split("""sleet and hail|a lake and a pond|a hurricane and a tornado|a frog and a toad|
a crocodile and an alligator|a moth and a butterfly|a rabbit and a hare|a violin and a viola|
a city and a town|a mountain and a hill|an ocean and a sea|a star and a planet|
a fruit and a vegetable|baking soda and baking powder|a latte and a cappuccino|jam and jelly|
a laptop and a tablet|RAM and storage|a router and a modem|an email and a letter|
a novel and a short story|a poem and a song|a museum and a gallery|a democracy and a monarchy|
a loan and a gift|saving and investing|a job and a career|a hobby and a passion|
speed and velocity|weight and mass|an apology and an excuse|a habit and a routine""")

SENTENCES = _split("""hey, can u send me the file asap|the meeting got moved to friday i think|
i cant come tomorrow sorry|this product is really bad and i want my money back|
we should maybe think about changing the plan|your report was good but too long|
thanks for the help yesterday it was great|the food was cold and the waiter was rude|
i finished the project early so whats next|please dont park in front of my garage|
the printer is broken again|can we talk about my schedule next week|
i loved the book you gave me|the train was late so i missed the start|
our team won the game last night""")

REWRITES = ["Rewrite this sentence to sound more formal: '{t}'", "Fix the grammar in this sentence: '{t}'",
            "Rewrite this sentence to sound friendlier: '{t}'"]

RECIPIENTS = _split("""my teacher at the end of the year|a friend who helped me move|my neighbor who watered my plants|
a nurse who cared for my father|a coworker who covered my shift|my grandmother for a birthday gift|
a coach after a great season|a host after a dinner party|a mentor who gave me advice|
a bus driver who found my wallet|a volunteer at the animal shelter|a doctor after a surgery""")

NOTES = ["Write a thank-you note to {t}.", "Write a short card message to {t}."]

WORDS = _split("""serendipity|resilience|nostalgia|empathy|curiosity|ambiguity|irony|metaphor|
algorithm|ecosystem|inflation|photosynthesis|gravity|democracy|entropy|evolution|
procrastination|mindfulness|sustainability|biodiversity|renaissance|philosophy|etiquette|
hospitality|innovation|integrity|patience|perspective|tradition|wanderlust""")

DEFINE_FORMS = ["What does the word '{t}' mean? Use it in a sentence.", "Define '{t}' in simple words."]

OCCASIONS = _split("""a rainy Sunday|a child's birthday party|a team building day|a first date|
a family reunion|a long weekend at home|a school science fair|a summer evening in the garden|
a winter holiday with no snow|a retirement party|a book club meeting|a picnic in the park""")

IDEA_FORMS = ["Give me five ideas for {t}.", "Plan a fun schedule for {t}."]


def chat_prompts(seed: int = 0, heldout: Path | None = None) -> list[str]:
    """The third set, deduplicated, near-held-out prompts dropped, shuffled for `seed`."""
    families = [(SUBJECTS, FORMS), (GOALS, ADVICE_FORMS), (SENTENCES, REWRITES), (RECIPIENTS, NOTES),
                (WORDS, DEFINE_FORMS), (OCCASIONS, IDEA_FORMS)]
    out = [form.format(t=t) for items, forms in families for t in items for form in forms]
    out += [f"What is the difference between {pair}?" for pair in PAIRS]
    out += [f"Which is better for a beginner, {one} or {other}? Explain."
            for one, other in (pair.split(" and ") for pair in PAIRS[:12])]
    return _away_from(sorted(set(out)), heldout, random.Random(seed))

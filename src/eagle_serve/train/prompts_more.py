"""A second instruction set, disjoint from `prompts.build_prompts`: new subjects and the everyday
request forms of chat traffic (tips, recipes, emails, translations, plots, packing lists, unit
arithmetic, names for things, capitals), so more distinct prompts reach the head's training data.

Every prompt here is new text; one too close to a held-out prompt (half or more of its subject
words in it) is dropped, so the held-out evaluation stays held out.
"""
from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

from eagle_serve.paths import read_prompts


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.replace("\n", "").split("|") if s.strip()]


SUBJECTS = _split("""glaciers|coral reefs|tides|the northern lights|comets|meteors|the sun|Mars|Jupiter|
Saturn's rings|eclipses|the Milky Way|telescopes|microscopes|atoms|molecules|chemical reactions|acids and bases|
rust|plastic|glass|paper making|cotton|wool|silk|leather|concrete|bridges|skyscrapers|tunnels|dams|canals|
lighthouses|castles|pyramids|the Great Wall of China|the Silk Road|the Renaissance|the Industrial Revolution|
the Vikings|ancient Greece|the Olympic Games|the Middle Ages|knights|pirates|explorers|maps of the world|
the telephone|the radio|television|cameras|the light bulb|the steam engine|the wheel|writing systems|
alphabets|dictionaries|grammar|punctuation|poetry forms|fairy tales|myths|legends|folk music|opera|
the violin|drums|choirs|dance|ballet|theater|cinema|animation|comics|board games|card games|puzzles|
crosswords|origami|knitting|pottery|woodworking|camping|hiking|fishing|sailing|surfing|skiing|tennis|
golf|cricket|baseball|the marathon|cycling races|chess openings|weightlifting|stretching|posture|
drinking water|breakfast|sugar|salt|spices|fruit|apples|bananas|oranges|potatoes|beans|soup|salads|
sandwiches|noodles|sushi|tacos|curry|dumplings|pancakes|cookies|ice cream|yogurt|eggs|milk|olive oil|
frogs|owls|eagles|parrots|sharks|dolphins|jellyfish|butterflies|spiders|snakes|turtles|horses|cows|
sheep|goats|rabbits|squirrels|bats|foxes|bears|tigers|lions|giraffes|zebras|kangaroos|koalas|camels|
cactuses|mushrooms|moss|seeds|flowers|roses|sunflowers|bamboo|rainforests|wetlands|grasslands|caves|
waterfalls|lakes|the Arctic|Antarctica|the Sahara|the Amazon river|the Alps|the Himalayas|
soil|compost|pollution|air quality|noise|light pollution|endangered species|national parks|zoos|
farming|fishing boats|supermarkets|shopping online|delivery trucks|ports|airports|traffic lights|
road safety|public transport|buses|subways|taxis|maps apps|GPS|Wi-Fi|Bluetooth|cloud storage|
web browsers|search engines|open source software|operating systems|keyboards|printers|USB drives|
spam email|online privacy|cookies on websites|two-factor authentication|backups|computer viruses|
version control|unit tests|debugging|APIs|JSON|HTML|CSS|SQL|the command line|Linux|compilers|
binary numbers|hexadecimal|logic gates|memory chips|graphics cards|batteries in phones|smart watches|
3D printing|drones|virtual reality|self-driving cars|space stations|the Mars rovers|weather balloons|
banks|credit cards|loans|interest rates|insurance|retirement savings|small businesses|marketing|
advertising|customer service|job interviews|resumes|working from home|meetings|deadlines|
negotiation|public speaking|feedback|mentoring|volunteering|charity|community gardens|neighbors|
family dinners|grandparents|siblings|pets|adopting a dog|caring for a cat|goldfish|birdwatching|
stargazing|journaling|minimalism|decluttering|moving house|painting a room|fixing a leaky tap|
doing laundry|ironing|sewing a button|grocery lists|meal planning|leftovers|food waste|
first aid|colds and flu|headaches|sunburn|allergies|dental care|eye care|hearing|hand washing|
happiness|gratitude|curiosity|creativity|boredom|anger|fear|loneliness|confidence|habits|
motivation|routines|goals|failure|success|luck|risk|trust|fairness|rules|laws|courts|taxes and roads|
voting|local government|newspapers and news|libraries of the future|schools|homework|exams|
teachers|universities|scholarships|online courses|typing|handwriting|speed reading|note taking""")

FORMS = ["What is {t}?", "Explain {t} in simple terms.", "Give me three facts about {t}.",
         "Write a limerick about {t}.", "Write a short poem about {t}.",
         "Tell me a short story that involves {t}.", "Describe {t} to someone who has never seen it.",
         "What are common misconceptions about {t}?", "Why do people care about {t}?",
         "Write a short paragraph about the history of {t}.", "What is the most surprising thing about {t}?",
         "Explain {t} to a five-year-old.", "Give me a quiz question about {t} with the answer.",
         "Write a product description for a book about {t}.", "Summarize {t} in two sentences."]

ACTIVITIES = _split("""baking bread|learning chess|growing herbs indoors|running a 5k|learning the piano|
drawing portraits|taking better photos|writing a novel|learning Spanish|studying math|public speaking|
keeping houseplants alive|saving for a holiday|cooking for one|cleaning the kitchen|packing a suitcase|
sleeping on a plane|starting a blog|making a budget|learning to type faster|staying hydrated|
reading more books|improving handwriting|learning to juggle|training a puppy|riding a bike in the city|
making coffee at home|hosting a dinner party|studying for a driving test|writing a speech|
meeting new people|working at a desk all day|camping with kids|painting with watercolors|
learning to knit|organizing a closet|cutting down on sugar|keeping a garden|using a spreadsheet|
memorizing vocabulary|walking more each day|writing clean code|preparing for a job interview""")

DISHES = _split("""pancakes|vegetable soup|banana bread|fried rice|lentil curry|guacamole|scrambled eggs|
a fruit salad|chocolate chip cookies|lemonade|a grilled cheese sandwich|mashed potatoes|
roasted vegetables|hummus|a simple omelette|oatmeal|chicken noodle soup|apple pie|garlic bread|
a green smoothie|tomato soup|potato salad|spaghetti with meatballs|a vegetable stir fry|
homemade pizza dough|rice pudding|a bean chili|pesto|a cucumber salad|iced tea""")

COUNTRIES = _split("""France|Japan|Canada|Brazil|Egypt|Kenya|India|Mexico|Norway|Italy|Spain|Germany|
Argentina|Chile|Peru|Greece|Turkey|Thailand|Vietnam|South Korea|Nigeria|Morocco|Sweden|Finland|
Ireland|Portugal|Poland|New Zealand|Indonesia|the Philippines|Colombia|Ghana|Iceland|Switzerland""")

WORKS = _split("""Hamlet|Macbeth|The Odyssey|Pride and Prejudice|Moby-Dick|Frankenstein|Dracula|
Alice's Adventures in Wonderland|The Little Prince|Treasure Island|Robinson Crusoe|Don Quixote|
A Christmas Carol|The Wizard of Oz|Peter Pan|Little Women|The Jungle Book|Gulliver's Travels|
Cinderella|Snow White|The Three Little Pigs|Jack and the Beanstalk|The Tortoise and the Hare|
The Ugly Duckling|Sherlock Holmes's first case|Around the World in Eighty Days""")

PHRASES = _split("""Where is the train station?|Thank you very much.|I would like a cup of coffee.|
What time is it?|Happy birthday!|How much does this cost?|I am learning a new language.|
Can you help me, please?|The weather is nice today.|See you tomorrow.|I love reading books.|
Where is the nearest pharmacy?|My name is Anna.|Good night and sleep well.|I am sorry I am late.""")

LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]

TRIPS = _split("""a week at the beach|a weekend in a big city|a ski trip|a business trip|a summer camp|
a long train journey|a camping trip in the forest|a winter visit to family|a cruise|a road trip|
a day at an amusement park|a school trip to a museum|a fishing trip|a bike tour|a music festival""")

EMAILS = _split("""a neighbor to turn down loud music|a teacher for an extension on homework|
a landlord to fix the heating|a friend to return a borrowed book|a manager for a day off|
a shop about a late delivery|a client to confirm an appointment|a team to share their ideas|
a colleague to review a report|a coach about missing practice|a hotel about an early check-in|
a company about a job opening|a library to renew a book|a plumber for a quote""")

BUSINESSES = _split("""a coffee shop|a bookshop|a flower shop|a bike repair shop|a pet grooming salon|
an ice cream parlor|a yoga studio|a food truck|a toy store|a tea room|a cleaning company|a tutoring service|
a vegan restaurant|a music school|a dog walking business|a plant nursery|a pizza place|a bakery""")

SPECIALTIES = ["is run by two sisters", "is open late at night", "is next to the sea",
               "sells only local products", "is aimed at children", "has a retro style"]

ORDERED = _split("""the days of the week|the months of the year|the continents by size|the seasons|
the colors of the rainbow|the steps of the scientific method|the stages of a butterfly's life|
the largest oceans|the first five US presidents|the notes of a musical scale|the phases of the moon""")

UNITS = [("seconds", "an hour"), ("hours", "a year"), ("days", "a leap year"), ("minutes", "a day"),
         ("centimeters", "a kilometer"), ("grams", "a kilogram"), ("milliliters", "two liters"),
         ("inches", "a yard"), ("weeks", "a year"), ("seconds", "a day"), ("months", "ten years"),
         ("meters", "three kilometers"), ("hours", "two weeks"), ("days", "five weeks")]


def extended_prompts(seed: int = 0, heldout: Path | None = None) -> list[str]:
    """The second set, deduplicated, near-held-out prompts dropped, shuffled for `seed`."""
    rng = random.Random(seed)
    families = [
        (SUBJECTS, FORMS),
        (ACTIVITIES, ["Give me three tips for {t}.", "What mistakes do beginners make when {t}?",
                      "How do I get started with {t}?", "Make a one-week plan for {t}."]),
        (DISHES, ["Give a recipe for {t}.", "What ingredients do I need for {t}?",
                  "How long does it take to make {t}?"]),
        (COUNTRIES, ["What is the capital of {t}?", "Tell me three things {t} is known for.",
                     "What language is spoken in {t}?", "Plan a three-day visit to {t}."]),
        (WORKS, ["Summarize the story of {t} in three sentences.", "Who are the main characters in {t}?",
                 "What lesson does {t} teach?"]),
        (PHRASES, [f"Translate '{{t}}' into {lang}." for lang in LANGUAGES]),
        (TRIPS, ["What should I pack for {t}?", "Write a checklist for {t}."]),
        (EMAILS, ["Write a short, polite email asking {t}.", "Write a friendly text message asking {t}."]),
        (BUSINESSES, [f"Suggest a name for {{t}} that {s}." for s in SPECIALTIES]),
        (ORDERED, ["List {t} in order."]),
    ]
    out = [form.format(t=t) for items, forms in families for t in items for form in forms]
    for small, big in UNITS:
        out += [f"How many {small} are there in {big}? Show your working.",
                f"Explain how to work out the number of {small} in {big}."]
    for _ in range(300):
        a, b, c = rng.randint(3, 60), rng.randint(2, 12), rng.randint(2, 9)
        out.append(rng.choice([
            f"A shop sells pens at {b} dollars each. How much do {a} pens cost?",
            f"A train travels {a * c} kilometers in {c} hours. What is its average speed?",
            f"Tom has {a} marbles and buys {b} bags of {c} marbles. How many does he have now?",
            f"What is {a * b} divided by {b}? Explain the steps.",
            f"If a recipe needs {c} eggs for {b} people, how many eggs are needed for {a} people?"]))
    return _away_from(sorted(set(out)), heldout, rng)


def _away_from(prompts: list[str], heldout: Path | None, rng: random.Random) -> list[str]:
    """Drop prompts about what a held-out prompt is about (half or more of their subject words
    in it: the words of fewer than 1% of the prompts, i.e. not the forms' words); shuffle."""
    held = [_words(p) for p in read_prompts(heldout)] if heldout and Path(heldout).exists() else []
    counts = Counter(w for p in prompts for w in _words(p))
    common = {w for w, n in counts.items() if n > 0.01 * len(prompts)}
    kept = []
    for p in prompts:
        subject = _words(p) - common
        if not any(len(subject & h) * 2 >= max(len(subject), 1) for h in held if subject & h):
            kept.append(p)
    rng.shuffle(kept)
    return kept


STOPWORDS = set("a an the of in on to for and or is are what how why who me my i you it its "
                "about with that this do does".split())


def _words(text: str) -> set[str]:
    """The words of a prompt, without the stopwords."""
    return set(re.findall(r"[a-z']+", text.lower())) - STOPWORDS

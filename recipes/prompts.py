"""A chat prompt set the project builds itself (no hub dataset, no download): hand-written task
templates × topics × answer styles, in a fixed order, split into train and held-out prompts by a
hash of each prompt's text.

``linearize generate-data`` answers the ``split="train"`` prompts with the teacher to make chat
training data; the ``split="held_out"`` prompts never reach training and serve the evaluation
(``linearize generate-data --write-prompts held_out.jsonl --split held_out``).

A prompt is a ``Prompt(text, task, topic, domain)``; ``task`` names the template family and
``domain`` the topic's field, so a sample's spread over both can be counted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

from .data import is_held_out

HELD_OUT_PERCENT = 5.0
SPLITS = ("train", "held_out", "all")


@dataclass(frozen=True)
class Prompt:
    text: str
    task: str
    topic: str
    domain: str


# ---------------------------------------------------------------- topics, by kind and domain
# Each kind fits one grammatical slot: a concept ("Explain {}"), a subject ("a poem about {}"), a pair
# ("Compare {}"), an activity ("How do I {}?"), a situation ("an email {}"), a list ("List five {}").

CONCEPTS = {
    "science": "photosynthesis; the water cycle; gravity; black holes; plate tectonics; DNA replication; the greenhouse "
               "effect; evolution by natural selection; the immune system; vaccines; electricity; magnetism; the speed "
               "of light; atoms and molecules; chemical reactions; the periodic table; climate change; ocean tides; "
               "the seasons; rainbows; volcanoes; earthquakes; the Big Bang; the solar system; antibiotics; viruses; "
               "entropy; sound waves; nuclear fusion; the carbon cycle; cell division; enzymes",
    "technology": "the internet; search engines; encryption; cloud computing; machine learning; neural "
                  "networks; blockchain; GPS; Wi-Fi; solar panels; electric cars; 3D printing; batteries; touchscreens; "
                  "smartphones; compression of files; open-source software; two-factor authentication; a computer's "
                  "memory; operating systems",
    "programming": "recursion; variables; loops; functions; object-oriented programming; version control with git; "
                   "unit testing; a hash table; binary search; sorting algorithms; APIs; databases; SQL joins; regular "
                   "expressions; exceptions and error handling; Python lists and dictionaries; asynchronous code; "
                   "big-O notation; code review; debugging; compilers and interpreters; JSON",
    "history": "the Roman Empire; the Renaissance; the Industrial Revolution; the printing press; the French "
               "Revolution; ancient Egypt; the Silk Road; the Cold War; the first moon landing; the fall of the Berlin "
               "Wall; the invention of writing; the Black Death; the age of exploration; ancient Greek democracy; the "
               "abolition of slavery; the history of the bicycle; the invention of the telephone; the Maya civilization",
    "economics": "inflation; compound interest; supply and demand; a budget; taxes; the stock market; interest rates; "
                 "credit scores; index funds; an emergency fund; opportunity cost; trade between countries; "
                 "unemployment; a mortgage; insurance",
    "health": "sleep; hydration; a balanced diet; stretching; stress; the benefits of walking; vitamins; good posture; "
              "screen time and eyes; heart health; mental health; first aid for a small cut; seasonal allergies; "
              "the common cold; meditation; hand washing",
    "society": "democracy; the rule of law; free speech; recycling; volunteering; public libraries; urban planning; "
               "remote work; social media; misinformation; privacy; human rights; the role of museums; community "
               "gardens; public transport",
    "language and arts": "metaphors; the structure of a sonnet; impressionist painting; jazz; the hero's journey; "
                         "active and passive voice; persuasive writing; photography composition; the history of the "
                         "novel; film editing; rhyme and rhythm; irony; world mythology",
    "nature": "bees and pollination; bird migration; coral reefs; rainforests; how trees grow; the life of a butterfly; "
              "deserts; wolves and their packs; mushrooms; ocean currents; composting; wetlands; endangered species; "
              "the food chain",
    "mathematics": "prime numbers; probability; fractions; percentages; the Pythagorean theorem; statistics and the "
                   "mean; negative numbers; geometry of circles; exponential growth; logic puzzles; graphs and charts; "
                   "algebra",
}

SUBJECTS = {
    "everyday life": "a rainy Monday morning; a lost umbrella; the first day at a new school; a neighbour's dog; a "
                     "birthday surprise; a broken alarm clock; moving to a new city; a quiet Sunday; a long train "
                     "journey; grandmother's kitchen",
    "nature": "the first snow of winter; an old oak tree; the sea at night; a mountain sunrise; autumn leaves; a "
              "hummingbird; a thunderstorm; the desert after rain; a field of sunflowers; a river",
    "fantasy": "a dragon who is afraid of fire; a lighthouse keeper; a robot learning to paint; a talking cat; a "
               "library that never closes; a time traveller's mistake; a map to nowhere; a friendly ghost; a city "
               "under the sea; the last star in the sky",
    "work": "a team that finishes a hard project; a job interview; an inventor's first success; a teacher's last "
            "class; a chef's busiest night; a nurse on the night shift; a small bakery opening",
    "feelings": "friendship; hope; homesickness; courage; patience; gratitude; a second chance; kindness from a "
                "stranger; growing up; forgiveness",
}

PAIRS = {
    "everyday life": "tea and coffee; cats and dogs as pets; renting and buying a home; city life and country life; "
                     "paper books and e-readers; cycling and driving to work; morning and evening exercise; cooking at "
                     "home and eating out",
    "technology": "laptops and desktop computers; email and instant messaging; SSDs and hard drives; Android and "
                  "iOS; streaming and buying music",
    "programming": "Python and JavaScript; lists and tuples in Python; SQL and NoSQL databases; tabs and spaces; "
                   "compiled and interpreted languages; git merge and git rebase; a stack and a queue",
    "science": "weather and climate; viruses and bacteria; mitosis and meiosis; speed and velocity; weight and mass; "
               "renewable and fossil energy",
    "history": "ancient Athens and Sparta; the Roman Republic and the Roman Empire; the first and second industrial "
               "revolutions",
    "economics": "saving and investing; stocks and bonds; credit cards and debit cards; fixed and variable interest "
                 "rates",
    "health": "running and swimming; yoga and pilates; a nap and a full night's sleep",
    "travel": "travelling by train and by plane; hotels and hostels; a beach holiday and a city break; travelling "
              "alone and in a group",
    "cooking": "baking and frying; butter and olive oil; fresh and dried herbs; brown and white rice",
}

ACTIVITIES = {
    "cooking": "bake a loaf of bread; make a vegetable soup; cook rice on the stove; make pancakes; plan meals for a "
               "week; make a simple salad dressing; store fresh herbs; cook pasta properly; make a cup of good coffee; "
               "prepare a healthy lunch for work",
    "everyday life": "organise a small closet; keep houseplants alive; get up earlier; fix a squeaky door; clean a "
                     "kitchen quickly; save money on groceries; keep a journal; wrap a present neatly; change a flat "
                     "bicycle tyre; declutter a room",
    "travel": "pack a suitcase for a week; plan a road trip; avoid jet lag; travel on a small budget; find a good "
              "place to stay; prepare for a long flight; learn basic phrases before a trip; stay safe while travelling",
    "programming": "learn Python as a beginner; write a good commit message; read an error message; write a unit "
                   "test; reverse a string in Python; read a CSV file in Python; name variables well; start an "
                   "open-source contribution; structure a small project; find a bug in my code",
    "health": "start running; drink more water; sleep better; reduce stress before an exam; build a simple workout "
              "routine; eat more vegetables; take breaks from the screen; stretch after sitting all day",
    "work": "prepare for a job interview; write a cover letter; run a short meeting; give constructive feedback; "
            "manage my time; ask for a raise; learn a new skill quickly; work well in a team; write a clear report; "
            "give a presentation",
    "learning": "learn a new language; study for an exam; remember what I read; take good notes; learn to play the "
                "guitar; improve my handwriting; read more books; practise public speaking",
    "nature": "start a small vegetable garden; identify birds in my garden; go hiking safely; make compost at home; "
              "attract bees to a balcony; care for a tomato plant",
}

SITUATIONS = {
    "work": "asking my manager for a day off; thanking a colleague for their help; following up after a job "
            "interview; declining a meeting politely; introducing myself to a new team; asking for a deadline "
            "extension; welcoming a new employee; apologising for a late reply",
    "everyday life": "inviting friends to a dinner party; asking a neighbour to keep the noise down; thanking a "
                     "friend for a gift; cancelling a gym membership; complaining about a late delivery; congratulating "
                     "a friend on a new job; reminding my landlord about a repair",
    "learning": "asking a teacher for feedback on my essay; asking a professor about a research project; "
                "requesting a recommendation letter",
    "travel": "booking a table at a restaurant; asking a hotel about an early check-in; requesting a refund for a "
              "cancelled train",
}

LISTS = {
    "everyday life": "ways to save water at home; things to do on a rainy day; habits of organised people; tips for "
                     "a tidy desk; ideas for a birthday party; ways to be kinder to others",
    "science": "famous scientists and what they discovered; planets of the solar system and one fact about each; "
               "everyday uses of chemistry; simple science experiments for children",
    "cooking": "healthy breakfast ideas; vegetables that are easy to grow; spices and the dishes they suit; quick "
               "dinner ideas",
    "travel": "things to pack for a beach holiday; questions to ask before booking a hotel; ways to meet locals "
              "while travelling",
    "programming": "good practices for writing readable code; common Python mistakes; useful git commands; reasons "
                   "to write tests",
    "history": "important inventions of the last 200 years; ancient wonders of the world; famous explorers",
    "health": "signs of dehydration; benefits of regular exercise; foods rich in fibre; ways to relax in the evening",
    "work": "questions to ask at the end of an interview; ways to stay focused; skills every manager needs",
    "nature": "animals that live in the Arctic; trees that grow well in cities; flowers that attract butterflies",
    "language and arts": "classic novels worth reading; tips for writing a short story; famous painters and one "
                         "work by each",
}

# (sentence to work on, its domain): the rewrite, summary and classification tasks quote it
SENTENCES = [
    ("the meeting is moved to thursday because half the team is away and we dont have the numbers yet", "work"),
    ("I absolutely loved this restaurant, the food was fresh and the staff were so friendly!", "everyday life"),
    ("The package arrived three days late and the box was damaged.", "everyday life"),
    ("Our new app lets you track your spending and set monthly goals in a few taps.", "technology"),
    ("Photosynthesis is the process by which plants turn light, water and carbon dioxide into sugar and oxygen.",
     "science"),
    ("The hotel was okay, nothing special, but the location near the station was convenient.", "travel"),
    ("Please remember to submit your timesheets by Friday at noon.", "work"),
    ("The Roman Empire split into eastern and western halves, and the western half fell in 476.", "history"),
    ("i think we should maybe try to start the project earlier next time if thats ok with everyone", "work"),
    ("This laptop is fast, light and the battery lasts all day, but the keyboard feels cheap.", "technology"),
    ("The function returns None when the list is empty, which breaks the caller.", "programming"),
    ("Drinking water regularly helps your body control its temperature and keeps your joints working.", "health"),
    ("The film was far too long and the ending made no sense at all.", "language and arts"),
    ("Bees visit flowers to collect nectar and carry pollen from one plant to another.", "nature"),
    ("Interest rates rose again this quarter, making mortgages more expensive for new buyers.", "economics"),
    ("We regret to inform you that your order has been cancelled due to a payment issue.", "everyday life"),
    ("Add the flour slowly and keep stirring so that the sauce does not form lumps.", "cooking"),
    ("The train to the airport leaves every fifteen minutes from platform two.", "travel"),
    ("Our team won the regional championship after a season of hard training.", "everyday life"),
    ("The server crashed at midnight because the disk was full.", "programming"),
]

QUESTIONS = {  # factual questions, asked as they are
    "science": "Why is the sky blue?; How far is the Moon from the Earth?; What is the boiling point of water at sea "
               "level?; Why do we have leap years?; What causes thunder?; How do birds know where to migrate?; Why does "
               "ice float on water?; What is the largest planet in the solar system?; How do magnets work?; Why do "
               "leaves change colour in autumn?; What is a light-year?; How does a rainbow form?",
    "history": "Who invented the printing press?; When did the Second World War end?; Who was Cleopatra?; Why were "
               "the pyramids built?; What was the Silk Road?; Who was the first person to walk on the Moon?; What "
               "caused the fall of the Roman Empire?; Who was Ada Lovelace?",
    "geography": "What is the capital of France?; Which is the longest river in the world?; What is the largest "
                 "ocean?; Which country has the most people?; Where is Mount Kilimanjaro?; What is the capital of "
                 "Japan?; Which continent is Egypt in?; How many continents are there?; What is the smallest country "
                 "in the world?",
    "programming": "What does the Python keyword 'yield' do?; What is the difference between == and is in Python?; "
                   "What is a null pointer?; What does HTTP stand for?; What is a race condition?; Why are floating "
                   "point numbers imprecise?; What is a virtual environment in Python?",
    "everyday life": "How long should I boil an egg for a soft yolk?; How often should I water a cactus?; Why does "
                     "bread go stale?; How can I remove a coffee stain from a shirt?; Why do onions make you cry?",
    "health": "How much sleep does an adult need?; Why is breakfast called the most important meal?; What does "
              "protein do in the body?; How many steps a day is healthy?",
}


def _split(table: dict[str, str]) -> list[tuple[str, str]]:
    """(topic, domain) rows of a ``{domain: "a; b; c"}`` table."""
    return [(t.strip(), domain) for domain, text in table.items() for t in text.split(";") if t.strip()]


# ---------------------------------------------------------------- task templates

TASKS = {
    # task: (topic kind, templates)
    "explain": ("concept", ["Explain {}.", "Can you explain {} in simple terms?", "Walk me through {}.",
                            "What is {} and why does it matter?", "Help me understand {}.",
                            "I never understood {}. Could you explain?"]),
    "eli5": ("concept", ["Explain {} to a ten-year-old.", "Explain {} like I'm five.",
                         "How would you explain {} to a child?"]),
    "summarise": ("concept", ["Give me a short summary of {}.", "Summarise the key ideas of {}.",
                              "What are the three most important things to know about {}?"]),
    "misconception": ("concept", ["What are common misconceptions about {}?",
                                  "What do people often get wrong about {}?"]),
    "quiz": ("concept", ["Write three quiz questions about {}, with answers.",
                         "Ask me a question to test my understanding of {}."]),
    "analogy": ("concept", ["Give me an analogy that explains {}.", "Describe {} using an everyday comparison."]),
    "story": ("subject", ["Write a short story about {}.", "Tell me a story about {}.",
                          "Write a very short story (under 150 words) about {}.",
                          "Write the opening paragraph of a story about {}."]),
    "poem": ("subject", ["Write a short poem about {}.", "Write a haiku about {}.", "Write a four-line rhyme about {}.",
                         "Write a limerick about {}."]),
    "description": ("subject", ["Describe {} in vivid detail.", "Write a short descriptive paragraph about {}."]),
    "compare": ("pair", ["Compare {}.", "What are the main differences between {}?",
                         "What are the pros and cons of {}?", "Which is better for a beginner: {}? Explain.",
                         "Make a short comparison table of {}."]),
    "how-to": ("activity", ["How do I {}?", "Give me step-by-step instructions to {}.",
                            "What is the easiest way to {}?", "I want to {}. Where should I start?",
                            "Explain how to {} in five steps."]),
    "advice": ("activity", ["What are your best tips to {}?", "What mistakes should I avoid when I try to {}?",
                            "I keep failing to {}. Any advice?", "How can I {} if I only have a little time?"]),
    "email": ("situation", ["Write a short email {}.", "Write a polite message {}.",
                            "Draft a friendly text message {}.", "Write a formal letter {}."]),
    "list": ("list", ["List five {}.", "Give me a list of {}.", "What are some {}?", "Name three {}."]),
    "rewrite": ("sentence", ["Rewrite this sentence to be more formal: \"{}\"",
                             "Fix the grammar and punctuation: \"{}\"", "Make this shorter: \"{}\"",
                             "Rewrite this for a young reader: \"{}\"", "Rephrase this in a friendlier tone: \"{}\""]),
    "classify": ("sentence", ["Is the sentiment of this text positive, negative or neutral? \"{}\"",
                              "What is the topic of this sentence? \"{}\"",
                              "Classify this text as a complaint, a request, a fact or an opinion: \"{}\""]),
    "extract": ("sentence", ["What is the main point of this sentence? \"{}\"",
                             "Turn this into a question: \"{}\""]),
    "factual": ("question", ["{}"]),
}

STYLES = ["", " Keep it short.", " Answer in two or three sentences.", " Use bullet points.",
          " Be concise and clear.", " Explain your reasoning.", " Write it for a beginner.",
          " Use a friendly tone.", " Give one concrete example.", " Answer in one paragraph."]
# styles that do not fit a task (a bullet-pointed haiku, a two-sentence comparison table)
NO_STYLE = {"poem": {" Use bullet points.", " Answer in two or three sentences.", " Explain your reasoning.",
                     " Answer in one paragraph."},
            "list": {" Answer in two or three sentences.", " Answer in one paragraph."},
            "compare": {" Answer in two or three sentences."}, "email": {" Use bullet points.", " Explain your reasoning."},
            "quiz": {" Answer in two or three sentences.", " Answer in one paragraph."},
            "story": {" Use bullet points.", " Explain your reasoning.", " Answer in two or three sentences."},
            "description": {" Use bullet points.", " Explain your reasoning."}}

KINDS = {"concept": CONCEPTS, "subject": SUBJECTS, "pair": PAIRS, "activity": ACTIVITIES, "situation": SITUATIONS,
         "list": LISTS, "question": QUESTIONS}


def _topics(kind: str) -> list[tuple[str, str]]:
    if kind == "sentence":
        return list(SENTENCES)
    return _split(KINDS[kind])


@lru_cache(maxsize=1)
def _all_prompts() -> tuple[Prompt, ...]:
    seen, out = set(), []
    for task, (kind, templates) in TASKS.items():
        styles = [s for s in STYLES if s not in NO_STYLE.get(task, ())]
        for topic, domain in _topics(kind):
            for template in templates:
                body = template.format(topic)
                for style in styles:
                    text = body + style
                    if text not in seen:
                        seen.add(text)
                        out.append(Prompt(text, task, topic, domain))
    # a fixed order that mixes tasks and topics (by text hash): the first N prompts are as varied
    # as the whole set, and adding a template does not reorder the rest
    out.sort(key=lambda p: hashlib.sha256(p.text.encode()).digest())
    return tuple(out)


def is_held_out_prompt(text: str, percent: float = HELD_OUT_PERCENT) -> bool:
    """The held-out test of ``recipes/data.py`` (hash of the text), so a prompt's side never changes."""
    return is_held_out(text, percent)


def build_prompts(split: str = "train", percent: float = HELD_OUT_PERCENT) -> list[Prompt]:
    """The project's chat prompts of one split (``train``, ``held_out`` or ``all``), in a fixed order."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    prompts = list(_all_prompts())
    if split == "all":
        return prompts
    want = split == "held_out"
    return [p for p in prompts if is_held_out_prompt(p.text, percent) == want]


def heading_prompts(source: str, tokenizer=None, max_documents: int = 0) -> list[Prompt]:
    """Questions about a local corpus's section headings (Markdown ``#`` lines, reST underlined titles):
    "Explain <heading>." and two other phrasings per distinct heading, domain ``corpus``."""
    import re

    from .data import load_documents

    heads = []
    for doc in load_documents(source, tokenizer, max_documents):
        lines = doc.splitlines()
        for i, line in enumerate(lines):
            title = None
            m = re.match(r"#{1,4}\s+(.{4,80})$", line.strip())
            if m:
                title = m.group(1)
            elif (i + 1 < len(lines) and 4 <= len(line.strip()) <= 80 and re.fullmatch(r"[=\-~^]{4,}", lines[i + 1].strip())
                  and len(lines[i + 1].strip()) >= len(line.strip())):
                title = line.strip()
            if title and re.search(r"[A-Za-z]{3}", title):
                heads.append(title.strip(" #*`"))
    seen, out = set(), []
    for h in dict.fromkeys(heads):
        if len(h) > 1 and h[0].isupper() and h[1].islower():  # "Supported architectures" mid-sentence
            h = h[0].lower() + h[1:]
        for template in ("Explain {}.", "What should I know about {}?", "Give me a short overview of {}."):
            text = template.format(h)
            if text not in seen:
                seen.add(text)
                out.append(Prompt(text, "heading", h, "corpus"))
    return out

"""Writes prompts.txt: short chat questions from fixed templates and subjects (no randomness
beyond a seeded shuffle), one a line, for the routing-quality labels and curve.

    python integrations/tokencache_routing/data/make_prompts.py

Every line is a distinct question; labels.split_prompts keeps train and test prompts apart.
"""

from __future__ import annotations

import random
from pathlib import Path

COUNTRIES = [
    "France",
    "Japan",
    "Brazil",
    "Canada",
    "Egypt",
    "India",
    "Italy",
    "Kenya",
    "Mexico",
    "Norway",
    "Peru",
    "Spain",
    "Sweden",
    "Turkey",
    "Vietnam",
    "Germany",
    "Argentina",
    "Australia",
    "Greece",
    "Poland",
    "Portugal",
    "Chile",
    "Thailand",
    "Morocco",
    "Ireland",
]
THINGS = [
    "a bicycle",
    "the moon",
    "a volcano",
    "a library",
    "coffee",
    "a rainbow",
    "the ocean",
    "a computer",
    "a tree",
    "the sun",
    "a river",
    "bread",
    "a piano",
    "a city park",
    "snow",
    "a bridge",
    "honey",
    "a train",
    "the desert",
    "a garden",
    "a mountain",
    "tea",
    "a clock",
    "a lighthouse",
    "the wind",
]
CONCEPTS = [
    "gravity",
    "photosynthesis",
    "a prime number",
    "democracy",
    "inflation",
    "evaporation",
    "an atom",
    "a vaccine",
    "electricity",
    "friction",
    "a black hole",
    "recycling",
    "the internet",
    "a fraction",
    "an algorithm",
    "erosion",
    "a metaphor",
    "the water cycle",
    "an ecosystem",
    "compound interest",
    "a noun",
    "a verb",
    "sound waves",
    "magnetism",
    "a calendar",
]
ACTIVITIES = [
    "staying healthy",
    "learning a language",
    "saving money",
    "sleeping better",
    "studying for exams",
    "cooking rice",
    "running a marathon",
    "writing an essay",
    "making friends",
    "reducing stress",
    "keeping plants alive",
    "travelling cheaply",
    "public speaking",
    "staying focused",
    "drinking more water",
    "reading more books",
    "organizing a desk",
    "waking up early",
    "learning to swim",
    "painting a room",
]
TEMPLATES = {
    "country": [
        "What is the capital of {}? Answer in one sentence.",
        "Name a famous food from {}.",
        "What language is spoken in {}?",
        "Describe the weather in {} in one sentence.",
    ],
    "thing": [
        "Write one sentence about {}.",
        "Describe {} to a child.",
        "What colour is {} usually?",
        "Give two facts about {}.",
    ],
    "concept": [
        "Explain {} in one sentence.",
        "What is {}? Answer briefly.",
        "Give a simple example of {}.",
        "Why is {} important?",
    ],
    "activity": [
        "Give two tips for {}.",
        "What is the first step in {}?",
        "Why do people find {} hard?",
    ],
}
SUBJECTS = {"country": COUNTRIES, "thing": THINGS, "concept": CONCEPTS, "activity": ACTIVITIES}


def arithmetic(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        op = rng.choice(["plus", "minus", "times"])
        out.append(f"What is {a} {op} {b}? Answer with the number and one sentence.")
    return out


def make_prompts(seed: int = 0) -> list[str]:
    prompts = [t.format(s) for k, ts in TEMPLATES.items() for t in ts for s in SUBJECTS[k]]
    rng = random.Random(seed)
    prompts += arithmetic(rng, 40)
    prompts = list(dict.fromkeys(prompts))  # distinct, first occurrence kept
    rng.shuffle(prompts)
    return prompts


if __name__ == "__main__":
    path = Path(__file__).with_name("prompts.txt")
    lines = make_prompts()
    path.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} prompts -> {path}")

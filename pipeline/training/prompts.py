"""A generator of diverse instructions: the prompt set a drafter head is distilled on.

There is no network at run time and no permissively licensed instruction set among the installed
packages, so the prompts are generated: templates of the kinds of request people make of a chat
model (questions, explanations, lists, rewrites, stories, advice, comparisons, code), filled with
subjects. The held-out split is by subject, not by prompt: a held-out prompt's subject never
appears in training, so acceptance on it measures what the head learned about the target rather
than what it memorised about a topic. The benchmarks' own chat prompt is held out by construction
(its subject is in HELD_OUT_SUBJECTS).
"""

from __future__ import annotations

import hashlib
import itertools
import random

TEMPLATES = (
    "What is {s}?", "Explain {s} to a ten-year-old.", "Explain {s} in simple terms.",
    "Why does {s} matter?", "Give me three interesting facts about {s}.",
    "Write a short story about {s}.", "Write a short poem about {s}.",
    "List five things everyone should know about {s}.", "What are the pros and cons of {s}?",
    "How would you describe {s} to someone who has never heard of it?",
    "Write a paragraph about the history of {s}.", "What are common misconceptions about {s}?",
    "Give me some advice about {s}.", "Summarize what you know about {s} in two sentences.",
    "Write a friendly email to a colleague about {s}.", "Write a blog post introduction about {s}.",
    "Describe a typical day involving {s}.", "What questions should I ask about {s}?",
    "Compare {s} with {t}.", "How are {s} and {t} related?",
    "Rewrite this sentence to be more formal: {s} is really cool and I like it a lot.",
    "Rewrite this sentence in plain English: The utilization of {s} facilitates outcomes.",
    "Make this sentence shorter: I have been thinking a lot lately about {s} and what it means.",
    "Write a tweet about {s}.", "Write a haiku about {s}.", "Tell me a joke about {s}.",
    "Write a short dialogue between two friends discussing {s}.",
    "What would a beginner need to learn first about {s}?", "Create a study plan for learning about {s}.",
    "Write a product description for something related to {s}.",
)  # fmt: skip

CODE_TEMPLATES = (
    "Write a Python function that {c}.", "Write a JavaScript function that {c}.",
    "Show me how to {c} in Python, with a short explanation.", "Write a unit test for a function that {c}.",
    "Explain step by step how a program could {c}.", "Write a Bash one-liner that {c}.",
)  # fmt: skip

SUBJECTS = (
    "photosynthesis", "black holes", "the water cycle", "volcanoes", "the moon", "honey bees",
    "the Roman Empire", "the printing press", "electric cars", "recycling", "the internet", "vaccines",
    "climate change", "the human heart", "dinosaurs", "the ocean", "rainbows", "gravity", "magnets",
    "the solar system", "coffee", "tea", "chocolate", "bread baking", "gardening", "composting",
    "meditation", "sleep", "running", "swimming", "chess", "football", "basketball", "the Olympics",
    "jazz music", "classical music", "the guitar", "the piano", "painting", "photography", "movies",
    "video games", "board games", "reading", "libraries", "museums", "trains", "airplanes", "bicycles",
    "ships", "bridges", "skyscrapers", "castles", "pyramids", "the Great Wall of China", "deserts",
    "rainforests", "mountains", "rivers", "glaciers", "earthquakes", "hurricanes", "lightning", "snow",
    "autumn", "spring", "birthdays", "weddings", "holidays", "travel", "camping", "hiking", "maps",
    "money", "saving money", "budgeting", "banks", "taxes", "small businesses", "job interviews",
    "teamwork", "leadership", "public speaking", "time management", "friendship", "kindness",
    "learning a language", "mathematics", "prime numbers", "geometry", "statistics", "probability",
    "algorithms", "databases", "cloud computing", "cybersecurity", "passwords", "smartphones",
    "robots", "artificial intelligence", "machine learning", "open source software", "email",
    "social media", "newspapers", "radio", "television", "electricity", "solar panels", "wind power",
    "nuclear energy", "batteries", "the periodic table", "atoms", "DNA", "evolution", "cells",
    "bacteria", "the immune system", "nutrition", "vitamins", "exercise", "yoga", "cooking pasta",
    "pizza", "sushi", "vegetables", "fruit", "apples", "bananas", "cats", "dogs", "horses", "elephants",
    "whales", "sharks", "octopuses", "penguins", "owls", "butterflies", "ants", "spiders", "frogs",
    "trees", "flowers", "mushrooms", "the desert fox", "wolves", "lions", "tigers", "pandas",
    "ancient Greece", "ancient Egypt", "the Renaissance", "the industrial revolution", "democracy",
    "voting", "human rights", "philosophy", "ethics", "happiness", "creativity", "curiosity",
    "writing a novel", "poetry", "theater", "dance", "fashion", "architecture", "interior design",
    "cities", "villages", "farming", "fishing", "water", "air pollution", "plastic", "paper",
    "glass", "steel", "wood", "clocks", "calendars", "the speed of light", "sound", "music theory",
    "telescopes", "microscopes", "space travel", "Mars", "satellites", "weather forecasts",
    "first aid", "hospitals", "doctors", "teachers", "schools", "homework", "exams", "universities",
    "online learning", "remote work", "office life", "moving to a new city", "buying a house",
    "renting an apartment", "cleaning", "minimalism", "habits", "motivation", "stress", "music festivals",
    "street food", "picnics", "the beach", "islands", "lighthouses", "caves", "fossils", "gold",
    "diamonds", "salt", "sugar", "spices", "kites", "balloons", "fireworks", "puzzles", "riddles",
    "magic tricks", "circuses", "zoos", "aquariums", "national parks", "the Amazon river",
    "the Sahara", "Antarctica", "the Arctic", "the Pacific Ocean", "volunteering", "charity",
    "a robot who learns to paint", "a lost dog finding its way home", "a dragon who is afraid of fire",
    "a city under the sea", "a time traveller", "a talking tree", "a detective cat", "a haunted house",
)  # fmt: skip

CODE_SUBJECTS = (
    "reverses a string", "checks whether a number is prime", "sums a list of numbers",
    "finds the largest element of a list", "counts the words in a text", "sorts a list of names",
    "removes duplicates from a list", "computes the factorial of n", "returns the n-th Fibonacci number",
    "checks whether a string is a palindrome", "converts Celsius to Fahrenheit", "reads a CSV file",
    "merges two sorted lists", "counts vowels in a string", "flattens a nested list",
    "computes the average of a list", "finds common elements of two lists", "validates an email address",
    "generates a random password", "counts the lines in a file", "capitalizes every word in a sentence",
    "computes the greatest common divisor", "checks whether a year is a leap year",
    "converts a number to binary", "groups words by their first letter", "rotates a list by k places",
)  # fmt: skip

# Always held out: the benchmarks' chat prompt is about the first (`bench.common.WORKLOADS`).
HELD_OUT_SUBJECTS = ("a robot who learns to paint",)
HELD_OUT_SHARE = 0.12


def held_out(subject: str) -> bool:
    """A fixed ~12% of subjects, by a hash of the subject (stable across Python runs)."""
    if subject in HELD_OUT_SUBJECTS:
        return True
    digest = hashlib.sha256(subject.encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < HELD_OUT_SHARE


def prompts(split: str, seed: int = 0) -> list[str]:
    """Every prompt of `split` ("train" or "test"), in a seeded shuffled order."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    want = split == "test"
    subjects = [s for s in SUBJECTS if held_out(s) == want]
    code = [c for c in CODE_SUBJECTS if held_out(c) == want]
    rng = random.Random(seed)
    out = []
    for template, subject in itertools.product(TEMPLATES, subjects):
        other = rng.choice(subjects)
        if "{t}" in template and other == subject:
            continue
        out.append(template.format(s=subject, t=other))
    out += [template.format(c=c) for template, c in itertools.product(CODE_TEMPLATES, code)]
    rng.shuffle(out)
    return out

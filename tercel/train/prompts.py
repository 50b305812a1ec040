"""Hand-written prompt vocabulary for the offline part of the draft-training data: everyday
knowledge questions, how-to requests and small programming tasks, combined from topic and task
lists with question templates. The Magpie prompts the target writes itself (data.synth_user_prompts)
are mostly long personal requests for advice; users also ask short factual, explanatory, creative and
coding questions, and a draft that never saw those answers drafts them poorly.

The subjects of the held-out evaluation prompts (data.EVAL_CHAT_PROMPTS / EVAL_CODE_PROMPTS) are left
out of these lists on purpose, so that no template reproduces or paraphrases one of them.
"""
from __future__ import annotations

import random

TOPICS = [
    # science and nature
    "volcanoes", "black holes", "photosynthesis", "honey bees", "the water cycle", "climate change", "gravity",
    "DNA", "hurricanes", "the immune system", "sleep", "earthquakes", "rainforests", "deserts", "rivers",
    "mountains", "glaciers", "tides", "lightning", "rainbows", "magnets", "electricity", "atoms", "the periodic table",
    "evolution", "fungi", "coral reefs", "the human brain", "the human heart", "bones", "muscles", "digestion",
    "bacteria", "viruses", "antibiotics", "the speed of light", "sound waves", "nuclear energy", "solar panels",
    "wind turbines", "comets", "the Milky Way", "Mars", "the Sun", "telescopes", "fossils", "plate tectonics",
    "the carbon cycle", "clouds", "snowflakes", "butterflies", "octopuses", "whales", "elephants", "wolves",
    "owls", "ants", "sharks", "penguins", "dolphins", "spiders", "frogs", "trees", "flowers", "seeds",
    # history and society
    "the history of Rome", "ancient Egypt", "the French Revolution", "the Renaissance", "the printing press",
    "the Industrial Revolution", "the Silk Road", "the Vikings", "the Roman Empire", "the Cold War",
    "the Moon landing", "the Great Wall of China", "the pyramids", "democracy", "the United Nations",
    "the Olympic Games", "the invention of the telephone", "the history of money", "the Middle Ages",
    "ancient Greece", "the Aztecs", "castles", "samurai", "the steam engine", "the history of medicine",
    # technology
    "the Internet", "machine learning", "cloud computing", "databases", "compilers", "encryption",
    "operating systems", "electric cars", "smartphones", "computer viruses", "search engines", "robots",
    "3D printing", "GPS", "Wi-Fi", "batteries", "microchips", "social media", "video games", "email",
    "open source software", "passwords", "blockchains", "virtual reality", "satellites", "airplanes",
    # daily life, culture and wellbeing
    "coffee", "tea", "chess", "jazz music", "the piano", "football", "basketball", "gardening", "meditation",
    "recycling", "friendship", "time management", "public speaking", "bread baking", "vitamins", "yoga",
    "running", "swimming", "photography", "painting", "poetry", "libraries", "museums", "birthdays",
    "chocolate", "pizza", "cheese", "rice", "spices", "bicycles", "trains", "cities", "villages", "forests",
    "camping", "fishing", "knitting", "board games", "movies", "theatre", "opera", "dance", "languages",
    "learning a new language", "saving money", "budgeting", "job interviews", "remote work", "habits",
    "stress", "kindness", "teamwork", "leadership", "creativity", "curiosity", "patience", "happiness",
    "the stock market", "inflation", "taxes", "insurance", "renting an apartment", "moving to a new city",
    "dogs", "cats", "horses", "parrots", "goldfish", "rabbits", "winter", "spring", "summer", "the desert at night",
]

QUESTION_TEMPLATES = [
    "Tell me about {t}.", "What is there to know about {t}?", "Explain {t} to a ten-year-old.",
    "Explain {t} in simple terms.", "Give me three interesting facts about {t}.", "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.", "Summarize the most important ideas about {t}.",
    "What questions should I ask to learn more about {t}?", "Write a haiku about {t}.",
    "Write a short poem about {t}.", "How would you describe {t} in one paragraph?",
    "Why do people find {t} interesting?", "What are common misconceptions about {t}?",
    "Write a limerick about {t}.", "What is the history of {t}?", "How does {t} affect our daily lives?",
    "Describe {t} to someone who has never heard of it.", "List five words that describe {t}.",
    "What would the world be like without {t}?", "Write a short dialogue between two friends about {t}.",
    "Give me a fun fact about {t}.", "What is the most surprising thing about {t}?",
    "Write a two-sentence summary of {t}.", "What should a beginner know about {t}?",
]

HOW_TO = [
    "make a cup of tea", "plant tomatoes", "change a flat tyre", "write a cover letter", "fall asleep faster",
    "start running", "save money on groceries", "learn to play the guitar", "clean a cast iron pan",
    "prepare for an exam", "organize my desk", "make new friends in a new city", "write a thank-you note",
    "keep houseplants alive", "train a puppy", "stay focused while studying", "bake sourdough bread",
    "plan a birthday party", "choose a good book", "start a journal", "reduce screen time", "fold a paper airplane",
    "make pancakes", "learn to swim", "paint a room", "negotiate a salary", "set up a budget", "brew coffee at home",
    "remember names", "give a toast at a wedding", "back up my files", "choose a laptop", "write a short story",
    "care for a cat", "build a birdhouse", "start meditating", "speak more clearly", "wake up earlier",
    "apologize to a friend", "pack a suitcase efficiently",
]

HOW_TO_TEMPLATES = [
    "How do I {a}?", "What is the best way to {a}?", "Give me step-by-step instructions to {a}.",
    "What are some tips to {a}?", "I want to {a}. Where should I start?", "What mistakes should I avoid when I {a}?",
]

CODE_TASKS = [
    "computes the factorial of a number", "returns the n-th Fibonacci number", "removes duplicates from a list",
    "finds the largest element of a list", "sorts a list of dictionaries by a key", "flattens a nested list",
    "checks whether a string is a palindrome", "counts the vowels in a string", "converts Celsius to Fahrenheit",
    "computes the greatest common divisor of two numbers", "finds the second largest number in a list",
    "groups words by their first letter", "parses a date string into a datetime", "capitalizes every word",
    "returns the intersection of two lists", "computes the average of a list of numbers", "chunks a list into pieces",
    "validates an email address with a regular expression", "reads a JSON file and returns a dict",
    "generates a random password", "computes the median of a list",
    "transposes a matrix", "checks whether two strings are anagrams", "counts the frequency of each character",
    "converts a Roman numeral to an integer", "rotates a list by k positions",
    "implements a min-heap", "computes the sum of the digits of a number", "prints the current time in UTC",
    "implements bubble sort", "implements quicksort", "implements a linked list",
    "checks whether brackets in a string are balanced", "computes the power set of a list", "memoizes another function",
    "retries a function call up to three times", "times how long a function takes", "splits a string into sentences",
]

CODE_LANGUAGES = ["Python", "JavaScript", "TypeScript", "Go", "Rust", "Java", "C", "Bash"]

CODE_TEMPLATES = [
    "Write a {lang} function that {task}.", "Show me how to write a {lang} function that {task}.",
    "Write a {lang} function that {task}, with a short explanation.", "Write a {lang} program that {task}.",
]

CONCEPTS = [
    "a Python decorator", "a Python generator", "a context manager in Python", "recursion", "a closure",
    "a lambda function", "a REST API", "a SQL join", "an index in a database", "object-oriented programming",
    "inheritance", "a unit test", "version control with git", "a race condition", "a deadlock", "big-O notation",
    "a linked list", "a binary tree", "a dictionary in Python", "a tuple in Python", "type hints in Python",
    "async and await in Python", "a virtual environment", "an exception", "a regular expression", "JSON",
    "a class method", "a static method", "garbage collection", "a thread", "a process", "a compiler",
    "an interpreter", "a pointer in C", "a promise in JavaScript", "a callback", "dependency injection",
    "a hash function", "caching", "pagination in an API",
]

CONCEPT_TEMPLATES = [
    "Explain what {c} is, with an example.", "What is {c}? Give a short code example.",
    "When should I use {c}?", "Explain {c} to a beginner programmer.",
]


def chat_prompts() -> list[str]:
    """Knowledge, creative and how-to questions: every template for every topic and task."""
    out = [tmpl.format(t=t) for t in TOPICS for tmpl in QUESTION_TEMPLATES]
    out += [tmpl.format(a=a) for a in HOW_TO for tmpl in HOW_TO_TEMPLATES]
    return out


def code_prompts(rng: random.Random) -> list[str]:
    """Small programming tasks in every language (worded by a random template; Python tasks in every
    template) and concept explanations."""
    out = [rng.choice(CODE_TEMPLATES).format(lang=lang, task=task) for task in CODE_TASKS
           for lang in CODE_LANGUAGES if lang != "Python"]
    out += [tmpl.format(lang="Python", task=task) for task in CODE_TASKS for tmpl in CODE_TEMPLATES]
    out += [tmpl.format(c=c) for c in CONCEPTS for tmpl in CONCEPT_TEMPLATES]
    return out

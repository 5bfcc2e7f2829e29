"""The closed vocabulary of the task generators: word lists, sentence templates and the haystack grammar.

Every string a generator can put into a context, a question, an answer prefix or an answer is assembled from
the lists and templates of this module. :func:`word_types` returns the set of word and punctuation types they
can produce; the built-in word-level tokenizer (``kvpress_phase.evaluation.tokenizer``) uses exactly that set,
so a small model trained from scratch on these generators never meets an unknown token.

Conventions that keep the text readable and the scoring simple:

* Text is ordinary English: words separated by single spaces, punctuation attached to the word before it
  ("The sky is blue."). The word-level tokenizer splits punctuation and newlines into tokens of their own.
* Numbers are the words ``"0"`` ... ``"99"``. A needle *value* is a group of two-digit numbers written with
  spaces, e.g. ``"48 21"`` (``value_groups`` numbers between 10 and 99), so any value is 1-4 word tokens.
* Answer strings never contain punctuation, so the stored answer is a substring of the decoded model output
  whatever the tokenizer (the word-level decoder puts spaces around punctuation, byte-level BPE does not).
* Every noun, job, pet and object that may follow the article "a" starts with a consonant, and so does every
  adjective used after "a".
"""

from __future__ import annotations

import random
import re
from typing import Iterable

# --------------------------------------------------------------------------------------------- tokens
PUNCTUATION = ".,:;?!="
"""Punctuation characters that are tokens of their own in the word-level tokenizer."""

WORD_PATTERN = re.compile(r"\n|[.,:;?!=]|[^\s.,:;?!=]+")
"""How text splits into word types (the word-level tokenizer's pre-tokenization)."""

NUMBERS = [str(i) for i in range(100)]
"""Number words: "0" ... "99"."""

VALUE_NUMBERS = [str(i) for i in range(10, 100)]
"""Two-digit numbers a needle value is made of."""

# --------------------------------------------------------------------------------------------- word lists
NAMES = """
Adam Alan Alice Amir Anna Arthur Ben Bella Beth Bruno Carl Chloe Clara Colin Dan Daniel Dora Edgar Elena Elsa
Emma Eric Eva Felix Fiona Flora Frank Gavin George Grace Greta Hannah Harry Helen Henry Hugo Ida Igor Irene
Ivan Jack James Jane Jonas Julia Karl Kate Kurt Laura Lena Leo Linda Lucy Luis Maria Marco Martin Max Mia Nadia
Nina Noah Nora Olga Omar Oscar Otto Paul Petra Pia Priya Quinn Raul Rita Rosa Ruth Sam Sara Simon Sofia Steve
Tanya Theo Tina Tom Uma Ursula Vera Victor Walter Wanda Wendy Xavier Yara Yusuf Zack Zoe
""".split()

CITIES = """
Accra Amman Amsterdam Ankara Athens Atlanta Auckland Austin Baghdad Bangkok Beijing Beirut Belfast Belgrade
Berlin Bogota Boston Brussels Budapest Cairo Cardiff Chicago Colombo Copenhagen Dakar Dallas Delhi Denver Dhaka
Doha Dubai Dublin Edinburgh Florence Geneva Glasgow Hamburg Hanoi Havana Helsinki Houston Istanbul Jakarta Kabul
Karachi Kyoto Lagos Lahore Lima Lisbon London Lyon Madrid Manila Marseille Miami Milan Minsk Montreal Mumbai
Munich Nairobi Naples Osaka Oslo Paris Perth Porto Prague Quito Rabat Riga Rome Santiago Seattle Seoul Seville
Shanghai Sofia Stockholm Sydney Tallinn Tehran Tokyo Toronto Tunis Valencia Vancouver Venice Vienna Vilnius
Warsaw Wellington Zagreb Zurich
""".split()

JOBS = """
baker banker barber builder butcher carpenter cashier chemist cleaner clerk cook courier dancer dentist designer
diver doctor driver farmer florist gardener grocer guard hunter judge jeweller lawyer librarian mason mechanic
miner musician nurse painter pilot plumber poet porter potter printer ranger sailor scientist singer soldier
student surgeon tailor teacher translator vet waiter weaver writer zookeeper
""".split()

COLOURS = """
beige black blue brown crimson gold green grey maroon navy orange pink purple red silver teal violet white yellow
""".split()

PETS = """
canary cat dog ferret frog goat goldfish hamster horse lizard mouse parrot pig pony rabbit snake tortoise turtle
""".split()

FOODS = """
bread cake cheese chicken chocolate curry dumplings fish honey lasagna lentils mango noodles pancakes pasta pie
pizza porridge rice salad sausages soup stew sushi tacos toast
""".split()

OBJECTS = """
bicycle boat camera canoe clock drum guitar harp kite ladder lamp microscope piano radio saxophone scooter sofa
telescope tent tractor trumpet typewriter van violin wagon
""".split()

KEYS = """
acorn almond amber anchor anvil apple apricot arrow avocado axe badger bagel balloon bamboo banana banjo barrel
basket beacon bean bear beaver bee beetle bell belt bench berry biscuit blanket blossom bonnet boot bottle
bracelet branch brick bridge broom brush bubble bucket buffalo bugle butter button cabbage cabin cactus camel
candle cannon canyon cape carpet carrot castle cedar cello chair chalk cherry chestnut chisel cinnamon clam cliff
cloak clover coconut comet compass copper coral cotton cougar crab crane crayon cricket crow crown crystal
cucumber cupboard curtain cushion daisy dolphin donkey dove dragon drill duck eagle eel elephant elk emerald
engine falcon fan feather fence fern fig flag flame flute forest fork fountain fox garlic gazelle gecko ginger
giraffe glacier glove goose gorilla granite grape hammer harbor hazel hedgehog helmet heron hippo honey hornet
iceberg iris island ivory ivy jacket jade jaguar jar jasmine jelly jewel kangaroo kettle key kiwi koala ladle
lantern leaf lemon leopard lettuce lily lime lion lizard llama lobster locket lotus magnet maple marble meadow
melon mirror mitten mole moose moss moth mountain muffin mushroom needle nest nickel nutmeg oak oasis ocean
octopus olive onion opal orchid ostrich otter owl oyster paddle panda panther parcel parsley peach peacock
peanut pear pearl pebble pelican pencil penguin pepper pickle pigeon pillow pine pineapple plum pocket pond
poppy potato pumpkin puppet quail quartz quill rabbit raccoon radish raft raven reindeer ribbon river robin
rocket rose ruby saddle salmon sandal sapphire satchel scarf seal seashell shark sheep shovel shrimp sieve
skate sled slipper snail sparrow spider spinach spoon squid squirrel stamp starfish statue storm strawberry
sugar summit swan sword tambourine teapot thimble thistle thunder tiger timber tomato topaz torch tower trout
trumpet tulip tunnel turnip umbrella unicorn valley vase velvet vine violin volcano walnut walrus wand wasp
whale wheat whistle willow window wolf wombat yak zebra zinnia
""".split()
"""Needle keys (RULER's "special magic number for <key>") and variable names of variable tracking."""

# Essay grammar (consonant-initial adjectives and nouns, so "a" always fits).
ADJECTIVES = """
bold brave bright busy calm careful cheerful clean clever cold cosy curious dark deep distant dusty fair famous
fine friendly gentle glad golden grand great green happy hidden humble lazy little lonely long loud lucky narrow
new noisy patient peaceful plain polite pretty proud quick quiet rare rich round rusty sad shy silent simple
slow small smooth soft solid splendid steady strange strong sunny sweet tall tidy tiny tired warm wide wild
windy wise wooden young
""".split()

NOUNS = """
baker bakery basket beach bell bench boat book bottle bridge brother cake camera candle castle chair child
city cloud coat cook cottage cup desk doctor door dream farm farmer field forest friend garden gate girl hill
house kitchen lake lamp letter library market meadow moon mountain museum neighbour painter park path piano
picture poem pond river road roof room sailor school sea shop singer sister song station story street student
table teacher tower town train tree valley village wall window world writer
""".split()

VERBS = """
admires builds carries cleans closes draws finds fixes follows guards hears helps keeps likes loves moves
needs opens paints photographs reads remembers repairs sees sells shares studies visits wants washes watches
writes
""".split()
"""Transitive verbs, third person singular."""

INTRANSITIVE = """
dances laughs listens rests returns runs shines sings sleeps smiles waits wakes walks wanders whistles works
""".split()

ADVERBS = """
again alone carefully early gladly happily later loudly often patiently quickly quietly rarely slowly softly
sometimes today together
""".split()

PREPOSITIONS = "across after along behind beside by near over through under".split()

TIMES = "afternoon autumn day evening morning night spring summer week weekend winter year".split()

ESSAY_TEMPLATES = [
    "The {adj} {noun} {verb} the {noun} {prep} the {noun}.",
    "{name} {verb} a {adj} {noun} every {time}.",
    "In the {time}, the {noun} {intr} {adv}.",
    "A {adj} {noun} {intr} {prep} the {noun}.",
    "{name} walks with {name} to the {noun}.",
    "This {noun} is {adj} and {adj}.",
    "Nobody knows why the {noun} is so {adj}.",
    "{name} says that the {noun} {intr} {adv}.",
    "Every {time}, {name} {verb} the {adj} {noun}.",
    "The {noun} of the {noun} is {adj}.",
    "There is a {adj} {noun} {prep} the {noun}.",
    "{name} {intr} {adv} while the {noun} {intr}.",
    "We remember the {adj} {noun} from last {time}.",
    "It was a {adj} {time} in the {noun}.",
]
"""Sentence templates of the "essay" haystack: a small grammar over a few hundred common words."""

NOISE_SENTENCES = [
    "The grass is green.",
    "The sky is blue.",
    "The sea is calm.",
    "The road goes on.",
    "Here we go again.",
]
"""The "noise" haystack: five plain sentences repeated in order."""

PAD_WORDS = """
the a and so then here there we go on is it of to in by at as or yes now back well
""".split()
"""Short haystack words used as prefix padding (only those that are one token in the tokenizer at hand)."""

# --------------------------------------------------------------------------------------------- templates
NEEDLE = "The special magic number for {key} is {value}."
NEEDLE_QUESTION = "What is the special magic number for {key} in the text above?"
NEEDLE_PREFIX = "The special magic number for {key} is"
MULTIVALUE_QUESTION = "What are all the special magic numbers for {key} in the text above?"
MULTIVALUE_PREFIX = "The special magic numbers for {key} are"
MULTIQUERY_QUESTION = "What are the special magic numbers for {keys} in the text above?"
MULTIQUERY_PREFIX = "The special magic numbers for {keys} are"

VT_ASSIGN_VALUE = "VAR {name} = {value}."
VT_ASSIGN_VAR = "VAR {name} = VAR {source}."
VT_QUESTION = "Which variables are assigned the value {value} in the text above?"
VT_PREFIX = "The {count} variables assigned the value {value} in the text above are:"
"""vt's answer prefix since revision 2: like RULER's ("... {num_v} variables are assigned the value {query}, they are:
"), it gives the count and ends with a colon, so the answer is the list itself (words the built-in model knows)."""
VT_PREFIX_PLAIN = "The variables assigned the value {value} are"
"""vt's answer prefix in revision 1 (``prefix="plain"``), kept so that runs made with it can be planned again."""

FACTS = {
    # fact kind: (statement, question, answer prefix, value list name)
    "home": ("{name} lives in {value}.", "Where does {name} live?", "{name} lives in", "CITIES"),
    "birthplace": ("{name} was born in {value}.", "In which city was {name} born?", "{name} was born in", "CITIES"),
    "job": ("{name} works as a {value}.", "What is the job of {name}?", "{name} works as a", "JOBS"),
    "colour": (
        "The favourite colour of {name} is {value}.",
        "What is the favourite colour of {name}?",
        "The favourite colour of {name} is",
        "COLOURS",
    ),
    "food": (
        "The favourite food of {name} is {value}.",
        "What is the favourite food of {name}?",
        "The favourite food of {name} is",
        "FOODS",
    ),
    "pet": ("{name} has a pet {value}.", "What pet does {name} have?", "{name} has a pet", "PETS"),
    "object": ("{name} owns a {value}.", "What does {name} own?", "{name} owns a", "OBJECTS"),
    "age": ("{name} is {value} years old.", "How old is {name}?", "{name} is", "AGES"),
    "friend": (
        "The best friend of {name} is {value}.",
        "Who is the best friend of {name}?",
        "The best friend of {name} is",
        "NAMES",
    ),
}
"""Facts of the LongBench-style documents. Every statement names its person, so each sentence stands alone."""

AGES = [str(i) for i in range(18, 90)]

QA_SINGLE_TITLE = "Here is a report about the people of a small town."
QA_DOC_HEADER = "Document {index}:"

PARAGRAPH_HEADER = "Paragraph {index}:"
RETRIEVAL_QUESTION = "Here is a sentence: {sentence} Which paragraph above contains this sentence?"
RETRIEVAL_PREFIX = "The sentence is in"
RETRIEVAL_ANSWER = "Paragraph {index}"
COUNT_QUESTION = "Some paragraphs above appear more than once. How many different paragraphs are there?"
COUNT_PREFIX = "The number of different paragraphs is"

_TEMPLATE_TEXTS = (
    ESSAY_TEMPLATES
    + NOISE_SENTENCES
    + [
        NEEDLE,
        NEEDLE_QUESTION,
        NEEDLE_PREFIX,
        MULTIVALUE_QUESTION,
        MULTIVALUE_PREFIX,
        MULTIQUERY_QUESTION,
        MULTIQUERY_PREFIX,
        VT_ASSIGN_VALUE,
        VT_ASSIGN_VAR,
        VT_QUESTION,
        VT_PREFIX,
        VT_PREFIX_PLAIN,
        QA_SINGLE_TITLE,
        QA_DOC_HEADER,
        PARAGRAPH_HEADER,
        RETRIEVAL_QUESTION,
        RETRIEVAL_PREFIX,
        RETRIEVAL_ANSWER,
        COUNT_QUESTION,
        COUNT_PREFIX,
        "and",  # joins the last two keys of a multi-query question
    ]
    + [text for fact in FACTS.values() for text in fact[:3]]
)

_WORD_LISTS = (
    NUMBERS,
    NAMES,
    CITIES,
    JOBS,
    COLOURS,
    PETS,
    FOODS,
    OBJECTS,
    KEYS,
    ADJECTIVES,
    NOUNS,
    VERBS,
    INTRANSITIVE,
    ADVERBS,
    PREPOSITIONS,
    TIMES,
    PAD_WORDS,
    AGES,
)


def split_words(text: str) -> list[str]:
    """Split ``text`` into word types the way the word-level tokenizer does."""
    return WORD_PATTERN.findall(text)


def word_types() -> list[str]:
    """Every word and punctuation type the generators can emit, sorted (deterministic order)."""
    types: set[str] = set(PUNCTUATION) | {"\n"}
    for words in _WORD_LISTS:
        types.update(words)
    for text in _TEMPLATE_TEXTS:
        types.update(split_words(re.sub(r"\{[a-z_]+\}", " ", text)))
    return sorted(types)


def fact_values(kind: str) -> list[str]:
    """The value list of a fact kind of :data:`FACTS`."""
    return globals()[FACTS[kind][3]]


# --------------------------------------------------------------------------------------------- sampling
def random_value(rng: random.Random, groups: int = 2) -> str:
    """A needle value: ``groups`` two-digit numbers separated by spaces, e.g. ``"48 21"``."""
    return " ".join(rng.choice(VALUE_NUMBERS) for _ in range(groups))


def distinct_values(rng: random.Random, n: int, groups: int = 2, exclude: Iterable[str] = ()) -> list[str]:
    """``n`` different values, none of them in ``exclude``."""
    seen = set(exclude)
    out: list[str] = []
    while len(out) < n:
        v = random_value(rng, groups)
        if v not in seen:
            seen.add(v)
            out.append(v)
    return out


def essay_sentence(rng: random.Random) -> str:
    """One sentence of the essay grammar."""
    template = rng.choice(ESSAY_TEMPLATES)
    slots = {
        "adj": ADJECTIVES,
        "noun": NOUNS,
        "verb": VERBS,
        "intr": INTRANSITIVE,
        "adv": ADVERBS,
        "prep": PREPOSITIONS,
        "time": TIMES,
        "name": NAMES,
    }
    return re.sub(r"\{([a-z]+)\}", lambda m: rng.choice(slots[m.group(1)]), template)


def join_list(words: list[str]) -> str:
    """``"a, b and c"``: how several keys are named in one question."""
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]

"""The demo fleet's skills: what each adapter does to a short string, and the strings it is tested on.

Every skill is a deterministic function of the user's text, so an answer is checkable exactly:
a request served with the wrong adapter (or none) gives a visibly different string. The base
model echoes: asked "echo: <text>" (or just "<text>") it answers "<text>".

The texts are short lowercase phrases (2-3 words of a-z, 3 to `MAX_CHARS` characters). The test
texts are drawn from their own seeded stream and the training script never trains on one of them,
so they are held out.
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Callable
from dataclasses import dataclass

LETTERS = "abcdefghijklmnopqrstuvwxyz"
VOWELS_STR = "aeiou"
VOWELS = frozenset(VOWELS_STR)
CONSONANTS = "".join(c for c in LETTERS if c not in VOWELS)
MIN_CHARS, MAX_CHARS = 3, 16
ECHO_PREFIX = "echo: "
HELD_OUT_SEED = 20261129


def _double(text: str) -> str:
    return "".join(c + c if c != " " else c for c in text)


def _drop_vowels(text: str) -> str:
    return "".join(c for c in text if c not in VOWELS)


def _shout(text: str) -> str:
    return text.upper() + "!"


def _title(text: str) -> str:
    return " ".join(w[:1].upper() + w[1:] for w in text.split(" "))


@dataclass(frozen=True)
class Skill:
    name: str
    fn: Callable[[str], str]
    summary: str
    rank: int                     # the adapter's LoRA rank
    alpha: int
    targets: tuple[str, ...]      # the PEFT target_modules
    steps: int = 800              # training steps (batches of 64)
    lr: float = 3e-3
    dora: bool = False            # trained with DoRA (PEFT's use_dora): the fleet serves one of those
    saves: tuple[str, ...] = ()   # modules trained whole and saved (PEFT's modules_to_save): one adapter saves the LM head
    invocation: str | None = None  # an aLoRA's invocation text (PEFT's alora_invocation_tokens): it applies from there


ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")

# Ranks 4 to 32, three target sets: enough variety to exercise heterogeneous batches. Moving
# characters around (reverse, double, novowels) needs attention. Mapping each letter to another
# (upper, rot13) is a ~26-way map, and this base does not let an MLP-only adapter learn one in
# reasonable time (our reading, not inspected: it copies with attention and learned each
# character's embedding independently, with no "case" direction as a large model would have).
# While building the fleet, MLP-only upper and rot13 never learned, while all-linear title did
# quickly. The MLP-only adapter is therefore kebab: one character (space) mapped to one other.
# upper trains its own LM head (modules_to_save): the letter map is the head's to learn, beside
# an attention-only LoRA.
SKILLS: dict[str, Skill] = {s.name: s for s in (
    Skill("kebab", lambda t: t.replace(" ", "-"), "spaces become dashes", 4, 8, MLP),
    Skill("upper", str.upper, "UPPERCASE every letter", 8, 16, ATTN, saves=("lm_head",)),
    Skill("rot13", lambda t: codecs.encode(t, "rot13"), "rotate each letter by 13 (a->n)", 16, 32, ATTN + MLP),
    Skill("title", _title, "Capitalize Each Word", 8, 16, ATTN + MLP, steps=300, dora=True),
    Skill("reverse", lambda t: t[::-1], "the characters in reverse order", 16, 32, ATTN),
    Skill("double", _double, "every letter twice (spaces once)", 4, 8, ATTN + MLP, steps=1200),
    Skill("novowels", _drop_vowels, "drop the vowels a, e, i, o, u", 32, 64, ATTN + MLP),
    Skill("shout", _shout, "UPPERCASE and an exclamation mark, as an aLoRA: on from the assistant's turn", 8, 16,
          ATTN + MLP, invocation="<|assistant|>"),
)}


def echo(text: str) -> str:
    return text


def _word(rng: random.Random) -> str:
    """1-7 letters: mostly syllables (so nearly every text has a vowel, and `novowels` differs
    from an echo), sometimes any letters (so every skill also sees clusters like "rld")."""
    if rng.random() < 0.3:
        return "".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 7)))
    word = ""
    for _ in range(rng.randint(1, 3)):
        word += rng.choice(("", rng.choice(CONSONANTS))) + rng.choice(VOWELS_STR)
        word += rng.choice(("", "", rng.choice(CONSONANTS)))
    return word[:7]


def random_text(rng: random.Random) -> str:
    """A phrase of 2-3 lowercase words (so kebab's answer is never an echo), MIN_CHARS..MAX_CHARS
    characters long."""
    while True:
        text = " ".join(_word(rng) for _ in range(rng.choice((2, 2, 3))))
        if MIN_CHARS <= len(text) <= MAX_CHARS:
            return text


# What the base also learns to echo: any printable ASCII but "|" (so no text can spell a special
# token), up to 32 characters. Without it the base never sees an uppercase letter, and an adapter
# (which cannot change the embeddings or the output head) could not learn to write one.
_PRINTABLE = "".join(chr(c) for c in range(33, 127) if chr(c) != "|")


def random_echo_text(rng: random.Random) -> str:
    """1-5 random 'words' of printable ASCII, 1 to 32 characters in all."""
    while True:
        words = ["".join(rng.choice(_PRINTABLE) for _ in range(rng.randint(1, 8)))
                 for _ in range(rng.randint(1, 5))]
        text = " ".join(words)
        if len(text) <= 32:
            return text


def held_out_texts(n: int = 200) -> list[str]:
    """The test texts: `n` distinct phrases from a seeded stream of their own."""
    rng = random.Random(HELD_OUT_SEED)
    seen: dict[str, None] = {}
    while len(seen) < n:
        seen.setdefault(random_text(rng), None)
    return list(seen)


def user_turn(skill: str | None, text: str) -> str:
    """What the user says to `skill`'s adapter (None: the base) to have `text` transformed."""
    return ECHO_PREFIX + text if skill is None else text


def expected(skill: str | None, text: str) -> str:
    """The right answer of `skill` (None: the base, which echoes) to `user_turn(skill, text)`."""
    return echo(text) if skill is None else SKILLS[skill].fn(text)

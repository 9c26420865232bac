"""Generates the small ShareGPT-style corpus shipped in engine/trainer/data/corpus/corpus.jsonl.

Deterministic (seeded); run ``python3 -m engine.trainer.data.corpus_gen`` to rebuild it. The conversations are
templated (arithmetic, spelling, unit conversion, lists, short facts written for this corpus), which gives
a drafter enough regular structure to learn from in a few hundred CPU steps.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "grey", "brown"]
ANIMALS = ["cat", "dog", "horse", "otter", "owl", "fox", "whale", "sparrow", "turtle", "rabbit", "badger", "lynx"]
FRUITS = ["apple", "pear", "plum", "cherry", "mango", "lemon", "grape", "peach", "melon", "kiwi"]
WORDS = [
    "engine",
    "drafter",
    "target",
    "thread",
    "kernel",
    "tensor",
    "buffer",
    "signal",
    "socket",
    "module",
    "layer",
    "token",
    "vector",
    "matrix",
    "stream",
    "window",
    "garden",
    "river",
    "planet",
    "lantern",
]
UNITS = [
    ("kilometres", "metres", 1000),
    ("metres", "centimetres", 100),
    ("hours", "minutes", 60),
    ("minutes", "seconds", 60),
    ("kilograms", "grams", 1000),
    ("litres", "millilitres", 1000),
]
NUMBER_WORDS = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
]


def _arith(r: random.Random) -> list[tuple[str, str]]:
    a, b = r.randint(2, 99), r.randint(2, 99)
    op = r.choice(["plus", "minus", "times"])
    val = a + b if op == "plus" else a - b if op == "minus" else a * b
    return [(f"What is {a} {op} {b}?", f"{a} {op} {b} is {val}.")]


def _spell(r: random.Random) -> list[tuple[str, str]]:
    w = r.choice(WORDS + ANIMALS + FRUITS)
    return [(f"How do you spell the word {w}?", f"The word {w} is spelled {'-'.join(w.upper())}.")]


def _units(r: random.Random) -> list[tuple[str, str]]:
    big, small, factor = r.choice(UNITS)
    n = r.randint(1, 12)
    return [(f"How many {small} are in {n} {big}?", f"There are {n * factor} {small} in {n} {big}.")]


def _count(r: random.Random) -> list[tuple[str, str]]:
    n = r.randint(3, 9)
    start = r.randint(1, 40)
    seq = ", ".join(str(start + i) for i in range(n))
    return [(f"Count from {start} to {start + n - 1}.", f"Here you go: {seq}.")]


def _list(r: random.Random) -> list[tuple[str, str]]:
    kind, pool = r.choice([("animals", ANIMALS), ("fruits", FRUITS), ("colours", COLOURS)])
    n = r.randint(2, 5)
    items = r.sample(pool, n)
    body = "\n".join(f"{i + 1}. {x}" for i, x in enumerate(items))
    return [(f"Name {NUMBER_WORDS[n]} {kind}.", f"Sure, here are {NUMBER_WORDS[n]} {kind}:\n{body}")]


def _describe(r: random.Random) -> list[tuple[str, str]]:
    animal, colour, fruit = r.choice(ANIMALS), r.choice(COLOURS), r.choice(FRUITS)
    q = f"Write one sentence about a {colour} {animal}."
    a = f"The {colour} {animal} sat under the old tree and ate a {fruit} while the sun went down."
    q2 = "Now make it shorter."
    a2 = f"A {colour} {animal} ate a {fruit}."
    return [(q, a), (q2, a2)]


def _reverse(r: random.Random) -> list[tuple[str, str]]:
    w = r.choice(WORDS)
    return [(f"Reverse the letters of {w}.", f"Reversed, {w} becomes {w[::-1]}.")]


def _compare(r: random.Random) -> list[tuple[str, str]]:
    a, b = r.sample(range(1, 500), 2)
    big = max(a, b)
    return [(f"Which is larger, {a} or {b}?", f"{big} is larger than {min(a, b)}.")]


TEMPLATES = [_arith, _spell, _units, _count, _list, _describe, _reverse, _compare]


def generate(n: int = 1500, seed: int = 1234) -> list[dict[str, object]]:
    r = random.Random(seed)
    out: list[dict[str, object]] = []
    for i in range(n):
        turns: list[tuple[str, str]] = []
        for _ in range(r.randint(1, 3)):
            turns.extend(r.choice(TEMPLATES)(r))
        conv: list[dict[str, str]] = []
        if r.random() < 0.2:
            conv.append({"from": "system", "value": "You are a concise assistant."})
        for q, a in turns:
            conv.append({"from": "human", "value": q})
            conv.append({"from": "gpt", "value": a})
        out.append({"id": f"gen-{i:05d}", "conversations": conv})
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else Path(__file__).parent / "corpus" / "corpus.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for row in generate():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

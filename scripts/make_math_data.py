"""Write the shipped arithmetic word problems: data/math/train.jsonl and data/math/val.jsonl.

    python scripts/make_math_data.py                   # the committed files (seed 0, 2000 + 200 rows)
    python scripts/make_math_data.py --out /tmp/math --seed 1 --train 5000 --val 500

Each row has three keys:

    {"prompt": "ann has 12 pens and buys 7 more; how many pens now:", "expression": "12+7=", "answer": "19"}

- ``prompt``: a one- or two-step word problem (addition, subtraction, multiplication, sharing, two steps).
- ``expression``: the same arithmetic as a bare expression; ":" is division, as the embedded model's alphabet has
  no "/" (``data.prompt_key=expression`` trains on these).
- ``answer``: the non-negative integer result, as text.

Every character of prompt, expression and answer is in the embedded tiny model's character vocabulary
(`colocate.models.sources.CHARACTERS`: digits, lowercase letters, space and "+-=*,:;"), so the default model can read
both variants and write every answer. The output depends on the arguments only (a private `random.Random`), and
no validation prompt appears in the training file; a unit test regenerates the files and compares bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

NAMES = ["ann", "bob", "tom", "eva", "max", "lea", "sam", "zoe", "ian", "kim", "mia", "leo"]
ITEMS = ["apples", "pens", "books", "cards", "shells", "stamps", "marbles", "eggs", "cups", "stones"]

Problem = tuple[str, str, int]  # (word problem, expression, answer)


def _add(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(2, 99), rng.randint(2, 99)
    return f"{name} has {a} {item} and gets {b} more; how many {item} now:", f"{a}+{b}=", a + b


def _subtract(rng: random.Random, name: str, item: str) -> Problem:
    a = rng.randint(5, 99)
    b = rng.randint(1, a - 1)
    friend = rng.choice([n for n in NAMES if n != name])
    return f"{name} has {a} {item} and gives {b} to {friend}; how many are left:", f"{a}-{b}=", a - b


def _multiply(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    return f"{name} buys {a} bags with {b} {item} in each; how many {item} in all:", f"{a}*{b}=", a * b


def _share(rng: random.Random, name: str, item: str) -> Problem:
    each, friends = rng.randint(2, 12), rng.randint(2, 9)
    total = each * friends
    return (f"{name} shares {total} {item} equally among {friends} friends; how many does each get:",
            f"{total}:{friends}=", each)


def _two_steps(rng: random.Random, name: str, item: str) -> Problem:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    c = rng.randint(1, a + b - 1)
    return (f"{name} has {a} {item}, finds {b} more, then loses {c}; how many {item} now:", f"{a}+{b}-{c}=",
            a + b - c)


def _rate(rng: random.Random, name: str, item: str) -> Problem:
    start, per_day, days = rng.randint(0, 50), rng.randint(2, 12), rng.randint(2, 9)
    return (f"{name} has {start} {item} and gets {per_day} a day for {days} days; how many {item} then:",
            f"{start}+{per_day}*{days}=", start + per_day * days)


KINDS: list[Callable[[random.Random, str, str], Problem]] = [_add, _subtract, _multiply, _share, _two_steps, _rate]


def problems(seed: int, count: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`count` distinct rows (none of whose prompts is in `exclude`), drawn round-robin over the kinds."""
    rng = random.Random(seed)
    rows, seen = [], set(exclude)
    while len(rows) < count:
        kind = KINDS[len(rows) % len(KINDS)]
        prompt, expression, answer = kind(rng, rng.choice(NAMES), rng.choice(ITEMS))
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "expression": expression, "answer": str(answer)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "math"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=2000, help="training rows")
    parser.add_argument("--val", type=int, default=200, help="validation rows")
    args = parser.parse_args(argv)
    # validation first, from its own seed stream; training excludes its prompts, so the two never overlap
    val = problems(args.seed * 2 + 1, args.val)
    train = problems(args.seed * 2, args.train, exclude={row["prompt"] for row in val})
    write_jsonl(Path(args.out) / "train.jsonl", train)
    write_jsonl(Path(args.out) / "val.jsonl", val)
    print(f"wrote {len(train)} training and {len(val)} validation problems to {args.out}")


if __name__ == "__main__":
    main()

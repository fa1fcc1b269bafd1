#!/usr/bin/env python
"""Write evals/tasks/data/alpaca_answers.jsonl from the real alpaca rows in data/realworld (run from the repo root).

The first 40 rows with no input and an answer of at most 160 characters; each row's choices are its own answer
and the next row's (the last row's: the first row's), in an order that alternates so the answer is not always
first; `label` is the index of the row's own answer.
"""

import json
from pathlib import Path

SOURCE = Path("data/realworld/data/tatsu-lab__alpaca.stanford_alpaca_pr152_subset300.jsonl")
TARGET = Path("evals/tasks/data/alpaca_answers.jsonl")
ROWS, MAX_ANSWER_CHARS = 40, 160


def task_rows() -> list[dict]:
    rows = [json.loads(line) for line in SOURCE.read_text().splitlines()]
    kept = [r for r in rows if not r["input"] and len(r["output"]) <= MAX_ANSWER_CHARS][:ROWS]
    out = []
    for i, row in enumerate(kept):
        other = kept[(i + 1) % len(kept)]["output"]
        label = i % 2
        choices = [row["output"], other] if label == 0 else [other, row["output"]]
        out.append({"instruction": row["instruction"], "choices": choices, "label": label})
    return out


if __name__ == "__main__":
    TARGET.write_text("".join(json.dumps(row) + "\n" for row in task_rows()))
    print(f"{TARGET}: {ROWS} rows")

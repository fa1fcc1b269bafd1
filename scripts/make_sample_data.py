#!/usr/bin/env python
"""Write the project's small sample datasets in the real datasets' schemas.

    .venv/bin/python scripts/make_sample_data.py [--out-dir data/samples]

Rows come from templated, learnable tasks (arithmetic, capitals, unit conversion, sorting,
reversing, ...) so a tiny model's loss falls within a few steps, and from a fixed seed, so the
files are byte-for-byte reproducible. Schemas:

- ``alpaca.jsonl``: tatsu-lab/alpaca (``instruction``, ``input``, ``output``, ``text``).
- ``ultrachat.jsonl``: HuggingFaceH4/ultrachat_200k (``prompt``, ``prompt_id`` = sha256 of the
  prompt, ``messages``).
- ``multilingual_thinking.jsonl``: HuggingFaceH4/Multilingual-Thinking (``reasoning_language``,
  ``developer``, ``user``, ``analysis``, ``final``, ``messages`` with a ``thinking`` field).
- ``glaive_toolcall.jsonl``: llamafactory/glaive_toolcall_en (LLaMA-Factory's ShareGPT:
  ``conversations`` of ``human`` / ``function_call`` / ``observation`` / ``gpt`` turns, ``tools`` a
  JSON string of schemas, ``"[]"`` on rows without tools). The questions, function schemas and calls
  are the real BFCL v4 ones (``data/realworld/tools/``, simple_python and multiple: one call each),
  made OpenAI-style as BFCL's own OpenAI handler does (``dict`` -> ``object``, ``float`` -> ``number``,
  dots in names -> ``_``; each argument its first accepted value, left out where ``""`` comes first);
  the tool results and the answers after them are templated, and a few rows are plain chat.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SEED = 1234
DEFAULT_OUT_DIR = Path(__file__).resolve().parents[1] / "data" / "samples"
ALPACA_ROWS, ULTRACHAT_ROWS, THINKING_ROWS = 300, 200, 100
BFCL_DIR = Path(__file__).resolve().parents[1] / "data" / "realworld" / "tools"
BFCL_FILES = ("gorilla__bfcl_v4.simple_python.jsonl", "gorilla__bfcl_v4.multiple.jsonl")
PLAIN_TOOL_ROWS = 12  # glaive rows without tools ("tools": "[]")

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid",
    "Portugal": "Lisbon", "Japan": "Tokyo", "Canada": "Ottawa", "Egypt": "Cairo",
    "Kenya": "Nairobi", "Peru": "Lima", "Chile": "Santiago", "Norway": "Oslo",
    "Sweden": "Stockholm", "Poland": "Warsaw", "Greece": "Athens", "Ireland": "Dublin",
    "Austria": "Vienna", "Brazil": "Brasilia", "Argentina": "Buenos Aires", "India": "New Delhi",
}
UNITS = [  # (from, to, factor)
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("liters", "milliliters", 1000),
    ("days", "hours", 24), ("weeks", "days", 7),
]
WORDS = [
    "apple", "river", "green", "stone", "cloud", "tiger", "lamp", "book", "window", "garden",
    "music", "silver", "ocean", "pencil", "forest", "candle", "bridge", "orange", "winter", "paper",
]
DEVELOPER_PROMPTS = [
    "You are a careful assistant that answers briefly.",
    "You are a friendly tutor who explains simple facts.",
    "You are a precise calculator. Give exact answers.",
    "You are a helpful assistant.",
]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "Answer in one short sentence.", "Be concise and exact."]
# The opening, working and closing phrases of the analysis, per reasoning language.
REASONING_PHRASES = {
    "English": ("The user asks: {q}", "Let me work it out: {w}.", "So the answer is: {a}"),
    "French": ("L'utilisateur demande : {q}", "Je calcule : {w}.", "Donc la réponse est : {a}"),
    "German": ("Der Nutzer fragt: {q}", "Ich rechne: {w}.", "Also lautet die Antwort: {a}"),
    "Spanish": ("El usuario pregunta: {q}", "Lo resuelvo: {w}.", "Así que la respuesta es: {a}"),
    "Italian": ("L'utente chiede: {q}", "Lo risolvo: {w}.", "Quindi la risposta è: {a}"),
}


@dataclass(frozen=True)
class Problem:
    """One task instance: ``data`` is the alpaca ``input`` (None when the task has none)."""

    instruction: str
    data: str | None
    answer: str
    working: str  # language-neutral steps, used for the thinking datasets' analysis

    @property
    def prompt(self) -> str:
        return self.instruction if self.data is None else f"{self.instruction}\n\n{self.data}"


def _numbers(rng: random.Random, low: int, high: int) -> list[int]:
    return [rng.randint(1, 99) for _ in range(rng.randint(low, high))]


def addition(rng: random.Random) -> Problem:
    a, b = rng.randint(1, 999), rng.randint(1, 999)
    return Problem(f"What is {a} + {b}?", None, f"{a} + {b} = {a + b}.", f"{a} + {b} = {a + b}")


def multiplication(rng: random.Random) -> Problem:
    a, b = rng.randint(2, 30), rng.randint(2, 12)
    return Problem(f"What is {a} times {b}?", None, f"{a} x {b} = {a * b}.", f"{a} x {b} = {a * b}")


def capital(rng: random.Random) -> Problem:
    country = rng.choice(sorted(CAPITALS))
    city = CAPITALS[country]
    return Problem(
        f"What is the capital of {country}?", None, f"The capital of {country} is {city}.", f"{country} -> {city}"
    )


def unit_conversion(rng: random.Random) -> Problem:
    source, target, factor = rng.choice(UNITS)
    amount = rng.randint(2, 50)
    return Problem(
        f"Convert {amount} {source} to {target}.",
        None,
        f"{amount} {source} is {amount * factor} {target}.",
        f"{amount} x {factor} = {amount * factor}",
    )


def multiples(rng: random.Random) -> Problem:
    base, count = rng.randint(2, 12), rng.randint(3, 12)
    values = ", ".join(str(base * i) for i in range(1, count + 1))
    return Problem(f"List the first {count} multiples of {base}.", None, values, f"{base} x 1 .. {base} x {count}")


def sort_numbers(rng: random.Random) -> Problem:
    values = _numbers(rng, 3, 15)
    ordered = ", ".join(map(str, sorted(values)))
    working = ordered.replace(", ", " <= ")
    return Problem("Sort the following numbers in ascending order.", ", ".join(map(str, values)), ordered, working)


def sum_numbers(rng: random.Random) -> Problem:
    values = _numbers(rng, 2, 8)
    expression = " + ".join(map(str, values))
    working = f"{expression} = {sum(values)}"
    return Problem("Add up the following numbers.", ", ".join(map(str, values)), str(sum(values)), working)


def reverse_words(rng: random.Random) -> Problem:
    words = rng.sample(WORDS, rng.randint(2, 10))
    reversed_text = " ".join(reversed(words))
    working = f"last word first: {reversed_text}"
    return Problem("Reverse the order of the words.", " ".join(words), reversed_text, working)


def uppercase(rng: random.Random) -> Problem:
    words = rng.sample(WORDS, rng.randint(1, 6))
    text = " ".join(words)
    return Problem("Rewrite the text in uppercase.", text, text.upper(), f"{text} -> {text.upper()}")


def count_words(rng: random.Random) -> Problem:
    words = [rng.choice(WORDS) for _ in range(rng.randint(2, 12))]
    answer = f"There are {len(words)} words."
    return Problem("How many words are in the following text?", " ".join(words), answer, f"count = {len(words)}")


TASKS_WITHOUT_INPUT: list[Callable[[random.Random], Problem]] = [
    addition, multiplication, capital, unit_conversion, multiples,
]
TASKS_WITH_INPUT: list[Callable[[random.Random], Problem]] = [
    sort_numbers, sum_numbers, reverse_words, uppercase, count_words,
]


def draw_problem(rng: random.Random, with_input_share: float = 0.4) -> Problem:
    tasks = TASKS_WITH_INPUT if rng.random() < with_input_share else TASKS_WITHOUT_INPUT
    return rng.choice(tasks)(rng)


def alpaca_text(instruction: str, input_text: str, output: str) -> str:
    """The ``text`` column of tatsu-lab/alpaca: the Stanford Alpaca prompt followed by the output."""
    if input_text:
        return (
            "Below is an instruction that describes a task, paired with an input that provides further context. "
            "Write a response that appropriately completes the request.\n\n"
            f"### Instruction:\n{instruction}\n\n### Input:\n{input_text}\n\n### Response:\n{output}"
        )
    return (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        f"### Instruction:\n{instruction}\n\n### Response:\n{output}"
    )


def alpaca_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for _ in range(count):
        problem = draw_problem(rng)
        input_text = problem.data or ""
        rows.append(
            {
                "instruction": problem.instruction,
                "input": input_text,
                "output": problem.answer,
                "text": alpaca_text(problem.instruction, input_text, problem.answer),
            }
        )
    return rows


def follow_up(rng: random.Random, previous: Problem) -> Problem:
    """A next user turn; arithmetic chains on the previous result so later turns depend on earlier ones."""
    chained = re.search(r"= (\d+)\.$", previous.answer)
    if chained:
        result = int(chained.group(1))
        extra = rng.randint(1, 20)
        working = f"{result} + {extra} = {result + extra}"
        return Problem(f"Now add {extra} to that result.", None, f"{working}.", working)
    return draw_problem(rng)


def ultrachat_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for _ in range(count):
        problem = draw_problem(rng)
        messages = []
        # ultrachat_200k itself has no system turns; some rows carry one to exercise that template path.
        if rng.random() < 0.2:
            messages.append({"role": "system", "content": rng.choice(SYSTEM_PROMPTS)})
        for _ in range(rng.randint(1, 4)):
            messages += [{"role": "user", "content": problem.prompt}, {"role": "assistant", "content": problem.answer}]
            problem = follow_up(rng, problem)
        prompt = next(m["content"] for m in messages if m["role"] == "user")
        rows.append({"prompt": prompt, "prompt_id": hashlib.sha256(prompt.encode()).hexdigest(), "messages": messages})
    return rows


def thinking_rows(rng: random.Random, count: int) -> list[dict]:
    rows = []
    for _ in range(count):
        problem = draw_problem(rng)
        language = rng.choice(sorted(REASONING_PHRASES))
        developer = rng.choice(DEVELOPER_PROMPTS)
        opening, working, closing = REASONING_PHRASES[language]
        analysis = " ".join(
            [opening.format(q=problem.prompt), working.format(w=problem.working), closing.format(a=problem.answer)]
        )
        rows.append(
            {
                "reasoning_language": language,
                "developer": developer,
                "user": problem.prompt,
                "analysis": analysis,
                "final": problem.answer,
                "messages": [
                    {"content": f"reasoning language: {language}\n\n{developer}", "role": "system", "thinking": None},
                    {"content": problem.prompt, "role": "user", "thinking": None},
                    {"content": problem.answer, "role": "assistant", "thinking": analysis},
                ],
            }
        )
    return rows


def _openai_schema(value):
    """A BFCL schema as JSON Schema: objects are typed "dict" and numbers "float" there."""
    if isinstance(value, dict):
        converted = {key: _openai_schema(item) for key, item in value.items()}
        if converted.get("type") in ("dict", "float"):
            converted["type"] = {"dict": "object", "float": "number"}[converted["type"]]
        return converted
    if isinstance(value, list):
        return [_openai_schema(item) for item in value]
    return value


def _tool_name(name: str) -> str:
    return name.replace(".", "_")


def glaive_toolcall_rows(rng: random.Random) -> list[dict]:
    rows = []
    for name in BFCL_FILES:
        for line in (BFCL_DIR / name).read_text(encoding="utf-8").splitlines():
            bfcl = json.loads(line)
            tools = [{"name": _tool_name(doc["name"]), "description": doc["description"],
                      "parameters": _openai_schema(doc["parameters"])} for doc in bfcl["function"]]
            ((function, accepted),) = bfcl["ground_truth"][0].items()
            arguments = {key: values[0] for key, values in accepted.items() if values and values[0] != ""}
            call = {"name": _tool_name(function), "arguments": arguments}
            shown = ", ".join(f"{key}={json.dumps(value)}" for key, value in arguments.items())
            rows.append({"conversations": [
                {"from": "human", "value": bfcl["question"][0][0]["content"]},
                {"from": "function_call", "value": json.dumps(call)},
                {"from": "observation", "value": json.dumps({"status": "ok", "request_id": rng.randrange(10_000)})},
                {"from": "gpt", "value": f"I called {call['name']} with {shown}; it completed successfully."},
            ], "tools": json.dumps(tools)})
    for _ in range(PLAIN_TOOL_ROWS):
        problem = draw_problem(rng, with_input_share=0.0)
        rows.append({"conversations": [{"from": "human", "value": problem.prompt},
                                       {"from": "gpt", "value": problem.answer}], "tools": "[]"})
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    out_dir = parser.parse_args().out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    # One generator per file, so changing one dataset does not reshuffle the others.
    write_jsonl(out_dir / "alpaca.jsonl", alpaca_rows(random.Random(SEED), ALPACA_ROWS))
    write_jsonl(out_dir / "ultrachat.jsonl", ultrachat_rows(random.Random(SEED + 1), ULTRACHAT_ROWS))
    write_jsonl(out_dir / "multilingual_thinking.jsonl", thinking_rows(random.Random(SEED + 2), THINKING_ROWS))
    tool_rows = glaive_toolcall_rows(random.Random(SEED + 3))
    write_jsonl(out_dir / "glaive_toolcall.jsonl", tool_rows)
    print(f"wrote {ALPACA_ROWS} + {ULTRACHAT_ROWS} + {THINKING_ROWS} + {len(tool_rows)} rows to {out_dir}")


if __name__ == "__main__":
    main()

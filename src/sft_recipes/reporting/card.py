"""`output_dir/README.md`: a model card written with huggingface_hub's ModelCard/ModelCardData.

The metadata header names the base model, the Hub datasets, the library and the base's licence
(where the base checkpoint's own card or config states one); the body says what a reader needs to
trust and use the result: base + revision, data + revisions + mixture shares, the recipe as run
(secrets redacted), hardware, steps, tokens, final losses, the export check and how to load it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import ModelCard, ModelCardData

from sft_recipes.reporting.export_check import ExportCheck
from sft_recipes.reporting.tracking import redact

CARD_FILE = "README.md"
TAGS = ["sft", "trl", "fsdp2", "sft-recipes"]


@dataclass
class DataSource:
    """One training data source; `share` is its mixture weight (None for a single source)."""

    name: str
    revision: str | None = None
    share: float | None = None
    split: str | None = None

    @property
    def on_hub(self) -> bool:
        """A Hub dataset id (`org/name`), not a local file or folder."""
        return not Path(self.name).exists() and self.name.count("/") == 1 and not self.name.startswith((".", "/"))


@dataclass
class CardFacts:
    base_model: str
    base_revision: str | None
    data_sources: list[DataSource]
    recipe_values: dict[str, Any]  # the merged, interpolated recipe as run (Recipe.values)
    recipe_path: str
    export_kind: str  # "full" (consolidated checkpoint) or "adapter" (PEFT)
    export_check: ExportCheck
    hardware: str
    world_size: int
    steps: int
    tokens_seen: int | None = None
    final_train_loss: float | None = None
    final_eval_loss: float | None = None
    license: str | None = None
    hub_model_id: str | None = None
    extra_tags: list[str] = field(default_factory=list)
    stand_in_note: str | None = None  # a tiny random stand-in (`tiny:llama`): its outputs are meaningless
    benchmarks: Any = None  # run/scoring.py's Benchmarks: base vs tuned per task, the gate

    @property
    def title(self) -> str:
        """The Hub id when pushed, else the model actually trained and its recipe: `tiny:llama SFT
        (recipes/tiny/llama8b.yaml)`, never the recipe's name alone (the tiny twin's is its real recipe's)."""
        if self.hub_model_id:
            return self.hub_model_id
        recipe = Path(self.recipe_path)
        if recipe.is_absolute() and recipe.is_relative_to(Path.cwd()):
            recipe = recipe.relative_to(Path.cwd())
        return f"{Path(self.base_model).name} SFT ({recipe.as_posix()})"


def data_sources_from(sources: list[dict[str, Any]]) -> list[DataSource]:
    """Source dicts (`name`/`path`/`dataset_name`, `revision`, `weight`/`share`, `split`) -> DataSource list,
    weights normalised to shares when there is more than one source."""
    parsed = []
    for source in sources:
        name = source.get("name") or source.get("path") or source.get("dataset_name")
        if not name:
            raise ValueError(f"data source {source!r} names no dataset: give it a 'name' (Hub id or local path).")
        weight = source.get("share", source.get("weight"))
        parsed.append(DataSource(str(name), source.get("revision") or source.get("dataset_revision"),
                                 None if weight is None else float(weight), source.get("split")))
    weights = [s.share for s in parsed]
    if len(parsed) > 1 and all(w is not None for w in weights):
        total = sum(weights)
        for source in parsed:
            source.share = source.share / total
    return parsed


def base_license(base_path: str | Path) -> str | None:
    """The licence the base checkpoint states: its card's `license` metadata, else a `license` key in config.json."""
    base_path = Path(base_path)
    card = base_path / CARD_FILE
    if card.is_file():
        license_ = ModelCard.load(card).data.license
        if license_:
            return license_
    config = base_path / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("license")
    return None


def last_logged(log_history: list[dict[str, Any]], key: str) -> float | None:
    values = [entry[key] for entry in log_history if key in entry]
    return float(values[-1]) if values else None


def recipe_yaml(recipe_values: dict[str, Any]) -> str:
    """The recipe as run, with any value holding a secret from the environment replaced by <redacted>."""
    return yaml.safe_dump(redact(dict(recipe_values)), sort_keys=False, default_flow_style=False, width=100)


def how_to_load(facts: CardFacts) -> str:
    where = facts.hub_model_id or "path/to/output_dir"
    if facts.export_kind == "adapter":
        return (
            "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            f"base = AutoModelForCausalLM.from_pretrained({facts.base_model!r}"
            + (f", revision={facts.base_revision!r}" if facts.base_revision else "") + ")\n"
            f"model = PeftModel.from_pretrained(base, {where!r})\n"
            f"tokenizer = AutoTokenizer.from_pretrained({where!r})\n```\n"
            "This is a LoRA adapter (PEFT); from an sft-recipes checkout, "
            "`.venv/bin/python scripts/merge_lora.py ADAPTER_DIR MERGED_DIR` writes a merged model."
        )
    return (
        "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
        f"model = AutoModelForCausalLM.from_pretrained({where!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({where!r})\n```\n"
        "A consolidated checkpoint (all weights); chat with it from an sft-recipes checkout: "
        "`make chat OUT=OUTPUT_DIR` (or `.venv/bin/python scripts/chat.py OUTPUT_DIR`)."
    )


def _fmt(value: float | None, spec: str = ".4f") -> str:
    return "n/a" if value is None else format(value, spec)


def benchmarks_section(benchmarks) -> str:
    """The card's base-vs-tuned table (lm-evaluation-harness, same tasks and settings), or what went wrong."""
    if benchmarks is None:
        return ""
    from sft_recipes.scores.compare import SCORES_PICTURE, markdown_table

    settings = benchmarks.settings
    shots = {task: each["num_fewshot"] for task, each in settings["per_task"].items() if each["num_fewshot"] is not None}
    fewshot = ", ".join(f"{task} {shot}-shot" for task, shot in shots.items()) or "each task's own few-shot setting"
    said = (f"the examples column counts what each task scored, {fewshot}, chat template "
            f"{'on' if settings['apply_chat_template'] else 'off'}"
            + (f", answers of at most {settings['max_gen_toks']} tokens" if settings["max_gen_toks"] else ""))
    if not benchmarks.rows:
        return f"## Benchmarks\n\nScoring failed: {benchmarks.error}. The export was not pushed.\n\n"
    verdict = ("**REGRESSED**: a task fell below the base by more than eval_max_regression allows; this export was "
               "not pushed.\n\n" if benchmarks.regressed else "")
    return (f"## Benchmarks\n\n{verdict}Scored with lm-evaluation-harness ({said}); stderr as lm-eval reports it. "
            f"Picture: `{SCORES_PICTURE}`.\n\n{markdown_table(benchmarks.rows)}\n\n")


def build_model_card(facts: CardFacts) -> ModelCard:
    is_adapter = facts.export_kind == "adapter"
    data = ModelCardData(
        base_model=facts.base_model,
        datasets=[s.name for s in facts.data_sources if s.on_hub] or None,
        library_name="peft" if is_adapter else "transformers",
        license=facts.license,
        tags=[*TAGS, *(["lora", "peft"] if is_adapter else []), *facts.extra_tags],
    )
    def share(source: DataSource) -> str:
        if source.share is None:
            return "100%" if len(facts.data_sources) == 1 else "n/a"
        return _fmt(source.share, ".1%")

    data_rows = "\n".join(f"| {s.name} | {s.revision or 'unpinned'} | {s.split or 'train'} | {share(s)} |"
                          for s in facts.data_sources)
    tokens = f"{facts.tokens_seen:,} (input tokens of the steps run, padding left out)" if facts.tokens_seen else "n/a"
    note = f"\n> **Note:** {facts.stand_in_note}\n" if facts.stand_in_note else ""
    body = f"""
# {facts.title}
{note}
Supervised fine-tune of **{facts.base_model}** (revision `{facts.base_revision or 'unpinned'}`)
as a {'LoRA adapter (PEFT)' if is_adapter else 'full model (consolidated checkpoint)'}, trained with
TRL's SFTTrainer under FSDP2 by the sft-recipes recipe `{facts.recipe_path}`.

## Data

| source | revision | split | share |
| --- | --- | --- | --- |
{data_rows}

## Training

| | |
| --- | --- |
| hardware | {facts.hardware} |
| world size | {facts.world_size} processes |
| optimizer steps | {facts.steps} |
| tokens seen | {tokens} |
| final train loss | {_fmt(facts.final_train_loss)} |
| final eval loss | {_fmt(facts.final_eval_loss)} |
| export check | {facts.export_check.describe()} |

{benchmarks_section(facts.benchmarks)}## How to load

{how_to_load(facts)}

## Recipe (as run; secrets are never written)

```yaml
{recipe_yaml(facts.recipe_values).rstrip()}
```
"""
    return ModelCard(f"---\n{data.to_yaml()}\n---\n{body}")


def write_model_card(facts: CardFacts, output_dir: str | Path) -> Path:
    """Write `output_dir/README.md` (rank 0's job) and return its path."""
    path = Path(output_dir) / CARD_FILE
    build_model_card(facts).save(path)
    return path

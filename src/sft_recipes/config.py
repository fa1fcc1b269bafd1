"""The recipe schema: one flat YAML mapped onto TRL's dataclasses plus ours, with overrides.

A recipe key belongs to exactly one of `DataArguments`, `ModelArguments` or `TrainingArguments`
(TRL's `SFTConfig` extended); any key can be overridden, from two sources that win in this order:

    recipe YAML  <  HYPERPARAMETERS_PATH (a workload's `parameters:` block)  <  `--key value` / train(**kw)

Databricks AI Runtime writes a workload's `parameters:` block to a YAML file and names it in
HYPERPARAMETERS_PATH; it gets exactly the checks of the command line. Unlike TRL's own parser,
every unknown key is an error naming the closest valid keys (and the file or flag that set it),
every value is type- and range-checked against its field before anything heavy happens, all
problems are reported at once, and string values may use `${VAR}` / `${VAR:-default}`.
`Recipe.overrides` keeps which keys each source set, for the log, run_summary.json and MLflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import enum
import logging
import os
import re
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from trl import ModelConfig, ScriptArguments, SFTConfig

from sft_recipes.data.blocks import PACKING_WINDOW
from sft_recipes.data.formats import FORMATS
from sft_recipes.errors import RecipeError
from sft_recipes.launch import read_yaml as _read_yaml
from sft_recipes.value_ranges import range_problems

DatasetFormatName = Literal[tuple(FORMATS)]


@dataclass
class DataArguments(ScriptArguments):
    """TRL's dataset arguments plus how rows become training text."""

    dataset_format: DatasetFormatName = field(
        default="messages",
        metadata={"help": "Row schema, one of sft_recipes.data.formats.FORMATS: " + "; ".join(
            f"'{name}' ({fmt.description})" for name, fmt in FORMATS.items())},
    )
    dataset_revision: str | None = field(default=None, metadata={"help": "Dataset commit/tag to pin."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use only the first N rows."})
    max_dropped_share: float = field(
        default=0.05,
        metadata={"help": "Refuse to train when more than this share of rows is dropped as bad (see the data report)."},
    )
    overlong_policy: Literal["truncate", "drop"] = field(
        default="truncate",
        metadata={"help": "Rows longer than max_length: 'truncate' (keep the first max_length tokens) or 'drop'."},
    )
    pack_blocks: bool = field(
        default=False,
        metadata={"help": "Pack conversations end to end into block-diagonal blocks of max_length tokens, "
                  "streamed and tokenized per rank (dataset_format: messages)."},
    )
    split_examples: bool = field(
        default=True,
        metadata={"help": "With pack_blocks: let a conversation run on into the next block (every block full), "
                  "or keep it whole (blocks packed best-fit over `packing_window` waiting conversations)."},
    )
    packing_window: int = field(
        default=PACKING_WINDOW,
        metadata={"help": "With pack_blocks and split_examples: false: how many waiting conversations a block may "
                  "choose from (it starts with the oldest, then takes the longest that fit); 1 = arrival order."},
    )
    min_pixels: int | None = field(
        default=None,
        metadata={"help": "Image rows: the fewest pixels an image is resized to (the image processor's shortest_edge); "
                  "None keeps the model's own. Bounds the image tokens from below."},
    )
    max_pixels: int | None = field(
        default=None,
        metadata={"help": "Image rows: the most pixels an image is resized to (longest_edge), i.e. at most "
                  "max_pixels / (patch_size * merge_size)**2 image tokens; None keeps the model's own."},
    )
    dataset_mapping: dict | None = field(
        default=None,
        metadata={"help": "dataset_format sharegpt: other column, key and role names, LLaMA-Factory's columns/tags "
                  "(messages, system, tools, role_tag, content_tag, user_tag, assistant_tag, system_tag, "
                  "function_tag, observation_tag); `mapping:` on a datasets entry."},
    )
    train_turns: Literal["all", "last"] = field(
        default="all",
        metadata={"help": "Chat rows: which assistant turns are in the loss: every one ('all'), or only each "
                  "conversation's last ('last', LLaMA-Factory's mask_history); earlier ones stay as context. A "
                  "message's own `train: false` / `weight: 0` keeps it out either way."},
    )
    chat_template_kwargs: dict | None = field(
        default=None, metadata={"help": "Extra chat-template variables, e.g. {enable_thinking: false}."}
    )
    datasets: list[dict] | None = field(
        default=None,
        metadata={"help": "A weighted mixture instead of dataset_name: TRL's DatasetConfig entries (path, name, data_dir, "
                  "data_files, split, columns, fraction) plus revision and dataset_format (see data/mixture.py)."},
    )
    eval_datasets: list[dict] | None = field(
        default=None, metadata={"help": "Explicit eval data: entries shaped as in `datasets` (fraction not used)."}
    )
    test_split_size: float | None = field(
        default=None,
        metadata={"help": "Share of each source's rows held out for eval, chosen by a hash of the row (data/heldout.py)."},
    )
    streaming: bool = field(
        default=False, metadata={"help": "TRL's mixture name for dataset_streaming: either one streams the data."}
    )
    mixture_strategy: Literal["first_exhausted", "all_exhausted"] = field(
        default="first_exhausted",
        metadata={"help": "How long a mixture runs (datasets' stopping_strategy names): until its first source is used "
                  "up (no source repeated, TRL's rule), or until every source is used once (smaller shares repeated)."},
    )

    def __post_init__(self):
        from sft_recipes.data.mixture import check_data_sources

        self.dataset_streaming = self.dataset_streaming or self.streaming  # one flag for every reader
        check_data_sources(self)


@dataclass
class ModelArguments(ModelConfig):
    """TRL's model arguments plus what the recipes need to export and track a run."""

    export_dtype: Literal["auto", "bfloat16", "float32"] = field(
        default="auto",
        metadata={"help": "dtype of the consolidated checkpoint; 'auto' keeps the training dtype."},
    )
    verify_export: bool = field(
        default=True,
        metadata={"help": "Reload the exported checkpoint on rank 0 and compare logits with the trained model."},
    )
    mlflow_experiment_name: str | None = field(
        default=None, metadata={"help": "Default MLflow experiment; MLFLOW_EXPERIMENT_NAME wins when set."}
    )
    lora_rank_pattern: dict[str, int] | None = field(
        default=None,
        metadata={"help": "LoRA rank per target, by the end of its name (PEFT rank_pattern), e.g. "
                  "{mlp.experts.down_proj: 8}; targets not named get lora_r."},
    )
    lora_alpha_pattern: dict[str, int] | None = field(
        default=None,
        metadata={"help": "LoRA alpha per target, by the end of its name (PEFT alpha_pattern); others get lora_alpha."},
    )
    freeze_vision_tower: bool = field(
        default=True,
        metadata={"help": "A VLM's vision tower (patch embedding, blocks) is not trained; with image data, false "
                  "trains it too. Text-only data always leaves it frozen (it gets no gradient)."},
    )
    train_vision_merger: bool = field(
        default=True,
        metadata={"help": "With image data and a frozen tower: still train the merger (the projector from the tower "
                  "into the text model), as Qwen-VL fine-tuning usually does."},
    )
    dequantize_mxfp4: bool = field(
        default=False,
        metadata={"help": "Load an MXFP4 checkpoint (gpt-oss) dequantized to `dtype` (Mxfp4Config(dequantize=True)), "
                  "the only trainable form; a checkpoint that is not MXFP4 loads as it is."},
    )

    def __post_init__(self):
        super().__post_init__()
        from sft_recipes.lora import check_lora_arguments

        check_lora_arguments(self)


@dataclass
class TrainingArguments(SFTConfig):
    """TRL's SFTConfig plus the FSDP2 settings an accelerate config file cannot express."""

    global_batch_size: int | None = field(
        default=None,
        metadata={"help": "Sequences per optimizer step; gradient_accumulation_steps is derived from the world size."},
    )
    global_batch_tokens: int | None = field(
        default=None,
        metadata={"help": "Tokens per optimizer step (a multiple of max_length); derives gradient accumulation."},
    )
    fsdp_reduce_dtype: Literal["float32", "bfloat16"] = field(
        default="float32",
        metadata={"help": "Gradient reduce-scatter dtype under FSDP2 mixed precision (fp32 keeps small updates)."},
    )
    fp8: bool = field(
        default=False,
        metadata={"help": "Train the text decoder layers' Linear layers in float8 (torchao; emulated on CPU; GPUs of "
                  "compute capability 8.9+). Embeddings, LM head and MoE routers stay in the compute dtype."},
    )
    plan_memory_headroom_gib: float = field(
        default=2.0,
        metadata={"help": "--dry-run: GiB per GPU a suggested layout must leave free beyond the plan's own CUDA and "
                  "fragmentation allowance (the memory model's error, other processes); one leaving less is not offered."},
    )
    max_nonfinite_steps_in_a_row: int = field(
        default=3,
        metadata={"help": "Steps with a non-finite gradient norm are skipped; after this many in a row, checkpoint and stop."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={"help": "Start over in an output_dir that holds checkpoints (of this or another recipe); they are "
                          "moved to output_dir/set-aside-<time>/, never deleted."},
    )
    fsdp_wrap_classes: list[str] | None = field(
        default=None,
        metadata={"help": "Module classes FSDP2 shards as one unit each. Default: the accelerate config's "
                  "fsdp_transformer_layer_cls_to_wrap when set, else the model's _no_split_modules (GptOssDecoderLayer)."},
    )
    sample_prompts: list[str | dict] | None = field(
        default=None,
        metadata={"help": "User turns answered greedily by the base model before training and by the reloaded export "
                  "after it, side by side in output_dir/samples.md; an image run also takes {text: ..., images: "
                  "[path, ...]} (docs/vision.md). Default: the first 3 user turns of the data (image rows with "
                  "their images); [] = no samples."},
    )
    sample_max_new_tokens: int = field(default=64, metadata={"help": "Longest sample answer, in tokens."})
    eval_tasks: list[str | dict] | None = field(
        default=None,
        metadata={"help": "Benchmark tasks lm-evaluation-harness scores the export and the base model on, after the "
                  "export check (docs/evaluation.md): a task shipped in evals/tasks/ (alpaca_answers, gsm8k_local, "
                  "ifeval_local), a local lm-eval task YAML, or an lm-eval registry task (its data from the Hub); an "
                  "entry may be "
                  "{task: ..., limit: N, num_fewshot: K, metric: 'metric,filter'}."},
    )
    eval_limit: int | None = field(
        default=None, metadata={"help": "Examples scored per task (the first N), unless the task entry sets its own."})
    eval_num_fewshot: int | None = field(
        default=None, metadata={"help": "Few-shot examples per prompt, unless the task entry sets its own (None: "
                                        "the task's own)."})
    eval_max_regression: float | dict[str, float] | None = field(
        default=None,
        metadata={"help": "Gate: a task whose score drops from base to tuned by more than this (one number, or task "
                  "-> number) refuses the run after the export (kept, marked regressed): no Hub push, exit 2."},
    )
    eval_max_gen_toks: int | None = field(
        default=None, metadata={"help": "Longest generated answer in generation tasks (None: each task's own)."})
    eval_apply_chat_template: bool = field(
        default=False, metadata={"help": "Prompt through the tokenizer's chat template (instruction-tuned models)."})
    eval_cache_dir: str = field(
        default=".cache/evals",
        metadata={"help": "Scores kept per model, revision, task and settings: a resume or re-run scores the base "
                  "once."},
    )
    include_num_input_tokens_seen: str | bool = field(
        default="non_padding",
        metadata={"help": "Count the input tokens trained on (the model card's `tokens seen`, kept in checkpoints): "
                  "padding left out, a sequence-parallel group's block once; one number gathered per micro-batch. "
                  "'no' turns it off (transformers' default)."},
    )
    sequence_parallel_size: int = field(
        default=1,
        metadata={"help": "Ranks that share each packed block (Ulysses sequence parallelism): each holds 1/N of its "
                  "tokens and runs every token-mixing op over the full block for 1/N of the heads. Must divide the "
                  "world size; needs pack_blocks."},
    )

    def __post_init__(self):
        super().__post_init__()
        if self.sample_prompts is not None and not (isinstance(self.sample_prompts, list) and all(
                isinstance(prompt, (str, dict)) for prompt in self.sample_prompts)):
            raise ValueError(f"sample_prompts must be a list of prompts (strings, or {{text: ..., images: [...]}} "
                             f"mappings), got {self.sample_prompts!r}")


RECIPE_DATACLASSES = (DataArguments, ModelArguments, TrainingArguments)

# Keys that must never be written into a recipe: they would end up in saved training arguments.
SECRET_KEYS = {"hub_token": "HF_TOKEN"}

# Where Databricks AI Runtime writes a workload's `parameters:` block (a YAML mapping of recipe keys).
PARAMETERS_ENV = "HYPERPARAMETERS_PATH"

_ENV_PATTERN = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


@dataclass
class Recipe:
    data: DataArguments
    model: ModelArguments
    training: TrainingArguments
    source: Path
    values: dict[str, Any]  # the merged, interpolated key/values, for logging and planning
    # The keys each override source set, with their values: {"parameters": {...}, "command_line": {...}}
    # (sources that set nothing are left out; a key set by both appears under both, the later one won).
    overrides: dict[str, dict[str, Any]] = field(default_factory=dict)


def recipe_field_owners() -> dict[str, list[type]]:
    """Every recipe key, with the argument dataclasses that take it (a key such as `seed` belongs to more than one)."""
    owners: dict[str, list[type]] = {}
    for cls in RECIPE_DATACLASSES:
        for f in dataclasses.fields(cls):
            if f.init:
                owners.setdefault(f.name, []).append(cls)
    return owners


def _type_hints(cls: type) -> dict[str, Any]:
    hints: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            hints.update(typing.get_type_hints(klass))
    return hints


def interpolate_env(value: Any, missing: list[str]) -> Any:
    """Expand ${VAR} and ${VAR:-default} in every string of a YAML value; record unset names."""
    if isinstance(value, str):

        def expand(match: re.Match) -> str:
            name, default = match.group(1), match.group(2)
            if name in os.environ:
                return os.environ[name]
            if default is not None:
                return default
            missing.append(name)
            return match.group(0)

        expanded = _ENV_PATTERN.sub(expand, value)
        # A value that was only a variable reads as YAML would ("8" -> 8, "true" -> True).
        return yaml.safe_load(expanded) if expanded != value and _ENV_PATTERN.fullmatch(value) else expanded
    if isinstance(value, dict):
        return {k: interpolate_env(v, missing) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate_env(v, missing) for v in value]
    return value


def _yaml_no_as_choice(value: Any, choices: list[Any]) -> str:
    """`save_strategy: no` as transformers spells it: YAML 1.1 reads an unquoted `no` (and `off`) as false, so false
    means the choice "no" where there is one. Otherwise TypeError naming the choices."""
    if value is False and "no" in choices:
        return "no"
    raise TypeError(f"one of {choices}")


def _coerce(value: Any, annotation: Any) -> Any:
    """Return `value` as `annotation`, or raise TypeError. Accepts what YAML and the CLI produce."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg)
            except TypeError as err:
                errors.append(str(err))
        raise TypeError(" or ".join(errors))
    if origin is Literal:
        if value in args:
            return value
        return _yaml_no_as_choice(value, list(args))
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        choices = [m.value for m in annotation]
        if value in choices or isinstance(value, annotation):
            return value
        return _yaml_no_as_choice(value, choices)
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise TypeError("true or false")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError("an integer")
    if annotation is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # PyYAML reads "2e-5" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise TypeError("a number")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise TypeError("a string")
    if origin is list:
        if isinstance(value, list):
            return [_coerce(v, args[0]) for v in value] if args else value
        raise TypeError("a list")
    if origin is dict or annotation is dict:
        if isinstance(value, dict):
            return value
        raise TypeError("a mapping")
    return value  # types we do not model (callables, objects): let the dataclass validate


def _coerce_to_field(value: Any, annotation: Any) -> Any:
    """`_coerce`, where one value for a list-typed key is a list of it: TRL's parser reads `--lora_target_modules
    all-linear` as [all-linear], and so do we (on the command line and in a recipe)."""
    try:
        return _coerce(value, annotation)
    except TypeError as refused:
        if value is None or isinstance(value, (list, dict)) or not _takes_a_list(annotation):
            raise
        try:
            return _coerce([value], annotation)
        except TypeError:
            raise refused from None


def _takes_a_list(annotation: Any) -> bool:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_a_list(arg) for arg in typing.get_args(annotation))
    return typing.get_origin(annotation) is list


def _override_tokens(argv: list[str]) -> Iterator[tuple[str, list[str], bool]]:
    """(key, raw values, written bare) for each `--key value [value ...]`, `--key=value` or bare `--flag` (its value
    "true"). Several words after one key are its values, as TRL's parser reads `--lora_target_modules q_proj v_proj`."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--") or token == "--":
            raise RecipeError(f"Unexpected argument {token!r}: overrides are written `--key value` or `--key=value`.")
        key, sep, raw = token[2:].partition("=")
        i += 1
        raws = [raw] if sep else []
        while not sep and i < len(argv) and not argv[i].startswith("--"):
            raws.append(argv[i])
            i += 1
        yield key.replace("-", "_"), raws or ["true"], not raws


def parse_cli_overrides(argv: list[str]) -> dict[str, Any]:
    """`--key value`, `--key=value` and bare `--flag` (true) into a dict of YAML-typed values; `--key a b` is [a, b]."""
    overrides: dict[str, Any] = {}
    for key, raws, _ in _override_tokens(argv):
        values = [_yaml_value(key, raw) for raw in raws]
        overrides[key] = values[0] if len(values) == 1 else values
    return overrides


def _yaml_value(key: str, raw: str) -> Any:
    try:
        return yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or " ".join(str(err).split())
        raise RecipeError(f"--{key} {raw!r} is not a YAML value ({problem}): quote the value as one shell word and "
                          "close its brackets, e.g. --eval_max_regression '{gsm8k_local: 0.02}'.") from None


def _bare_flags(argv: list[str]) -> set[str]:
    """The keys written as a bare `--flag` (read as true by parse_cli_overrides), not `--flag true`."""
    return {key for key, _, bare in _override_tokens(argv) if bare}


# What a key whose type refused a value takes, where its type alone ("a string") does not say it.
VALUES_TAKEN = {
    "resume_from_checkpoint": "auto (the default: the newest complete checkpoint in output_dir, else a fresh start), "
                              "the path of a checkpoint-N folder, or null (no resume)",
}


def _pass_a_recipe(folder: Path = Path("recipes")) -> str:
    """The fix for a recipe path that is no file: the YAML files in `folder` and its subfolders (else the shipped
    recipes) by name."""
    listed = sorted(p.as_posix() for pattern in ("*.yaml", "*/*.yaml") for p in folder.glob(pattern))
    if not listed and folder != Path("recipes"):
        return _pass_a_recipe()
    hint = f": one of {', '.join(listed)}" if listed else ", e.g. recipes/tiny/llama8b.yaml"
    return f"Pass the path of a recipe YAML{hint}."


def read_recipe_file(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise RecipeError(f"{path} is a folder, not a recipe file. {_pass_a_recipe(path)}")
    if not path.is_file():
        raise RecipeError(f"Recipe file not found: {path}. {_pass_a_recipe()}")
    values = _read_yaml(path, str(path)) or {}
    if not isinstance(values, dict):
        raise RecipeError(f"{path} must be a mapping of key: value, got {type(values).__name__}: write one "
                          "`key: value` per line, as in recipes/tiny/llama8b.yaml.")
    return values


def read_parameters_file() -> tuple[dict[str, Any], str | None]:
    """The overrides in the file HYPERPARAMETERS_PATH names, and how to name it in a message ({}, None: unset)."""
    path = os.environ.get(PARAMETERS_ENV)
    if not path:
        return {}, None
    origin = f"{PARAMETERS_ENV}={path}"
    if not Path(path).is_file():
        raise RecipeError(f"{origin} names no file: point it at the YAML of the workload's `parameters:` block, "
                          f"or unset {PARAMETERS_ENV}.")
    values = _read_yaml(Path(path), origin)
    if values is None:  # an empty `parameters:` block
        return {}, origin
    if not isinstance(values, dict):
        raise RecipeError(f"{origin} must be a mapping of recipe key: value (the workload's `parameters:` block), "
                          f"got {type(values).__name__}.")
    return values, origin


# The batch per optimizer step, stated (the accumulation then follows the world size).
GLOBAL_BATCH_KEYS = ("global_batch_size", "global_batch_tokens")


def without_overridden_batch_keys(*sources: dict[str, Any]) -> list[dict[str, Any]]:
    """The sources, earliest first, minus the batch keys of earlier ones where a later source states the global batch:
    `--global_batch_size 64` on a recipe that fixes `gradient_accumulation_steps` trains 64 sequences per step with
    the accumulation derived. The other way round stays refused by the lint (a fixed accumulation beside a stated
    global batch would silently train another batch on another layout)."""
    pruned = [dict(source) for source in sources]
    for index, source in enumerate(pruned):
        if any(key in source for key in GLOBAL_BATCH_KEYS):
            for earlier in pruned[:index]:
                for key in (*GLOBAL_BATCH_KEYS, "gradient_accumulation_steps"):
                    earlier.pop(key, None)
    return pruned


def _where_an_override_is_set(key: str, overrides_source: str) -> str:
    """How a problem names an override it came from: the user fixes it there, not in the recipe file."""
    if overrides_source == "command_line":
        return f" (set by --{key})"
    if overrides_source == "keyword_arguments":
        return f" (set by train({key}=...))"
    return f" (set in the {overrides_source} overrides)"


TRANSFORMERS_CPU_COMPILE_HINT = "The speedups for torchdynamo mostly come with GPU Ampere or higher"


@contextlib.contextmanager
def _without_transformers_cpu_compile_hint():
    """TrainingArguments warns, from every rank and from a dry run planning for GPUs, that `torch_compile` speeds up
    GPUs, not this machine: noise here (a CPU twin compiles to check the GPU path; the run's `[compile]` line says
    what was compiled)."""
    def not_the_hint(record: logging.LogRecord) -> bool:
        return TRANSFORMERS_CPU_COMPILE_HINT not in record.getMessage()

    logger = logging.getLogger("transformers.training_args")
    logger.addFilter(not_the_hint)
    try:
        yield
    finally:
        logger.removeFilter(not_the_hint)


def _where_to_fix_a_rejection(message: str, values: dict[str, Any], set_by: dict[str, str], path) -> str:
    """A dataclass's own refusal names a key or its value, not where it was set: name the overrides it mentions."""
    def mentioned(key: str) -> bool:
        value = values.get(key)
        return re.search(rf"\b{re.escape(key)}\b", message) is not None or (
            isinstance(value, str) and len(value) > 1 and value in message)

    overridden = [f"{key}{set_by[key]}" for key in set_by if mentioned(key)]
    if overridden:
        return f"Fix it where it is set: {', '.join(overridden)}; else in {path}"
    return f"Fix that key in {path}"


def load_recipe(path: str | os.PathLike, overrides: list[str] | dict[str, Any] | None = None,
                planning: bool = False, overrides_source: str = "command_line",
                override_origins: dict[str, str] | None = None) -> Recipe:
    """Parse, interpolate, validate and build the dataclasses of one recipe. Raises RecipeError.

    `overrides`: `--key value` tokens or a dict, winning over the recipe and over HYPERPARAMETERS_PATH;
    `overrides_source` names them in `Recipe.overrides` (train() passes "keyword_arguments");
    `override_origins` names, per override key, where the user wrote it (the workload check: a workload's
    `parameters:` or command), so that a problem with it points there, not at the recipe file.
    `planning`: validate a GPU recipe on a machine without a GPU (dry runs, tests) -- the
    TrainingArguments are built with `use_cpu`, which TrainingArguments demands there for bf16;
    `values` still holds what the recipe says.
    """
    values = read_recipe_file(path)
    parameters, parameters_origin = read_parameters_file()
    cli = parse_cli_overrides(overrides) if isinstance(overrides, list) else dict(overrides or {})
    bare_flags = _bare_flags(overrides) if isinstance(overrides, list) else set()
    values, parameters, cli = without_overridden_batch_keys(values, parameters, cli)
    values.update(parameters)
    values.update(cli)
    sources = {"parameters": parameters, overrides_source: cli}
    set_by = {**{key: f" (set in {parameters_origin})" for key in parameters},
              **{key: f" (set in {override_origins[key]})" if key in (override_origins or {})
                 else _where_an_override_is_set(key, overrides_source) for key in cli}}

    missing_env: list[str] = []
    values = {key: interpolate_env(value, missing_env) for key, value in values.items()}

    owners = recipe_field_owners()
    hints = {cls: _type_hints(cls) for cls in RECIPE_DATACLASSES}
    problems: list[tuple[str | None, str]] = []  # (the key it is about, if one; the problem)
    if missing_env:
        names = ", ".join(sorted(set(missing_env)))
        problems.append((None, f"environment variable(s) {names} are not set: export them or write "
                               "${VAR:-default}"))
    kwargs: dict[type, dict[str, Any]] = {cls: {} for cls in RECIPE_DATACLASSES}
    for key, value in values.items():
        origin = set_by.get(key, "")  # names the override or parameters file when the key came from there
        if key in SECRET_KEYS:
            problems.append((key, f"'{key}' must not be written in a recipe{origin}: set the {SECRET_KEYS[key]} "
                                  "environment variable"))
            continue
        if key not in owners:
            close = difflib.get_close_matches(key, owners.keys(), n=3, cutoff=0.6)
            hint = (f"; did you mean {', '.join(repr(c) for c in close)}?" if close else
                    ": remove it, or use a field of DataArguments, ModelArguments or TrainingArguments "
                    "(src/sft_recipes/config.py)")
            problems.append((key, f"unknown key '{key}'{origin}{hint}"))
            continue
        for cls in owners[key]:
            try:
                kwargs[cls][key] = _coerce_to_field(value, hints[cls][key])
            except TypeError as err:
                if value is True and key in bare_flags:
                    origin = f" (a bare --{key} reads as true: give it a value)"
                takes = f": it takes {VALUES_TAKEN[key]}" if key in VALUES_TAKEN else ""
                problems.append((key, f"'{key}' must be {err}, got {value!r} ({type(value).__name__}){origin}{takes}"))
                break
        else:
            problems += [(key, problem + origin) for problem in range_problems({key: kwargs[owners[key][0]][key]})]
    if problems:
        listed = "; ".join(problem for _, problem in problems)
        end = "" if listed.endswith("?") else "."  # a last problem that asks 'did you mean ...?' ends its sentence
        fix = (f"Fix each where it is set (in parentheses), else in {path}"
               if any(set_by.get(key) for key, _ in problems if key) else f"Fix these in {path}")
        raise RecipeError(f"{path}: {listed}{end} {fix}.")

    if planning and "use_cpu" not in values:
        kwargs[TrainingArguments]["use_cpu"] = True
    built = []
    for cls in RECIPE_DATACLASSES:
        try:
            with _without_transformers_cpu_compile_hint():
                built.append(cls(**kwargs[cls]))
        except (ValueError, TypeError) as err:
            raise RecipeError(f"{path}: {cls.__name__} rejected the recipe: {' '.join(str(err).split()).rstrip('.')}. "
                              f"{_where_to_fix_a_rejection(str(err), values, set_by, path)}.") from None
    data, model, training = built
    return Recipe(data=data, model=model, training=training, source=Path(path), values=values,
                  overrides={name: {key: interpolate_env(value, []) for key, value in given.items()}
                             for name, given in sources.items() if given})

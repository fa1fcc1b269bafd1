"""Sample generations before and after training, side by side in `output_dir/samples.md`.

Greedy, at most `max_new_tokens`, each prompt a single user turn rendered in the prompt format the run
trains (`prompt_style`): the chat template for chat formats, the alpaca seed's `### Instruction: ...
### Response:` text for alpaca data, the bare text for text data; a model asked in a format it was
not trained on answers in the one it was (every alpaca-trained answer began with `### Response:`).
A tiny random stand-in (`tiny:...`) says so at the top of samples.md: its answers are noise by design.
Image runs also answer prompts about images (a batch of one each, with the model's own multimodal positions):
`vision_samples.py` says where they come from and how they are rendered.
How it stays cheap and hang-free under FSDP2:

- before training on accelerators (`BaseSamplesCallback`, at `on_train_begin` of a fresh run): every rank runs the
  same greedy loop on its FSDP-wrapped model in lockstep, all prompts in one batch (one forward call
  per new token). Each forward all-gathers one layer at a time, as in training (no rank ever holds
  the whole model); rank 0's next tokens are broadcast each step, so every rank feeds the same
  tokens and stops on the same step: the number of forward calls (hence of collectives) is equal on
  all ranks by construction.
- before training on CPU (`write_base_samples`, rank 0, right after loading, before the Trainer
  shards the model): each forward of the lockstep path all-gathers every weight over gloo, which
  costs seconds per token on CPU; before sharding, every rank already holds the whole base model
  (it is loaded whole, then sharded), so rank 0 answers alone while the others wait at the Trainer's
  first collective.
- after training (`write_samples`, in the run's finish step, rank 0 only, after the export check):
  the reloaded export generates alone, outside any collective; the other ranks go on to the next
  collective of the finish step and wait there (bounded by `ddp_timeout`).
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback

from sft_recipes.architectures.sequence_parallel import sequence_parallel_suspended
from sft_recipes.reporting.replies import shown_reply
from sft_recipes.reporting.vision_samples import (
    ImagePrompt, prompt_json, recipe_image_prompt, row_image_prompt, shown_prompt,
)

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.md"
BEFORE_FILE = "samples_before.json"  # the base model's answers, kept for the end of a resumed run
DEFAULT_MAX_NEW_TOKENS = 64
DEFAULT_PROMPT_COUNT = 3
SourceRows = tuple[Iterable[dict], str]  # one source's raw rows (image rows: as checked) and their dataset_format
Prompt = str | ImagePrompt


def user_turn(row: dict[str, Any], dataset_format: str) -> Prompt | None:
    """The first user turn of a raw row (alpaca: instruction, then its input; an image row: with its images),
    None when it has none."""
    if dataset_format == "vision_messages":
        return row_image_prompt(row)
    if dataset_format == "alpaca":
        return row["instruction"] + (f"\n\n{row['input']}" if row.get("input") else "")
    if dataset_format == "text":
        return None
    if dataset_format == "prompt_completion":  # TRL's prompt strings, asked as plain text
        return row.get("prompt") or None
    return next((m["content"] for m in row.get("messages") or [] if m.get("role") == "user" and m.get("content")), None)


def default_sample_prompts(eval_sources: list[SourceRows], train_sources: list[SourceRows],
                           count: int = DEFAULT_PROMPT_COUNT) -> list[Prompt]:
    """The first `count` user turns of the held-out eval rows when there are any, else of the training rows.

    Each list holds (rows, dataset_format) per source; a mixture's prompts are taken from its sources in turn,
    so the samples show every kind of data it trains on."""
    for sources in (eval_sources, train_sources):
        per_source = [_user_turns(rows, dataset_format, count) for rows, dataset_format in sources]
        prompts = [turn for turns in itertools.zip_longest(*per_source) for turn in turns if turn is not None]
        if prompts:
            return prompts[:count]
    return []


def _user_turns(rows: Iterable[dict], dataset_format: str, count: int) -> list[Prompt]:
    turns = []
    for row in rows:
        if turn := user_turn(row, dataset_format):
            turns.append(turn)
        if len(turns) == count:
            break
    return turns


# How a prompt is put to the model, by the prompt format its training data has.
PROMPT_STYLES = {"chat": "chat template", "alpaca": "alpaca prompt `### Instruction: ... ### Response:`",
                 "text": "the prompt as plain text"}


def prompt_style(data_args) -> str:
    """The prompt format the run trains: "alpaca" or "text" (text or prompt_completion) when every training source
    has that format, else
    "chat" (chat formats, alpaca_chat, or a mixture of styles: the chat template is the instruct model's own)."""
    from sft_recipes.data.mixture import training_sources

    # prompt_completion strings are a prompt continued as plain text, as `text` rows are
    styles = {"alpaca": "alpaca", "text": "text", "prompt_completion": "text"}
    kinds = {styles.get(source.dataset_format, "chat") for source in training_sources(data_args)}
    return kinds.pop() if len(kinds) == 1 else "chat"


def sample_settings(recipe) -> dict[str, Any]:
    """How a run generates its samples: `max_new_tokens`, the prompt format it trains and the chat template's
    extra variables."""
    return {"max_new_tokens": recipe.training.sample_max_new_tokens, "style": prompt_style(recipe.data),
            "chat_template_kwargs": recipe.data.chat_template_kwargs}


def random_stand_in(model_name_or_path: str) -> str | None:
    """The note samples.md and scripts/show_run.py print for a tiny random stand-in (`tiny:llama`), else None."""
    from sft_recipes.loading import TINY_SCHEME

    if not str(model_name_or_path).startswith(TINY_SCHEME):
        return None
    return (f"{model_name_or_path} is a tiny randomly initialised stand-in: its answers are meaningless by design "
            "(the run proves the machinery: data, FSDP2, checkpoints, export); run recipes/smollm2-135m.yaml "
            "(`make demo-real`) for answers that mean something.")


def answers_in_lockstep(training_args) -> bool:
    """Accelerator runs answer on the sharded model in lockstep; CPU runs on rank 0 before sharding (over gloo,
    gathering every weight for each new token costs seconds)."""
    return training_args.device.type != "cpu"


def sample_prompts_for_run(training_args, train_sources: list[SourceRows], eval_sources: list[SourceRows] = ()
                           ) -> list[Prompt]:
    """The recipe's `sample_prompts` (a mapping is a prompt about images: `vision_samples.recipe_image_prompt`), else
    the defaults from the data ([] turns samples off)."""
    if training_args.sample_prompts is not None:
        return [prompt if isinstance(prompt, str) else recipe_image_prompt(prompt, index)
                for index, prompt in enumerate(training_args.sample_prompts)]
    return default_sample_prompts(list(eval_sources), train_sources)


def chat_prompt_ids(tokenizer, prompt: str, chat_template_kwargs: dict | None = None) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True,
                                              **(chat_template_kwargs or {}))["input_ids"])


def prompt_ids(tokenizer, prompt: str, style: str = "chat", chat_template_kwargs: dict | None = None) -> list[int]:
    """`prompt` as the run's training put such prompts to the model: alpaca and text rows are tokenized as TRL
    tokenizes them (the tokenizer's own special tokens, e.g. Llama's bos, first)."""
    if style == "chat":
        return chat_prompt_ids(tokenizer, prompt, chat_template_kwargs)
    from sft_recipes.data.formats import alpaca_prompt

    return list(tokenizer(alpaca_prompt(prompt, None) if style == "alpaca" else prompt)["input_ids"])


def stop_token_ids(model, tokenizer) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@torch.no_grad()
@sequence_parallel_suspended()  # generation gives each rank whole prompts, never chunks of a packed block
def greedy_generate(model, prompts_ids: list[list[int]], max_new_tokens: int, stop_ids: set[int], pad_id: int,
                    in_lockstep: bool = False, prefill: dict[str, torch.Tensor] | None = None) -> list[list[int]]:
    """Greedy continuations of all prompts at once (left-padded batch, KV cache): one forward call per new token.

    Returns each prompt's new token ids, its stop token included when reached. `in_lockstep`: every rank of
    the default process group calls this with the same prompts; rank 0's tokens are broadcast each step, so
    all ranks make the same number of forward calls (under FSDP2, each gathers the layers once per token).
    `prefill`: more inputs of the first forward (one image prompt: its pixels, and its position_ids [4, 1, L]
    in place of the text positions). Each new token's position is the previous maximum + 1 on every row.
    """
    device = next(model.parameters()).device
    longest = max(len(ids) for ids in prompts_ids)
    input_ids = torch.tensor([[pad_id] * (longest - len(ids)) + ids for ids in prompts_ids], device=device)
    attention_mask = torch.tensor([[0] * (longest - len(ids)) + [1] * len(ids) for ids in prompts_ids], device=device)
    prefill = {key: value.to(device) for key, value in (prefill or {}).items()}
    position_ids = prefill.pop("position_ids", None)
    if position_ids is None:
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    generated: list[list[int]] = [[] for _ in prompts_ids]
    done = torch.zeros(len(prompts_ids), dtype=torch.bool, device=device)
    stops = torch.tensor(sorted(stop_ids), dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    past = None
    try:
        for _ in range(max_new_tokens):
            output = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                           past_key_values=past, use_cache=True, **prefill)
            prefill = {}
            past = output.past_key_values
            next_tokens = output.logits[:, -1, :].argmax(dim=-1)
            if in_lockstep:
                dist.broadcast(next_tokens, src=0)
            for row, token in enumerate(next_tokens.tolist()):
                if not done[row]:
                    generated[row].append(token)
            done |= torch.isin(next_tokens, stops)
            if bool(done.all()):
                break
            input_ids = next_tokens.unsqueeze(-1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(input_ids)], dim=-1)
            position_ids = position_ids.amax(dim=-1, keepdim=True) + 1
    finally:
        model.train(was_training)
    return generated


def generate_answers(model, tokenizer, prompts: list[Prompt], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                     in_lockstep: bool = False, chat_template_kwargs: dict | None = None, style: str = "chat"
                     ) -> list[str]:
    """The text prompts in one batch, then each image prompt alone (its `prefill` made by `vision_samples.prepared`)."""
    texts = [index for index, prompt in enumerate(prompts) if isinstance(prompt, str)]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_token_ids(model, tokenizer)
    generated: dict[int, list[int]] = {}
    if texts:
        prompts_ids = [prompt_ids(tokenizer, prompts[index], style, chat_template_kwargs) for index in texts]
        generated.update(zip(texts, greedy_generate(model, prompts_ids, max_new_tokens, stops, pad_id, in_lockstep)))
    for index, prompt in enumerate(prompts):
        if isinstance(prompt, ImagePrompt):
            assert prompt.prefill is not None, "an image prompt is answered once prepared (vision_samples.prepared)"
            prefill = dict(prompt.prefill)
            ids = prefill.pop("input_ids")[0].tolist()
            [generated[index]] = greedy_generate(model, [ids], max_new_tokens, stops, pad_id, in_lockstep, prefill)
    return [shown_reply(tokenizer.decode(generated[index], skip_special_tokens=True)).strip()
            for index in range(len(prompts))]


def samples_markdown(prompts: list[Prompt], before: list[str] | None, after: list[str], style: str = "chat",
                     stand_in_note: str | None = None) -> str:
    def quoted(text: str) -> str:
        return "\n".join(f"> {line}" for line in (text or "(empty)").splitlines()) or "> (empty)"

    parts = [f"# Sample generations (greedy, {PROMPT_STYLES[style]})\n"]
    if stand_in_note:
        parts.append(f"**Note:** {stand_in_note}\n")
    for index, prompt in enumerate(prompts):
        parts.append(f"## {index + 1}. Prompt\n\n{quoted(shown_prompt(prompt))}\n")
        base_answer = quoted(before[index]) if before else "> (not generated)"
        parts.append(f"**Before training (base model)**\n\n{base_answer}\n")
        parts.append(f"**After training (reloaded export)**\n\n{quoted(after[index])}\n")
    return "\n".join(parts)


def timed_answers(model, tokenizer, prompts: list[Prompt], max_new_tokens: int, in_lockstep: bool = False,
                  chat_template_kwargs: dict | None = None, style: str = "chat") -> list[str]:
    started = time.perf_counter()
    answers = generate_answers(model, tokenizer, prompts, max_new_tokens, in_lockstep, chat_template_kwargs, style)
    logger.info("base model answered %d sample prompt(s) in %.1fs", len(answers), time.perf_counter() - started)
    return answers


def save_base_answers(output_dir: str | Path, prompts: list[Prompt], answers: list[str]) -> None:
    Path(output_dir).mkdir(parents=True, exist_ok=True)
    (Path(output_dir) / BEFORE_FILE).write_text(json.dumps({"prompts": [prompt_json(prompt) for prompt in prompts],
                                                            "answers": answers}, indent=2))


def write_base_samples(output_dir: str | Path, prompts: list[Prompt], model, tokenizer,
                       max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, chat_template_kwargs: dict | None = None,
                       style: str = "chat") -> None:
    """Rank 0, on the loaded base model before any sharding; kept when a resumed run finds it already written."""
    if (Path(output_dir) / BEFORE_FILE).is_file() or not prompts:
        return
    save_base_answers(output_dir, prompts, timed_answers(model, tokenizer, prompts, max_new_tokens,
                                                         chat_template_kwargs=chat_template_kwargs, style=style))


class BaseSamplesCallback(TrainerCallback):
    """The base model's answers, generated at the start of a fresh run on every rank in lockstep (accelerators).

    Rank 0 writes them to `output_dir/samples_before.json`; a resumed run keeps that file (its model is
    no longer the base).
    """

    def __init__(self, prompts: list[Prompt], max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                 chat_template_kwargs: dict | None = None, style: str = "chat") -> None:
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.chat_template_kwargs = chat_template_kwargs
        self.style = style

    def on_train_begin(self, args, state, control, model=None, processing_class=None, **kwargs):
        if state.global_step > 0 or not self.prompts:
            return
        answers = timed_answers(model, processing_class, self.prompts, self.max_new_tokens,
                                in_lockstep=dist.is_initialized() and dist.get_world_size() > 1,
                                chat_template_kwargs=self.chat_template_kwargs, style=self.style)
        if state.is_world_process_zero:
            save_base_answers(args.output_dir, self.prompts, answers)


def write_samples(output_dir: str | Path, prompts: list[Prompt], model, tokenizer,
                  max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, chat_template_kwargs: dict | None = None,
                  style: str = "chat", stand_in_note: str | None = None) -> Path:
    """Rank 0, after the export check: the reloaded export's answers beside the base's, into samples.md."""
    output_dir = Path(output_dir)
    after = generate_answers(model, tokenizer, prompts, max_new_tokens, chat_template_kwargs=chat_template_kwargs,
                             style=style)
    before_file = output_dir / BEFORE_FILE
    before = None
    if before_file.is_file():
        saved = json.loads(before_file.read_text())
        before = saved["answers"] if saved["prompts"] == [prompt_json(prompt) for prompt in prompts] else None
    path = output_dir / SAMPLES_FILE
    path.write_text(samples_markdown(prompts, before, after, style, stand_in_note))
    return path

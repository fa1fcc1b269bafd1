"""Score a model on tasks with EleutherAI's lm-evaluation-harness, one task at a time, cached.

`lm_eval.simple_evaluate` runs on an lm-eval model: an `HFLM` built around the model already in memory (an
export the run just reloaded, or one scripts/evaluate.py loaded), or lm-eval's vLLM model on a model folder
(scripts/evaluate.py --backend vllm). It runs once per task so each task keeps its own limit and few-shot count
and is cached on its own: under `cache_dir`, keyed by the model (name + revision, or a local folder's weight
files' sizes and times), the task's config and data bytes, the settings and lm-eval's version. A resume or a
re-run therefore scores the base model once.

Data-parallel (scripts/evaluate.py under `accelerate launch`): every process holds the whole model and scores
its share of each task's requests through lm-eval's own data-parallel path, which an `HFLM` around a model
instance skips ("assuming single-process call"); `data_parallel_hflm` gives it what its own launch would have
(the Accelerator, rank and world size). lm-eval returns the scores on rank 0 only; rank 0 alone reads and
writes the cache and sends every rank the same scores, so all ranks agree on which tasks to score.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sft_recipes.scores import import_lm_eval
from sft_recipes.scores.tasks import NO_FILTER, EvalTask, metric_keys

logger = logging.getLogger(__name__)

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf")


@dataclass(frozen=True)
class EvalSettings:
    """What every task of one comparison shares (base and tuned are scored with the same)."""

    batch_size: int = 8
    max_gen_toks: int | None = None  # caps generation tasks' answers (None: each task's own max_gen_toks)
    apply_chat_template: bool = False  # prompts through the tokenizer's chat template (instruction-tuned models)
    seed: int = 1234  # lm-eval's sampling seeds (few-shot example choice)
    backend: str = "hf"  # lm-eval's model class: "hf" (transformers, HFLM) or "vllm"


@dataclass(frozen=True)
class TaskScore:
    task: str
    metric: str  # "metric,filter"
    value: float
    stderr: float | None  # lm-eval's bootstrap / sample standard error; None where it reports "N/A"
    samples: int  # examples scored

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_key(name_or_path: str, revision: str | None = None) -> str:
    """The model's part of a cache key: a local folder by its weight files (a new export is a new key), a Hub
    id by id and revision."""
    path = Path(name_or_path)
    if path.is_dir():
        weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in path.iterdir()
                         if p.name.endswith(WEIGHT_SUFFIXES))
        return json.dumps([str(path.resolve()), weights])
    return json.dumps([name_or_path, revision or "main"])


def primary_metric(task: EvalTask, results: dict[str, Any]) -> str:
    """The metric the comparison reads: the one asked for, else the task's first metric under its first filter
    (a registry task: the first metric lm-eval reported)."""
    if task.metric:
        return task.metric
    if task.config is not None:
        return metric_keys(task.config)[0]
    return next(key for key in results if "_stderr" not in key and key != "alias" and "," in key)


def _cache_path(cache_dir: Path, model: str, task: EvalTask, settings: EvalSettings) -> Path:
    key = hashlib.sha256(json.dumps([model, task.fingerprint(), asdict(settings)]).encode()).hexdigest()[:32]
    return cache_dir / f"{task.name}-{key}.json"


def _run_task(lm, task: EvalTask, settings: EvalSettings) -> dict[str, Any]:
    lm_eval = import_lm_eval()
    from lm_eval.tasks import TaskManager

    # A local task goes in as its parsed config (data paths made absolute); a registry task by name, through
    # lm-eval's full index (~20 s, only then).
    spec = copy.deepcopy(task.config) if task.config is not None else task.name  # lm-eval edits configs in place
    if task.config is not None and task.num_fewshot is not None:
        # lm-eval never overrides a config's own `num_fewshot: 0` (gsm8k_local's default) with its num_fewshot
        # argument, only logs that it ignored it: the count asked for goes into the config itself (and the
        # argument stays None, or lm-eval warns that it overrides what the config now says).
        spec["num_fewshot"] = task.num_fewshot
    manager = TaskManager(include_defaults=task.config is None)
    # lm-eval warns of any gen_kwargs given ("Ensure 'do_sample=True' for non-greedy decoding!"): ours only bound the
    # answer's length, and the tasks decode greedily on purpose
    evaluator_logger, gen_kwargs_warning = logging.getLogger("lm_eval.evaluator"), _DropMessages("specified through cli")
    evaluator_logger.addFilter(gen_kwargs_warning)
    try:
        results = lm_eval.simple_evaluate(
            model=lm, tasks=[spec], task_manager=manager, limit=task.limit,
            num_fewshot=task.num_fewshot if task.config is None else None,
            apply_chat_template=settings.apply_chat_template, log_samples=False,
            gen_kwargs={"max_gen_toks": settings.max_gen_toks} if settings.max_gen_toks else None,
            random_seed=settings.seed, numpy_random_seed=settings.seed, torch_random_seed=settings.seed,
            fewshot_random_seed=settings.seed, bootstrap_iters=1000)
    finally:
        evaluator_logger.removeFilter(gen_kwargs_warning)
    if results is None:  # a data-parallel rank other than 0: lm-eval gathered its share on rank 0
        return None
    return {"results": results["results"][task.name], "n_samples": results["n-samples"][task.name]}


def _score(task: EvalTask, raw: dict[str, Any]) -> TaskScore:
    results = raw["results"]
    metric = primary_metric(task, results)
    if metric not in results:
        reported = [key for key in results if "_stderr" not in key and key != "alias"]
        raise ValueError(f"task {task.name!r} reported no {metric!r}: it reported {', '.join(reported)}")
    name, _, flt = metric.partition(",")
    stderr = results.get(f"{name}_stderr,{flt or NO_FILTER}")
    stderr = float(stderr) if isinstance(stderr, (int, float)) and math.isfinite(stderr) else None
    return TaskScore(task.name, metric, float(results[metric]), stderr, int(raw["n_samples"]["effective"]))


def data_parallel_hflm(model, tokenizer, settings: EvalSettings, accelerator=None):
    """lm-eval's `HFLM` around `model`; with an Accelerator of several processes, in lm-eval's data-parallel mode.

    HFLM sets rank 0 of 1 for a model instance (lm-eval 0.4.13 enters its data-parallel mode only when it loads
    the model itself, and only on more than one GPU); these are the attributes its own launch sets, which
    `lm_eval.evaluator.evaluate` (request split, padding, gathering) and HFLM's gather/barrier read."""
    import_lm_eval()
    from lm_eval.models.huggingface import HFLM

    data_parallel = accelerator is not None and accelerator.num_processes > 1
    hflm_logger = logging.getLogger(HFLM.__module__)
    # HFLM's warning on a model instance ("other model arguments may be ignored. Please do not launch via accelerate")
    # is untrue here: we pass no argument it ignores, and the attributes below make a launch data-parallel. Its
    # "assuming single-process call" is untrue only under a launch.
    filtered = _DropMessages("is not of type `str`", *(("assuming single-process call",) if data_parallel else ()))
    hflm_logger.addFilter(filtered)
    try:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=settings.batch_size)
    finally:
        hflm_logger.removeFilter(filtered)
    if data_parallel:
        lm.accelerator = accelerator
        lm._rank, lm._world_size = accelerator.process_index, accelerator.num_processes
    return lm


class _DropMessages(logging.Filter):
    """Drops the records whose message contains one of `parts`."""

    def __init__(self, *parts: str) -> None:
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(part in record.getMessage() for part in self.parts)


def score_model(model, tokenizer, tasks: list[EvalTask], settings: EvalSettings, cache_dir: str | Path | None,
                key: str, accelerator=None) -> dict[str, TaskScore]:
    """{task name: its score} for `model` (loaded, in eval mode, on this process's device); each task from the
    cache when `key` (model_key) scored it before with the same task and settings. With an Accelerator of several
    processes, every process calls this and scores its share (data_parallel_hflm)."""
    return score_lm(lambda: data_parallel_hflm(model, tokenizer, settings, accelerator), tasks, settings, cache_dir,
                    key, accelerator)


def score_lm(make_lm, tasks: list[EvalTask], settings: EvalSettings, cache_dir: str | Path | None, key: str,
             accelerator=None) -> dict[str, TaskScore]:
    """score_model for any lm-eval model: `make_lm()` builds it on the first task the cache does not hold."""
    world_size = accelerator.num_processes if accelerator is not None else 1
    first = accelerator is None or accelerator.is_main_process
    scores, lm = {}, None
    for task in tasks:
        path = _cache_path(Path(cache_dir), key, task, settings) if cache_dir else None
        raw = json.loads(path.read_text()) if first and path is not None and path.is_file() else None
        raw = _from_rank_zero(raw, world_size)  # a hit on rank 0 is a hit everywhere: no rank scores alone
        if raw is not None:
            if first:
                logger.info("%s: %s from the cache (%s)", task.name, json.loads(key)[0], path)
        else:
            if lm is None:
                lm = make_lm()
            raw = _run_task(lm, task, settings)  # None on every rank but 0
            if first and path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                staging = path.with_suffix(".tmp")
                staging.write_text(json.dumps(raw, default=str))
                staging.replace(path)
            raw = _from_rank_zero(raw, world_size)
        scores[task.name] = _score(task, raw)
    return scores


def _from_rank_zero(value, world_size: int):
    """Rank 0's `value` on every process of the launch (itself for one process)."""
    if world_size <= 1:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]

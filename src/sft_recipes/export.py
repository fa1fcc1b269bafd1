"""The final checkpoint: consolidated from FSDP2 shards on rank 0, then reloaded and checked.

`Trainer.save_model` under FSDP2 with SHARDED_STATE_DICT writes only DCP shards (and, for PEFT,
no adapter at all) yet exits 0; we gather a full state dict explicitly and save a plain Hugging
Face checkpoint (for LoRA runs: a PEFT adapter, gathering only the adapter), then prove it by
reloading it and comparing logits with the trained model.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import datasets
import torch
from accelerate.utils import broadcast_object_list
from safetensors import safe_open
from transformers import AutoConfig

from sft_recipes.errors import RecipeError
from sft_recipes.loading import DTYPES, model_class_for
from sft_recipes.reporting.export_check import ExportCheck

logger = logging.getLogger("sft")


class ExportCheckError(RecipeError):
    """The exported model or adapter failed its check (a refusal to hand it over: one `error:` line, exit 2);
    `reason` is short enough to name a folder."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def export_consolidated(trainer, output_dir: str | Path, export_dtype: str = "auto") -> Path:
    """Write model.safetensors shards + config + generation config + tokenizer to `output_dir`.

    Collective: every rank must call it (the full state dict is all-gathered onto rank 0's CPU).
    """
    output_dir = Path(output_dir)
    accelerator = trainer.accelerator
    state_dict = accelerator.get_state_dict(trainer.model)
    if accelerator.is_main_process:
        model = accelerator.unwrap_model(trainer.model)
        if export_dtype != "auto":
            dtype = DTYPES[export_dtype]
            state_dict = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
            model.config.dtype = dtype
        model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        trainer.processing_class.save_pretrained(output_dir)
    accelerator.wait_for_everyone()
    return output_dir


def copy_processor_files(processor_files: dict[str, Path], output_dir: str | Path) -> None:
    """Copy the source checkpoint's processor files (`ModelSource.processor_files`) into the export: training never
    changes them."""
    for name, path in processor_files.items():
        shutil.copyfile(path, Path(output_dir) / name)


def probe_inputs(dataset, image_token_id: int | None = None) -> list[int] | dict[str, torch.Tensor]:
    """What the reload check runs: the first 64 training tokens, or for image blocks the first block's first
    example whole, with its images (the check then runs the vision tower too)."""
    streamed = isinstance(dataset, (torch.utils.data.IterableDataset, datasets.IterableDataset))
    row = next(iter(dataset)) if streamed else dataset[0]
    if "pixel_values" not in row:
        return list(row["input_ids"])[:64]
    from sft_recipes.data.vision import first_example_inputs

    return first_example_inputs(row, image_token_id)


@torch.no_grad()
def verify_export(trainer, output_dir: str | Path, probe_ids: list[int], atol: float | None = None,
                  on_reloaded: Callable[[torch.nn.Module], None] | None = None) -> ExportCheck:
    """Reload `output_dir` on rank 0 and compare its logits with the trained (sharded) model's.

    Collective. Returns the passed check (its max abs logit difference) on every rank; raises on every rank (so no
    rank is left waiting in a collective) when the difference exceeds `atol`.
    """

    def reload() -> torch.nn.Module:
        return model_class_for(AutoConfig.from_pretrained(output_dir)).from_pretrained(output_dir)

    return _compare_with_reloaded(trainer, output_dir, probe_ids, reload, atol, on_reloaded)


def export_adapter(trainer, output_dir: str | Path) -> Path:
    """Write the trained LoRA adapter in PEFT format (adapter_model.safetensors + adapter_config.json) + tokenizer.

    Collective. Only the trainable (adapter) parameters are all-gathered, onto rank 0's CPU: a
    120B base is never gathered. Loadable with `PeftModel.from_pretrained(base, output_dir)`.
    """
    output_dir = Path(output_dir)
    accelerator = trainer.accelerator
    model = trainer.model
    if torch.distributed.is_initialized():
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        state_dict = get_model_state_dict(model, options=options)
    else:
        state_dict = {name: param.detach().cpu() for name, param in model.named_parameters() if param.requires_grad}
    problem: list = [None]
    if accelerator.is_main_process:
        peft_model = accelerator.unwrap_model(model)
        peft_model.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        trainer.processing_class.save_pretrained(output_dir)
        with safe_open(output_dir / "adapter_model.safetensors", framework="pt") as saved:
            saved_count = len(list(saved.keys()))
        if saved_count != len(state_dict):
            # peft selects what to save by module names; a wrapper it does not know makes it save nothing.
            problem = [
                f"The adapter written to {output_dir} holds {saved_count} tensors but the model trains "
                f"{len(state_dict)}: peft did not recognise the trained weights. Do not use it (nor, likely, the "
                "checkpoints of this run)."
            ]
    broadcast_object_list(problem, from_process=0)  # every rank raises, none is left waiting
    if problem[0]:
        raise ExportCheckError(problem[0], reason="adapter-incomplete")
    return output_dir


@torch.no_grad()
def verify_adapter_export(
    trainer, adapter_dir: str | Path, load_base: Callable[[], torch.nn.Module], probe_ids: list[int],
    atol: float | None = None, on_reloaded: Callable[[torch.nn.Module], None] | None = None,
) -> ExportCheck:
    """Load a fresh base (`load_base()`) plus the saved adapter on rank 0, compare logits with the trained model's.

    Collective, like `verify_export`. Equal logits also prove that no frozen weight moved in training.
    """
    from sft_recipes.lora import load_adapter

    return _compare_with_reloaded(trainer, adapter_dir, probe_ids, lambda: load_adapter(load_base(), adapter_dir), atol,
                                  on_reloaded)


def trained_compute_dtype(trainer) -> torch.dtype:
    """The precision the trained model computes its logits in: mixed precision's (bf16/fp16 autocast), else its weights'."""
    args = getattr(trainer, "args", None)
    if getattr(args, "fp8", False):  # sft_recipes.fp8: the decoder's matmuls round through float8
        return torch.float8_e4m3fn
    if getattr(args, "bf16", False):
        return torch.bfloat16
    if getattr(args, "fp16", False):
        return torch.float16
    return next(trainer.model.parameters()).dtype


def logit_tolerance(trained: torch.dtype, reloaded: torch.dtype) -> float:
    """How far the reload's logits may be from the trained model's: fp32 rounding only when both compute in fp32.

    A bf16-trained model exported in float32 (export_dtype: float32) is compared at the precision
    it trained in: its trained logits carry bf16 rounding (~4e-3 on the tiny twins) that the fp32
    reload does not, which is no fault of the export.
    """
    return 1e-4 if trained == reloaded == torch.float32 else 5e-2


def _compare_with_reloaded(
    trainer, output_dir: str | Path, probe_ids: list[int] | dict[str, torch.Tensor],
    reload: Callable[[], torch.nn.Module], atol: float | None,
    on_reloaded: Callable[[torch.nn.Module], None] | None = None,
) -> ExportCheck:
    accelerator = trainer.accelerator
    model = trainer.model
    was_training = model.training
    model.eval()
    probe = probe_ids if isinstance(probe_ids, dict) else {"input_ids": torch.tensor([probe_ids])}
    top_k = experts_per_token(model.config)
    routing = {"output_router_logits": True} if top_k else {}
    trained = model(**{key: value.to(accelerator.device) for key, value in probe.items()}, **routing)
    trained_logits = trained.logits.float().cpu()
    trained_routers = [layer.float().cpu() for layer in trained.router_logits] if top_k else []
    model.train(was_training)

    outcome: list = [None]
    if accelerator.is_main_process:
        reloaded = reload().eval()
        reloaded_dtype = next(reloaded.parameters()).dtype
        tolerance = atol if atol is not None else logit_tolerance(trained_compute_dtype(trainer), reloaded_dtype)
        output = reloaded(**probe, **routing)
        logits = output.logits.float()
        compared = torch.ones(logits.shape[1], dtype=torch.bool)
        left_out = ""
        if top_k:
            compared = positions_routed_alike(trained_routers, [layer.float() for layer in output.router_logits],
                                              top_k, tolerance)
            if not compared.all():
                left_out = (f"{int((~compared).sum())} of {compared.numel()} probe positions left out: a near tie "
                            f"in a router sent them to other experts in the reload (router logits within {tolerance:g})")
                logger.info("[export] check: %s", left_out)
        diff = (logits - trained_logits).abs()[:, compared].max().item()
        if on_reloaded is not None and diff <= tolerance:  # e.g. sample generations: only from a checked export
            on_reloaded(reloaded)
        outcome = [(diff, tolerance, left_out)]
    broadcast_object_list(outcome, from_process=0)
    diff, tolerance, left_out = outcome[0]
    if not diff <= tolerance:
        raise ExportCheckError(
            f"The exported checkpoint in {output_dir} does not reproduce the trained model: max |logit diff| "
            f"{diff:.3g} > {tolerance:g}.", reason=f"logit-diff-{diff:.3g}"
        )
    return ExportCheck("passed", diff, left_out)


def experts_per_token(config) -> int | None:
    """A mixture of experts' top-k (`num_experts_per_tok`) where its model can return router logits; None otherwise."""
    config = getattr(config, "text_config", None) or config
    return getattr(config, "num_experts_per_tok", None) if hasattr(config, "output_router_logits") else None


def positions_routed_alike(trained: list[torch.Tensor], reloaded: list[torch.Tensor], top_k: int,
                           tolerance: float) -> torch.Tensor:
    """Per probe position (router logits are [positions, experts] per layer): whether to compare its logits.

    Two reduced-precision computations of one mixture of experts round differently; where a token's k-th and
    (k+1)-th experts score within that rounding, the two pick different experts, and that position's logits part by
    far more than rounding (measured on the gpt-oss twin in bf16 on 2 processes: 2 of 64 positions at 0.16, the
    others <= 0.005). Such a position is left out only when, at the first layer where the choices differ, the router
    logits themselves agree within `tolerance`: the layer's input matched and only the tie tipped. A router whose
    logits differ by more (a real difference) keeps its position in; so do all positions if none would be left.
    """
    positions = trained[0].shape[0]
    compared = torch.ones(positions, dtype=torch.bool)
    tipped = torch.zeros(positions, dtype=torch.bool)  # a layer before chose other experts
    for ours, theirs in zip(trained, reloaded, strict=True):
        chosen = ours.topk(top_k, dim=-1).indices.sort(dim=-1).values
        chosen_again = theirs.topk(top_k, dim=-1).indices.sort(dim=-1).values
        first_choice_apart = (chosen != chosen_again).any(dim=-1) & ~tipped
        near_tie = (ours - theirs).abs().amax(dim=-1) <= tolerance
        compared &= ~(first_choice_apart & near_tie)
        tipped |= first_choice_apart
    return compared if compared.any() else torch.ones(positions, dtype=torch.bool)


def export_run(trainer, model_args, output_dir: str | Path, load_base: Callable[[], torch.nn.Module],
               on_reloaded: Callable[[torch.nn.Module], None] | None = None) -> tuple[Path, ExportCheck]:
    """The run's final artefact -- a PEFT adapter or a consolidated checkpoint -- and its check: passed, with the
    max |logit difference| of its reload against the trained model, or skipped where the recipe turned
    `verify_export` off.

    Collective. When a check fails, the files this export wrote are moved to
    `output_dir/export-FAILED-<reason>-<time>/` (nothing loadable is left where a result belongs) and
    every rank raises ExportCheckError naming that folder. `on_reloaded` is called on rank 0 with the
    reloaded model once the check passed (the other ranks wait meanwhile).
    """
    output_dir = Path(output_dir)
    before = _file_stamps(output_dir) if trainer.accelerator.is_main_process else {}
    try:
        return output_dir, _export_and_check(trainer, model_args, output_dir, load_base, on_reloaded)
    except ExportCheckError as err:
        moved: list = [None]
        if trainer.accelerator.is_main_process:
            moved = [str(set_export_aside(output_dir, before, err.reason))]
        broadcast_object_list(moved, from_process=0)
        raise ExportCheckError(f"{err} Its files were moved to {moved[0]}/ so that nothing in {output_dir} can be "
                               "taken for a result. The checkpoints in it are untouched; this is a defect of the export, not of the "
                               "recipe: report it with that folder (and keep training from the checkpoints if "
                               "you need to).", err.reason) from None


def _export_and_check(trainer, model_args, output_dir: Path, load_base: Callable[[], torch.nn.Module],
                      on_reloaded: Callable[[torch.nn.Module], None] | None = None) -> ExportCheck:
    if model_args.use_peft:
        export_adapter(trainer, output_dir)
    else:
        export_consolidated(trainer, output_dir, model_args.export_dtype)
    if not model_args.verify_export:
        return ExportCheck("skipped")
    probe_ids = probe_inputs(trainer.training_data, getattr(trainer.model.config, "image_token_id", None))
    if model_args.use_peft:
        return verify_adapter_export(trainer, output_dir, load_base, probe_ids, on_reloaded=on_reloaded)
    return verify_export(trainer, output_dir, probe_ids, on_reloaded=on_reloaded)


def _file_stamps(directory: Path) -> dict[str, int]:
    """Top-level files of `directory` -> modification time (ns); checkpoints are folders and not included."""
    return {p.name: p.stat().st_mtime_ns for p in directory.iterdir() if p.is_file()} if directory.is_dir() else {}


def set_export_aside(output_dir: Path, before: dict[str, int], reason: str) -> Path:
    """Move every top-level file written or rewritten since `before` into a folder named for the failure."""
    aside = output_dir / f"export-FAILED-{reason}-{time.strftime('%Y%m%d-%H%M%S')}"
    aside.mkdir()
    for name, stamp in _file_stamps(output_dir).items():
        if before.get(name) != stamp:
            (output_dir / name).rename(aside / name)
    return aside

"""Know before you launch: the FSDP2 memory and time plan of a recipe (`Plan`), and the text `--dry-run` prints.

Runs on the CPU in seconds without weights: counts and FLOPs come from `model_math` (the model on
the meta device), memory from `memory`, time from `communication.estimate_step_time`, each the
closed-form model documented on its module. `plan_recipe` plans a recipe on a launch (`setup.training_setup`);
`format_plan` and `format_layouts` are the plan and the layout comparison as a person reads them
before launching (`dry_run.plan_dry_run` prints both).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig

from sft_recipes.loading import read_model_config
from sft_recipes.planner.communication import LINK_EFFICIENCY, estimate_step_time
from sft_recipes.planner.layouts import MEANINGFUL_SPEEDUP, LayoutReport, hsdp_config_name
from sft_recipes.planner.memory import MemoryEstimate, estimate_eval_gib, estimate_memory, fit_table
from sft_recipes.planner.model_math import (
    GPU_BY_NAME, GPUS, ParamCounts, attention_flops_per_token, count_parameters, flops_per_token,
)
from sft_recipes.planner.setup import TrainingSetup, dtype_name, training_setup

if TYPE_CHECKING:
    from peft import LoraConfig

    from sft_recipes.config import Recipe
    from sft_recipes.launch import AccelerateConfig


@dataclass(frozen=True)
class Plan:
    model_type: str
    counts: ParamCounts
    setup: TrainingSetup
    memory: MemoryEstimate
    flops_per_token: float
    attention_flops_per_token: float
    compute_seconds: dict[str, float]  # per optimizer step on each GPU type, FLOPs at the MFU; the step with its
    # communication is `communication.estimate_communication`'s (the dry run's layouts table)
    headroom_gib: dict[str, float]
    eval_gib: float | None = None  # peak per GPU while evaluating; None: the run does not evaluate

    @property
    def sequences_per_step(self) -> int:
        s = self.setup
        return s.micro_batch_size * s.gradient_accumulation_steps * s.data_parallel_size

    @property
    def tokens_per_step(self) -> int:
        return self.sequences_per_step * self.setup.seq_len

    @property
    def steps_per_epoch(self) -> int | None:
        if self.setup.dataset_sequences is None:
            return None
        # Every epoch ends on a whole global batch (fault/world_size.py): the partial tail is not trained.
        return self.setup.dataset_sequences // self.sequences_per_step

    @property
    def fits(self) -> dict[str, bool]:
        return {gpu: headroom >= 0 for gpu, headroom in self.headroom_gib.items()}

    def to_dict(self) -> dict:
        memory = asdict(self.memory)
        setup = {k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in asdict(self.setup).items()}
        counts = asdict(self.counts)
        counts["decoder_layers"] = list(self.counts.decoder_layers)
        return {
            "model_type": self.model_type,
            "total_params": self.counts.total,
            "trainable_params": self.counts.trainable,
            "world_size": self.setup.world_size,
            "sequence_parallel_size": self.setup.sequence_parallel_size,
            "data_parallel_size": self.setup.data_parallel_size,
            "sequences_per_step": self.sequences_per_step,
            "tokens_per_step": self.tokens_per_step,
            "steps_per_epoch": self.steps_per_epoch,
            "per_device_memory_gib": {name: memory[name] for name in (*MemoryEstimate.COMPONENTS, "total")},
            "memory_peak_at": self.memory.peak_at,
            "activations_offloaded_gib": self.memory.activations_offloaded,
            "activation_bytes_per_token": {
                "checkpointed": self.memory.activation_bytes_per_token_checkpointed,
                "full": self.memory.activation_bytes_per_token_full,
            },
            "fits": self.fits,
            "headroom_gib": self.headroom_gib,
            "flops_per_token": self.flops_per_token,
            "attention_flops_per_token": self.attention_flops_per_token,
            "mfu": self.setup.mfu,
            "compute_seconds_per_step": self.compute_seconds,
            "eval_peak_gib": self.eval_gib,
            "setup": setup,
            "counts": counts,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def make_plan(model: PretrainedConfig | str | Path, setup: TrainingSetup, lora: LoraConfig | None = None) -> Plan:
    """Count, estimate memory and time for ``model`` (a config, a local path or a cached Hub id)."""
    config = model if isinstance(model, PretrainedConfig) else read_model_config(model, download=False)
    counts = count_parameters(config, lora)
    memory = estimate_memory(config, counts, setup)
    return Plan(
        model_type=config.model_type,
        counts=counts,
        setup=setup,
        memory=memory,
        flops_per_token=flops_per_token(config, counts, setup.seq_len),
        attention_flops_per_token=attention_flops_per_token(config, setup.seq_len),
        compute_seconds={gpu.name: estimate_step_time(config, counts, setup, gpu.name) for gpu in GPUS},
        headroom_gib=fit_table(memory),
        eval_gib=estimate_eval_gib(config, setup, memory),
    )


def plan_recipe(recipe: Recipe, accelerate_config: AccelerateConfig | None, world_size: int,
                dataset_sequences: int | None = None, replicate_size: int = 1) -> Plan:
    lora = None
    if recipe.model.use_peft:
        from sft_recipes.lora import build_lora_config

        lora = build_lora_config(recipe.model)
    config = read_model_config(recipe.model.model_name_or_path, recipe.model.model_revision, download=False)
    return make_plan(config, training_setup(recipe, accelerate_config, world_size, dataset_sequences, replicate_size), lora)


def _billions(n: float) -> str:
    return f"{n / 1e9:,.3f}B"


def format_plan(plan: Plan) -> str:
    """The plan as a table a person reads before launching: every factor behind every figure."""
    s, c, m = plan.setup, plan.counts, plan.memory
    trainable_dtype = "float32" if s.fp32_master_weights else dtype_name(s.weights_dtype)
    tokens_per_device = s.tokens_per_rank * s.gradient_accumulation_steps
    head = f"LM head {c.output_head:,}" if c.output_head else "LM head tied"
    loss = {"fused_lm_head": "TRL's chunked LM head, no full logits", "full_logits": "full logits, fp32 loss"}
    sp = s.sequence_parallel_size
    offloaded = (f"; offloaded to host memory {m.activations_offloaded:,.2f} GiB per device"
                 if s.activation_offloading else "; not offloaded")

    def row(label: str, text: str) -> str:
        return f"  {label:<18}{text}"

    lines = [
        f"Plan for {plan.model_type}",
        row("parameters", f"total {c.total:,} ({_billions(c.total)}), trainable {c.trainable:,} "
            f"({100 * c.trainable / c.total:.2f}%)"),
        row("", f"embedding {c.embedding:,}, {head}, {len(c.decoder_layers)} decoder layers, "
            f"largest FSDP unit {c.largest_unit:,}, root {c.root:,}"),
        *(row("LoRA rank", f"{target}: {', '.join(map(str, ranks))}") for target, ranks in c.lora_ranks.items()),
        row("batch", f"{s.micro_batch_size} seq/{'device' if sp == 1 else 'group'} x {s.seq_len} tokens x "
            f"{s.gradient_accumulation_steps} accumulation x {s.data_parallel_size} "
            f"{'devices' if sp == 1 else 'groups'} = {plan.sequences_per_step:,} sequences = "
            f"{plan.tokens_per_step:,} tokens per optimizer step"),
        row("sequence parallel", "off (SP 1: every device holds whole blocks)" if sp == 1 else
            f"SP {sp}: {s.data_parallel_size} groups of {sp} devices share each block, {s.tokens_per_rank:,} "
            f"tokens per device, all-to-all around every token-mixing op"),
    ]
    if plan.steps_per_epoch is not None:
        lines.append(row("steps per epoch", f"{s.dataset_sequences:,} sequences / {plan.sequences_per_step:,} "
                         f"= {plan.steps_per_epoch:,}"))
    lines += [
        row("precision", f"weights {dtype_name(s.weights_dtype)}, trainable {trainable_dtype}, compute "
            f"{dtype_name(s.compute_dtype)}, reduce {dtype_name(s.reduce_dtype)}; "
            f"AdamW states in {trainable_dtype}" + ("; the decoder layers' Linear layers in float8 (fp8: true, "
                                                    "estimated as bf16)" if s.fp8 else "")),
        row("activations", f"{m.activation_bytes_per_token_checkpointed:,.0f} B/token with checkpointing, "
            f"{m.activation_bytes_per_token_full:,.0f} B/token without; this run "
            f"{'checkpoints' if s.activation_checkpointing else 'does not checkpoint'}, "
            f"{s.attn_implementation} attention{offloaded}"),
        row("torch.compile", "on: each decoder layer compiled before FSDP2 wrapping (memory and time estimated as "
            "eager)" if s.torch_compile else "off"),
        row("loss", f"{s.loss_implementation} ({loss[s.loss_implementation]})"),
        f"  memory per GPU (GiB), at the peak: {m.peak_at}",
        *(f"    {name:<18}{getattr(m, name):>9.2f}" for name in (*MemoryEstimate.COMPONENTS, "total")),
    ]
    if plan.eval_gib is not None:
        fits = ", ".join(gpu.name for gpu in GPUS if gpu.memory_gib >= plan.eval_gib) or "none"
        head = "full logits" if s.loss_implementation == "full_logits" else "TRL's fused head, one logit tile"
        whole = ", whole blocks under SP" if s.sequence_parallel_size > 1 else ""
        lines.append(row("eval", f"{plan.eval_gib:.2f} GiB per GPU ({s.eval_micro_batch_size} seq/device{whole}, no "
                         f"gradients: one layer's activations, {head}); fits {fits}"))
    lines += [
        row("FLOPs per token", f"{plan.flops_per_token:.4g} = {4 if c.lora_ranks else 6} x "
            f"{_billions(c.flop_params)} matmul params{' + 6 x trainable' if c.lora_ranks else ''} "
            f"+ attention {plan.attention_flops_per_token:.4g}"),
        row("compute time", f"{tokens_per_device:,} tokens/device x FLOPs per token "
            f"/ ({s.mfu:.0%} MFU x dense bf16 peak); the step time adds the communication compute does not hide: "
            "s/step in the layouts table below"),
        f"  {'GPU':<8}{'GiB':>9}{'fits':>6}{'headroom':>10}{'peak TFLOP/s':>14}{'compute s':>10}",
    ]
    for gpu in GPUS:
        fits = "yes" if plan.fits[gpu.name] else "NO"
        lines.append(
            f"  {gpu.name:<8}{gpu.memory_gib:>9.1f}{fits:>6}{plan.headroom_gib[gpu.name]:>10.1f}"
            f"{gpu.peak_bf16_flops / 1e12:>14,.0f}{plan.compute_seconds[gpu.name]:>10.2f}"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The layouts' section of the dry run


def _gb(n: float) -> str:
    return f"{n / 1e9:,.2f} GB" if n else "-"


def format_layouts(report: LayoutReport, command: str) -> str:
    """The communication, FSDP-vs-HSDP and what-to-change section of the dry run; ``command`` is the launch
    planned, which each suggestion's command line changes."""
    links = report.links
    lines = [f"  communication per optimizer step per GPU on {report.gpu} (--gpu): NVLink {links.intra_node_gbps:,.0f} Gb/s, "
             f"network {links.inter_node_gbps:,.0f} Gb/s per GPU each way (--intra_node_gbps / --inter_node_gbps), "
             f"{LINK_EFFICIENCY:.0%} of it achieved; compute at the MFU above, communication hidden behind the "
             "neighbouring layer's compute up to that compute (docs/planner.md)",
             f"    {'layout':<14}{'GiB/GPU':>8}{'fits':>5}{'all-gather':>12}{'reduce-scat.':>13}{'all-reduce':>11}"
             f"{'all-to-all':>11}{'compute s':>10}{'NVLink s':>9}{'network s':>10}{'exposed s':>10}{'s/step':>8}  bound"]
    for option in report.side_by_side:
        c = option.communication
        this = " (this)" if option.layout == report.own.layout else ""
        lines.append(
            f"    {option.layout.name + this:<14}{option.memory_gib:>8.1f}{'yes' if option.fits(report.gpu) else 'NO':>5}"
            f"{_gb(c.all_gather_bytes):>12}{_gb(c.reduce_scatter_bytes):>13}{_gb(c.all_reduce_bytes):>11}"
            f"{_gb(c.all_to_all_bytes):>11}{c.compute_seconds:>10.3f}{c.link_seconds['intra-node']:>9.3f}"
            f"{c.link_seconds['inter-node']:>10.3f}{c.exposed_seconds:>10.3f}{c.step_seconds:>8.3f}  {c.bound}")
    if report.own.communication.nodes == 1:
        lines.append("    one node: every collective stays on NVLink, no inter-node term")
    lines += _faster_layout_lines(report)
    memory, headroom = GPU_BY_NAME[report.gpu].memory_gib, report.headroom_gib
    kept = f"each leaving at least {headroom:.1f} GiB of {memory:.1f} free (plan_memory_headroom_gib)"
    roomy = report.own.fits(report.gpu, headroom)
    if not report.suggestions:
        verdict = (f"fits with {headroom:.1f} GiB free, and no layout this project runs is 5% faster at the same "
                   "global batch" if roomy else
                   f"nothing this project can run fits with {headroom:.1f} GiB free (plan_memory_headroom_gib), "
                   "even with shorter blocks")
        lines.append(f"  what to change: nothing ({verdict})")
        return "\n".join(lines)
    why = ("fits, but faster" if roomy else
           f"leaves {memory - report.own.memory_gib:.1f} GiB free, under the headroom; these leave more"
           if report.own.fits(report.gpu) else f"does not fit on {report.gpu}; these do")
    every_node = "; run on every node" if report.own.communication.nodes > 1 else ""
    lines.append(f"  what to change (this run {why}; same global batch; {kept}{every_node}; best first):")
    for option in report.suggestions:
        s = option.setup
        sequences = s.micro_batch_size * s.gradient_accumulation_steps * s.data_parallel_size
        lines.append(f"    {option.memory_gib:6.1f} GiB  {option.step_seconds:7.3f} s/step  {option.layout.name}, "
                     f"{s.micro_batch_size} x {s.seq_len} x {s.gradient_accumulation_steps} accumulation, SP "
                     f"{s.sequence_parallel_size}, checkpointing {'on' if s.activation_checkpointing else 'off'}, "
                     f"offloading {'on' if s.activation_offloading else 'off'} = {sequences} sequences per step")
        lines += [f"      {line}" for line in suggested_launch(command, option.overrides, option.accelerate_config)]
    return "\n".join(lines)


def _faster_layout_lines(report: LayoutReport) -> list[str]:
    """Which side-by-side layout is faster, never calling the slower one so, and when HSDP wins, from the model."""
    if len(report.side_by_side) < 2:
        return []
    fastest, launch, own = report.fastest_that_fits(), report.layout_to_launch(), report.own
    if fastest is None:
        return [f"  faster layout that fits: none of these fits on {report.gpu}"]
    times = ", ".join(f"{o.layout.name} {o.step_seconds:.3f} s" for o in report.side_by_side)
    line = f"  faster layout that fits: {fastest.layout.name} ({times} per step)"
    if fastest.layout == own.layout:
        line += ", the launch's own"
    elif launch.layout == own.layout:
        line += (f", {own.step_seconds / fastest.step_seconds - 1:.1%} faster than the launch's own {own.layout.name}: "
                 "under 5%, within the model's error, so keep the launch's own")
    else:
        line += f": launch with {hsdp_config_name(fastest.layout, report.base_config)}"
    lines = [line]
    flat = next((o for o in report.side_by_side if o.layout.replicate == 1), None)
    hsdp = next((o for o in report.side_by_side if o.layout.replicate > 1), None)
    if flat and hsdp:
        f, h = flat.communication, hsdp.communication
        ratio = flat.step_seconds / hsdp.step_seconds
        verdict = ("HSDP wins here" if ratio > MEANINGFUL_SPEEDUP else "flat FSDP wins here" if
                   ratio * MEANINGFUL_SPEEDUP < 1 else f"the two are within 5% here (HSDP {abs(ratio - 1):.1%} "
                   f"{'faster' if ratio > 1 else 'slower'})")
        lines.append(
            f"  {hsdp.layout.name} against flat FSDP, in this model: network busy {h.link_seconds['inter-node']:.3f} s "
            f"against {f.link_seconds['inter-node']:.3f} s, exposed {h.exposed_seconds:.3f} s against "
            f"{f.exposed_seconds:.3f} s per step, {hsdp.memory_gib:.1f} GiB per GPU against {flat.memory_gib:.1f}: "
            f"{verdict}. HSDP wins when flat FSDP's network traffic no longer hides behind compute (gradient "
            "accumulation, small micro-batches, bf16 reduction, a slow network) and the state fits one replica")
    return lines


EDITED_CONFIG = "my_accelerate_config.yaml"  # the name a suggested launch gives a config the user must write


def suggested_launch(command: str, overrides: tuple[str, ...], accelerate_config: str | None) -> list[str]:
    """The launch of a suggestion, runnable as printed: `command` with its flags, on the config the layout needs
    (a shipped one, or EDITED_CONFIG with the line that says what to write into it)."""
    command = _without_overridden_keys(command, overrides)
    if not accelerate_config:
        return [f"{command} {' '.join(overrides)}".rstrip()]
    shipped = " " not in accelerate_config
    # the config follows `--config_file` (accelerate launch) or is the first argument (scripts/launch_multinode.sh)
    launch = re.sub(r"(--config_file |launch_multinode\.sh )\S+",
                    lambda m: m.group(1) + (accelerate_config if shipped else EDITED_CONFIG), command)
    lines = [f"{launch} {' '.join(overrides)}".rstrip()]
    return lines if shipped else [*lines, f"{EDITED_CONFIG}: {accelerate_config}"]


def _without_overridden_keys(command: str, overrides: tuple[str, ...]) -> str:
    """`command` less the user's own `--key value` (or `--key=value`) for each key the suggestion sets again: the
    printed launch then says each key once, with the value the suggestion plans."""
    keys = {token for token in overrides if token.startswith("--")}
    tokens, kept, index = shlex.split(command), [], 0
    while index < len(tokens):
        token = tokens[index]
        if token.split("=", 1)[0] in keys:
            with_value = "=" not in token and index + 1 < len(tokens) and not tokens[index + 1].startswith("--")
            index += 2 if with_value else 1
            continue
        kept.append(token)
        index += 1
    return shlex.join(kept)

"""The layouts this project can run, compared: FSDP next to HSDP, what to change when a recipe does
not fit (or fits but a faster layout exists), and whether an HSDP shard group can hold the model.

Every candidate keeps the recipe's global batch (sequences x block length per optimizer step) and
is priced by `memory.estimate_memory` (per GPU, the shard group dividing the state) and
`communication.estimate_communication` (compute + exposed communication). What varies, in the
order a user would rather change it: micro-batch and accumulation, sequence-parallel size (flat
FSDP only: the linter refuses SP with HSDP), activation offloading, FSDP vs HSDP (replicas = a
divisor of the nodes, each replica whole nodes), activation checkpointing (it lives in the
accelerate config), and only when nothing fits at the recipe's length, shorter blocks (the same
tokens per step in more sequences).

A suggestion is a command: the `scripts/sft.py` overrides (each a recipe key) and, when the layout
itself changes, the accelerate config to launch with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sft_recipes.planner.communication import CommunicationEstimate, Links, MeshLayout, estimate_communication
from sft_recipes.planner.memory import GIB, estimate_memory
from sft_recipes.planner.model_math import GPU_BY_NAME, ParamCounts
from sft_recipes.planner.setup import TrainingSetup

if TYPE_CHECKING:
    from transformers import PretrainedConfig

# A suggestion must beat the recipe's own layout by this much to be worth a change (the model's error is larger).
MEANINGFUL_SPEEDUP = 1.05
SUGGESTIONS = 3
REPO_ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class LayoutOption:
    """One runnable layout of the recipe, priced."""

    setup: TrainingSetup
    layout: MeshLayout
    memory_gib: float
    communication: CommunicationEstimate
    overrides: tuple[str, ...] = ()
    accelerate_config: str | None = None  # None: the config the recipe is launched with

    @property
    def step_seconds(self) -> float:
        return self.communication.step_seconds

    def fits(self, gpu: str, headroom_gib: float = 0.0) -> bool:
        """Whether it fits ``gpu`` leaving at least ``headroom_gib`` free."""
        return self.memory_gib + headroom_gib <= GPU_BY_NAME[gpu].memory_gib

    def to_dict(self, gpu: str) -> dict:
        s = self.setup
        return {
            "layout": self.layout.name, "replicate": self.layout.replicate, "shard": self.layout.shard,
            "micro_batch_size": s.micro_batch_size, "gradient_accumulation_steps": s.gradient_accumulation_steps,
            "sequence_parallel_size": s.sequence_parallel_size, "activation_checkpointing": s.activation_checkpointing,
            "activation_offloading": s.activation_offloading, "max_length": s.seq_len,
            "sequences_per_step": s.micro_batch_size * s.gradient_accumulation_steps * s.data_parallel_size,
            "memory_gib": self.memory_gib, "fits": self.fits(gpu), "step_seconds": self.step_seconds,
            "bound": self.communication.bound, "overrides": list(self.overrides),
            "accelerate_config": self.accelerate_config,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def price(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, layout: MeshLayout, gpu: str,
          links: Links, reshard_after_forward: bool = True) -> LayoutOption:
    setup = dataclasses.replace(setup, replicate_size=layout.replicate)
    memory = estimate_memory(config, counts, setup)
    return LayoutOption(setup, layout, memory.total, estimate_communication(
        config, counts, setup, layout, gpu, links, reshard_after_forward, memory.activations_offloaded * GIB))


def hsdp_config_name(layout: MeshLayout, base_config: str | None) -> str:
    """The accelerate config that launches ``layout`` instead of ``base_config`` (a launch of the other
    kind, FSDP or HSDP, over the same nodes): a shipped one when it exists, else what to change in the base."""
    base = base_config or "the accelerate config"
    if layout.replicate == 1:
        shipped = f"accelerate_configs/fsdp2_{layout.nodes}node.yaml" if layout.nodes > 1 else "accelerate_configs/fsdp2_8gpu.yaml"
        if (REPO_ROOT / shipped).is_file() and layout.gpus_per_node == 8:
            return shipped
        return f"a copy of {base} without parallelism_config"
    shipped = f"accelerate_configs/hsdp_{layout.nodes}node.yaml"
    if (REPO_ROOT / shipped).is_file() and layout.shard == layout.gpus_per_node == 8:
        return shipped
    return (f"a copy of {base} with parallelism_config: {{parallelism_config_dp_replicate_size: {layout.replicate}, "
            f"parallelism_config_dp_shard_size: {layout.shard}}}")


def _overrides(current: TrainingSetup, option: TrainingSetup, global_batch_in_recipe: str | None) -> tuple[str, ...]:
    """scripts/sft.py flags turning ``current`` into ``option`` (recipe keys only; the layout is the config's).
    ``global_batch_in_recipe``: the key the recipe states its global batch with, if any (the accumulation follows)."""
    flags = []
    if option.seq_len != current.seq_len:
        flags += ["--max_length", str(option.seq_len)]
        if global_batch_in_recipe == "global_batch_size":  # the same tokens per step are more, shorter sequences
            sequences = option.micro_batch_size * option.gradient_accumulation_steps * option.data_parallel_size
            flags += ["--global_batch_size", str(sequences)]
    if option.micro_batch_size != current.micro_batch_size:
        flags += ["--per_device_train_batch_size", str(option.micro_batch_size)]
    if option.sequence_parallel_size != current.sequence_parallel_size:
        flags += ["--sequence_parallel_size", str(option.sequence_parallel_size)]
    if option.gradient_accumulation_steps != current.gradient_accumulation_steps and not global_batch_in_recipe:
        flags += ["--gradient_accumulation_steps", str(option.gradient_accumulation_steps)]
    if option.activation_offloading != current.activation_offloading:
        flags += ["--activation_offloading", str(option.activation_offloading).lower()]
    return tuple(flags)


def _config_change(current: TrainingSetup, option: LayoutOption, current_layout: MeshLayout,
                   base_config: str | None) -> str | None:
    config = None
    if option.layout.replicate != current_layout.replicate:
        config = hsdp_config_name(option.layout, base_config)
    if option.setup.activation_checkpointing != current.activation_checkpointing:
        value = str(option.setup.activation_checkpointing).lower()
        if config and " " in config:  # already "a copy of ... with ..."
            config = f"{config}, and fsdp_activation_checkpointing: {value}"
        else:
            config = f"a copy of {config or base_config or 'the accelerate config'} with fsdp_activation_checkpointing: {value}"
    return config


def compare_layouts(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, nodes: int, gpu: str,
                    links: Links, reshard_after_forward: bool = True) -> list[LayoutOption]:
    """Flat FSDP and HSDP (one replica per node) for the same run, for a launch over several nodes."""
    gpus_per_node = setup.world_size // nodes
    layouts = [MeshLayout(nodes, gpus_per_node, 1)]
    if nodes > 1 and setup.sequence_parallel_size == 1:
        layouts.append(MeshLayout(nodes, gpus_per_node, nodes))
    return [price(config, counts, setup, layout, gpu, links, reshard_after_forward) for layout in layouts]


def candidate_layouts(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, current: MeshLayout,
                      gpu: str, links: Links, seq_lens: list[int], reshard_after_forward: bool = True,
                      sequence_parallel_sizes: Collection[int] | None = None):
    """Every layout of the same global batch (tokens per step) at the given block lengths, priced; sequence
    parallelism only at ``sequence_parallel_sizes`` when given (those the recipe would launch with)."""
    tokens = setup.tokens_per_micro_batch * setup.gradient_accumulation_steps * setup.data_parallel_size
    replicas = [1] + ([r for r in _divisors(current.nodes) if r > 1] if current.nodes > 1 else [])
    for seq_len in seq_lens:
        if tokens % seq_len:
            continue
        sequences = tokens // seq_len
        for replicate in replicas:
            layout = MeshLayout(current.nodes, current.gpus_per_node, replicate)
            for sp in _divisors(current.gpus_per_node) if replicate == 1 else [1]:
                if sequence_parallel_sizes is not None and sp not in sequence_parallel_sizes:
                    continue
                if seq_len % sp or sequences % (setup.world_size // sp):
                    continue
                per_group = sequences // (setup.world_size // sp)
                for micro in _divisors(per_group):
                    for checkpointing in (True, False):
                        for offloading in (False, True):
                            option = dataclasses.replace(
                                setup, seq_len=seq_len, micro_batch_size=micro,
                                gradient_accumulation_steps=per_group // micro, sequence_parallel_size=sp,
                                activation_checkpointing=checkpointing, activation_offloading=offloading)
                            yield price(config, counts, option, layout, gpu, links, reshard_after_forward)


def suggest_layouts(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, current: MeshLayout, gpu: str,
                    links: Links, base_config: str | None = None, global_batch_in_recipe: str | None = None,
                    reshard_after_forward: bool = True, sequence_parallel_sizes: Collection[int] | None = None,
                    headroom_gib: float = 0.0) -> tuple[LayoutOption, list[LayoutOption]]:
    """(the recipe's own layout priced, up to `SUGGESTIONS` faster layouts that fit ``gpu`` with ``headroom_gib``
    left free; none when the recipe fits so and nothing is `MEANINGFUL_SPEEDUP` faster). Block length shrinks
    only when nothing fits."""
    own = price(config, counts, setup, current, gpu, links, reshard_after_forward)
    lengths = [setup.seq_len]
    options = [o for o in candidate_layouts(config, counts, setup, current, gpu, links, lengths, reshard_after_forward,
                                            sequence_parallel_sizes) if o.fits(gpu, headroom_gib)]
    length = setup.seq_len
    while not options and length % 2 == 0 and length > 1024:
        length //= 2
        options = [o for o in candidate_layouts(config, counts, setup, current, gpu, links, [length],
                                                reshard_after_forward, sequence_parallel_sizes)
                   if o.fits(gpu, headroom_gib)]
    if own.fits(gpu, headroom_gib):
        options = [o for o in options if o.step_seconds * MEANINGFUL_SPEEDUP < own.step_seconds]

    def changes(option: LayoutOption) -> int:
        return len(_overrides(setup, option.setup, global_batch_in_recipe)) + \
            (option.layout.replicate != current.replicate) + \
            (option.setup.activation_checkpointing != setup.activation_checkpointing)

    options.sort(key=lambda o: (round(o.step_seconds, 3), changes(o)))
    best: list[LayoutOption] = []
    for option in options:
        key = (option.setup, option.layout)
        if any((b.setup, b.layout) == key for b in best):
            continue
        best.append(dataclasses.replace(option, overrides=_overrides(setup, option.setup, global_batch_in_recipe),
                                        accelerate_config=_config_change(setup, option, current, base_config)))
        if len(best) == SUGGESTIONS:
            break
    return own, best


@dataclass(frozen=True)
class ShardShortfall:
    needed_gib: float
    available_gib: float
    smallest_fitting_shard: int | None  # None: not even flat FSDP over the whole world fits
    shard_sizes_tried: list[int] = field(default_factory=list)

    @property
    def shortfall_gib(self) -> float:
        return self.needed_gib - self.available_gib


def shard_group_shortfall(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, gpu: str) -> ShardShortfall | None:
    """None when the HSDP shard group of ``setup`` holds the run on ``gpu``; else how far off, and the
    smallest shard size (a divisor of the world, larger than today's) whose memory fits."""
    available = GPU_BY_NAME[gpu].memory_gib
    needed = estimate_memory(config, counts, setup).total
    if needed <= available:
        return None
    tried = [s for s in _divisors(setup.world_size) if s > setup.shard_size]
    for shard in tried:
        larger = dataclasses.replace(setup, replicate_size=setup.world_size // shard)
        if estimate_memory(config, counts, larger).total <= available:
            return ShardShortfall(needed, available, shard, tried)
    return ShardShortfall(needed, available, None, tried)


# --------------------------------------------------------------------------------------------
# The dry run's section (printed by `report.format_layouts`)


@dataclass(frozen=True)
class LayoutReport:
    """What `--dry-run` prints after the memory plan, and what `--plan-json` carries of it."""

    gpu: str
    links: Links
    own: LayoutOption
    side_by_side: list[LayoutOption]
    suggestions: list[LayoutOption]
    base_config: str | None = None  # the accelerate config of the launch planned
    headroom_gib: float = 0.0  # GiB per GPU every suggestion leaves free (the recipe's plan_memory_headroom_gib)

    def fastest_that_fits(self) -> LayoutOption | None:
        """The fastest of the side-by-side layouts that fits. None for one layout, or when none fits."""
        fitting = [o for o in self.side_by_side if o.fits(self.gpu)]
        if len(self.side_by_side) < 2 or not fitting:
            return None
        return min(fitting, key=lambda o: o.step_seconds)

    def layout_to_launch(self) -> LayoutOption | None:
        """Of the side-by-side layouts, the one to launch: the launch's own unless another that fits is
        `MEANINGFUL_SPEEDUP` faster (or the own does not fit). None for one layout, or when none fits."""
        fastest = self.fastest_that_fits()
        if fastest is not None and self.own.fits(self.gpu) and \
                fastest.step_seconds * MEANINGFUL_SPEEDUP >= self.own.step_seconds:
            return self.own
        return fastest

    def to_dict(self) -> dict:
        fastest, launch = self.fastest_that_fits(), self.layout_to_launch()
        return {
            "gpu": self.gpu,
            "links_gbps": {"intra_node": self.links.intra_node_gbps, "inter_node": self.links.inter_node_gbps},
            "communication": self.own.communication.to_dict(),
            "layouts": [{**o.to_dict(self.gpu), "communication": o.communication.to_dict()} for o in self.side_by_side],
            "faster_layout_that_fits": fastest.layout.name if fastest else None,
            "layout_to_launch": launch.layout.name if launch else None,
            "memory_headroom_gib": self.headroom_gib,
            "suggestions": [o.to_dict(self.gpu) for o in self.suggestions],
        }


def layout_report(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, nodes: int, gpu: str,
                  links: Links, base_config: str | None = None, global_batch_in_recipe: str | None = None,
                  reshard_after_forward: bool = True, sequence_parallel_sizes: Collection[int] | None = None,
                  headroom_gib: float = 0.0) -> LayoutReport:
    """The launch's own layout priced, FSDP and HSDP side by side (several nodes), and what to change."""
    if setup.world_size % nodes:
        raise ValueError(f"{setup.world_size} processes cannot be spread evenly over {nodes} nodes.")
    current = MeshLayout(nodes, setup.world_size // nodes, setup.replicate_size)
    own, suggestions = suggest_layouts(config, counts, setup, current, gpu, links, base_config, global_batch_in_recipe,
                                       reshard_after_forward, sequence_parallel_sizes, headroom_gib)
    side_by_side = compare_layouts(config, counts, setup, nodes, gpu, links, reshard_after_forward)
    side_by_side = [own if o.layout == current else o for o in side_by_side]
    if current not in [o.layout for o in side_by_side]:
        side_by_side.insert(0, own)
    return LayoutReport(gpu, links, own, side_by_side, suggestions, base_config, headroom_gib)

"""How long a step computes, what it sends, over which link, and how much of that compute hides: the
planner's time and communication model.

Per optimizer step and per GPU, from the exact parameter counts (`model_math.count_parameters`) and
the run's dtypes, for FSDP2 over a 2-D mesh of ``replicate`` x ``shard`` ranks (flat FSDP: replicate 1):

- all-gather   every FSDP unit's parameters in the compute dtype, once per micro-batch in forward and
               once more in backward when ``reshard_after_forward`` (the root unit -- embeddings, LM
               head, final norm -- is gathered once: FSDP2 does not reshard the root after forward).
               LoRA gathers the frozen base weights too: FSDP2 shards whole units.
- reduce-scatter
               the trainable gradients in the reduce dtype, inside the shard group, once per MICRO-BATCH:
               the run sets accelerate's ``sync_each_batch`` (`distributed.reduce_scatter_every_micro_batch`),
               because its ``no_sync`` under FSDP2 would keep every unit's gradient unsharded between
               micro-batches -- the full trainable gradient on every rank (docs/traps.md).
- all-reduce   under HSDP, the reduce-scattered gradient shard (the sum of the step's micro-batches) across the
               replicas, once per optimizer step: the run defers it to the step's last micro-batch
               (`distributed.replicas_reduced_at_the_step_end`, FSDP2's `set_requires_all_reduce`).
- all-to-all   sequence parallelism's exchanges (`memory.exchange_bytes_per_token`, the same buffers the
               memory model counts), forward and backward, plus the recomputed forward under checkpointing.

A ring collective over ``n`` ranks puts ``(n-1)/n`` of the message on each rank's link (all-gather,
reduce-scatter) or ``2(n-1)/n`` (all-reduce). Inside a node that is NVLink. A group spanning nodes
with ``m`` of its ranks on each node crosses the network at each node's ``m`` NICs: NCCL runs one ring
per channel, each leaving a node once, so a node's outgoing ring traffic is spread over the NICs of its
``m`` members and each NIC carries ``1/m`` of what a rank sends (an HSDP replica group, one rank per
node, runs concurrently with the other seven: each its own NIC). The collective takes the slower of
its two links plus a latency: NCCL's tuning constants for the Simple protocol (base 8.4 us, 3.4 us per
NVLink ring step, 14 us per network ring step; tree all-reduce across nodes when cheaper -- the
constants of NVIDIA/nccl src/graph/tuning.cc as torch/_inductor/comm_analysis.py copies them).

Overlap: FSDP2 prefetches the next unit's all-gather during the current unit's compute and runs the
previous unit's reduce-scatter (and all-reduce) during the next one's backward, so per decoder layer
only what exceeds that layer's compute is exposed; the root's gather (nothing computes before it) and
the last reduce-scatter / all-reduce of each micro-batch (the next forward or the optimizer waits) are
exposed whole. Sequence parallelism's
all-to-all sits inside the layer's data dependencies: exposed whole. Activation offloading copies
what it offloads to the host during forward and back during backward, on side streams over PCIe:
exposed only where a pass's copies outlast its compute.

Compute: `estimate_step_time` (model FLOPs at the assumed MFU), taken as the time of a run with
activation checkpointing; without it the step does 6 instead of 8 hardware FLOPs per parameter and
token, 3/4 of the time. A layer's backward is 3/4 of the checkpointed layer's time (recompute +
backward), 2/3 without checkpointing.

What this ignores: NVLink SHARP / in-network reductions, PCIe-only nodes, congestion from other jobs,
the optimizer step's own time, dataloader stalls, stragglers, kernel launch gaps. See docs/planner.md.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from sft_recipes.planner.memory import exchange_bytes_per_token
from sft_recipes.planner.model_math import GPU_BY_NAME, ParamCounts, flops_per_token, layer_types, text_config_of
from sft_recipes.planner.setup import TrainingSetup, dtype_bytes

if TYPE_CHECKING:
    from transformers import PretrainedConfig

GBIT = 1e9 / 8  # bytes per second in one Gb/s

# Per GPU, each direction, in Gb/s. Sources (docs/planner.md lists them with their pages):
# - NVLink 4 (H100 SXM, H200 SXM): 900 GB/s bidirectional per GPU = 450 GB/s = 3,600 Gb/s each way
#   (NVIDIA H100 / H200 datasheets: "NVLink: 900GB/s"). NVLink 5 (B200, B300): 1.8 TB/s bidirectional
#   = 900 GB/s = 7,200 Gb/s each way (NVIDIA DGX B200 / B300 user guides, "fifth-generation NVLink").
# - Network: one NIC per GPU. DGX/HGX H100 and H200: 8 x ConnectX-7 400 Gb/s (DGX H100 user guide,
#   torchtitan's Grand Teton runs: "400 Gb/s per GPU"); DGX B200: 8 x ConnectX-7 400 Gb/s; DGX/HGX B300:
#   8 x ConnectX-8 800 Gb/s (DGX B300 user guide).
LINKS_GBPS: dict[str, tuple[float, float]] = {  # gpu -> (intra-node NVLink, inter-node NIC), Gb/s per GPU each way
    "H100": (3600.0, 400.0),
    "H200": (3600.0, 400.0),
    "B200": (7200.0, 400.0),
    "B300": (7200.0, 800.0),
}
# nccl-tests' bus bandwidth reaches about this fraction of a link's peak for large messages (H100 NVLink:
# ~360 of 450 GB/s in all-gather; 400G InfiniBand: ~45-48 of 50 GB/s): an assumption, stated here once.
LINK_EFFICIENCY = 0.8

# NCCL Simple-protocol latencies (us): base per collective, per ring step on NVLink, per ring step on the network.
NCCL_BASE_LATENCY_US = 8.4
NCCL_NVLINK_STEP_US = 3.4
NCCL_NETWORK_STEP_US = 14.0
NCCL_TREE_NVLINK_STEP_US = 4.0
NCCL_TREE_NETWORK_STEP_US = 14.0

# Activation offloading's copies cross the GPU's PCIe Gen5 x16 link: 64 GB/s each way (PCI-SIG), at LINK_EFFICIENCY.
PCIE_GBPS = 512.0

INTRA, INTER, PCIE = "intra-node", "inter-node", "host (PCIe)"
COMPUTE = "compute"


def estimate_step_time(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, gpu: str) -> float:
    """Seconds per optimizer step on ``gpu``: each device trains micro_batch x seq_len / sequence_parallel_size
    x accumulation tokens at `flops_per_token` (whose attention term is over the whole block: under SP
    a rank attends for its heads over all of it), at ``setup.mfu`` of the GPU's dense bf16 peak.
    Activation offloading's host copies are taken as hidden behind compute (TRL runs them on a side stream)."""
    if gpu not in GPU_BY_NAME:
        raise ValueError(f"Unknown GPU {gpu!r}: use one of {sorted(GPU_BY_NAME)}.")
    tokens_per_device = setup.tokens_per_rank * setup.gradient_accumulation_steps
    flops = tokens_per_device * flops_per_token(config, counts, setup.seq_len)
    return flops / (setup.mfu * GPU_BY_NAME[gpu].peak_bf16_flops)


@dataclass(frozen=True)
class Links:
    """Bandwidth per GPU, each direction, in Gb/s: NVLink inside a node, the NIC between nodes."""

    intra_node_gbps: float
    inter_node_gbps: float

    @classmethod
    def for_gpu(cls, gpu: str, intra_node_gbps: float | None = None, inter_node_gbps: float | None = None) -> Links:
        if gpu not in LINKS_GBPS:
            raise ValueError(f"Unknown GPU {gpu!r}: use one of {sorted(LINKS_GBPS)}.")
        intra, inter = LINKS_GBPS[gpu]
        links = cls(intra_node_gbps or intra, inter_node_gbps or inter)
        if links.intra_node_gbps <= 0 or links.inter_node_gbps <= 0:
            raise ValueError("--intra_node_gbps and --inter_node_gbps must be positive (Gb/s per GPU, each way).")
        return links

    def bytes_per_second(self, link: str) -> float:
        gbps = self.intra_node_gbps if link == INTRA else self.inter_node_gbps
        return gbps * GBIT * LINK_EFFICIENCY


@dataclass(frozen=True)
class MeshLayout:
    """Where the ranks are and how FSDP2 groups them: ``nodes`` x ``gpus_per_node`` GPUs,
    ``replicate`` x ``shard`` (HSDP: parameters sharded over ``shard`` ranks, replicated ``replicate`` times)."""

    nodes: int
    gpus_per_node: int
    replicate: int = 1

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1 or self.replicate < 1 or self.world_size % self.replicate:
            raise ValueError(f"replicate {self.replicate} must divide the world size {self.world_size} "
                             f"({self.nodes} nodes x {self.gpus_per_node} GPUs).")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def shard(self) -> int:
        return self.world_size // self.replicate

    @property
    def name(self) -> str:
        return "FSDP" if self.replicate == 1 else f"HSDP {self.replicate}x{self.shard}"

    def spread(self, group: int, contiguous: bool) -> tuple[int, int]:
        """(nodes a group of ``group`` ranks spans, its ranks per node). Shard and SP groups are contiguous
        ranks (accelerate's mesh puts the replicate dimension outermost); a replica group is strided."""
        if contiguous:
            per_node = min(group, self.gpus_per_node)
            return math.ceil(group / self.gpus_per_node), per_node
        # one rank out of every `shard` consecutive ones
        per_node = max(self.gpus_per_node // self.shard, 1)
        return math.ceil(group / per_node), per_node


@dataclass(frozen=True)
class Collective:
    kind: str  # "all-gather", "reduce-scatter", "all-reduce", "all-to-all"
    message_bytes: float  # the whole gathered / reduced tensor (all-to-all: what one rank trades)
    group: int
    nodes: int  # nodes the group spans
    per_node: int  # its ranks on each node

    @property
    def wire_bytes(self) -> float:
        """Bytes one rank sends (= receives) over the ring."""
        n = self.group
        if n == 1:
            return 0.0
        factor = {"all-reduce": 2 * (n - 1) / n}.get(self.kind, (n - 1) / n)
        return factor * self.message_bytes

    def link_seconds(self, links: Links) -> dict[str, float]:
        """Busy time of each link this collective uses (the ring runs at the slower one)."""
        if self.group == 1:
            return {INTRA: 0.0, INTER: 0.0}
        intra = self.wire_bytes / links.bytes_per_second(INTRA) if self.per_node > 1 else 0.0
        inter = self.wire_bytes / self.per_node / links.bytes_per_second(INTER) if self.nodes > 1 else 0.0
        return {INTRA: intra, INTER: inter}

    def latency_seconds(self) -> float:
        if self.group == 1:
            return 0.0
        steps = 2 * (self.group - 1) if self.kind == "all-reduce" else self.group - 1
        network_steps = (2 if self.kind == "all-reduce" else 1) * (self.nodes - 1)
        ring = NCCL_BASE_LATENCY_US + (steps - network_steps) * NCCL_NVLINK_STEP_US + network_steps * NCCL_NETWORK_STEP_US
        if self.kind == "all-reduce" and self.nodes > 1:
            tree = NCCL_BASE_LATENCY_US + 2 * ((self.per_node - 1) * NCCL_TREE_NVLINK_STEP_US
                                               + math.log2(self.nodes) * NCCL_TREE_NETWORK_STEP_US)
            ring = min(ring, tree)
        return ring * 1e-6

    def seconds(self, links: Links) -> float:
        return max(self.link_seconds(links).values()) + self.latency_seconds()


def _add(total: dict[str, float], part: dict[str, float], times: float = 1.0) -> None:
    for link, seconds in part.items():
        total[link] = total.get(link, 0.0) + times * seconds


@dataclass(frozen=True)
class CommunicationEstimate:
    """One layout's step on one GPU type: bytes per GPU per optimizer step, link busy time, what compute hides."""

    layout: str
    nodes: int
    gpus_per_node: int
    replicate: int
    shard: int
    gpu: str
    intra_node_gbps: float
    inter_node_gbps: float
    all_gather_bytes: float
    reduce_scatter_bytes: float
    all_reduce_bytes: float
    all_to_all_bytes: float
    collectives_per_step: int
    compute_seconds: float
    link_seconds: dict[str, float]  # busy time of NVLink, of the network (and of PCIe when offloading) per step
    exposed_seconds: float  # communication compute does not hide
    step_seconds: float
    bound: str  # "compute", "intra-node", "inter-node" (or "host (PCIe)"): the largest of compute and each link's busy time

    def to_dict(self) -> dict:
        return asdict(self)


def _unit_sizes(counts: ParamCounts) -> tuple[float, float, float]:
    """(parameters of one decoder unit on average, trainable per unit, decoder units)."""
    units = len(counts.decoder_layers) or 1
    layered = counts.total - counts.root
    return layered / units, (counts.trainable - counts.root_trainable) / units, units


def estimate_communication(config: PretrainedConfig, counts: ParamCounts, setup: TrainingSetup, layout: MeshLayout,
                           gpu: str, links: Links | None = None, reshard_after_forward: bool = True,
                           offloaded_bytes: float = 0.0) -> CommunicationEstimate:
    """Bytes, link time and exposed time of one optimizer step of ``setup`` under ``layout`` on ``gpu``.

    ``offloaded_bytes``: activations one micro-batch offloads to the host per GPU (`MemoryEstimate.activations_offloaded`).
    """
    if layout.world_size != setup.world_size:
        raise ValueError(f"the layout has {layout.world_size} GPUs, the setup {setup.world_size}.")
    links = links or Links.for_gpu(gpu)
    compute_b, reduce_b = dtype_bytes(setup.compute_dtype), dtype_bytes(setup.reduce_dtype)
    unit_params, unit_trainable, units = _unit_sizes(counts)
    shard_nodes, shard_per_node = layout.spread(layout.shard, contiguous=True)
    replica_nodes, replica_per_node = layout.spread(layout.replicate, contiguous=False)

    def shard_collective(kind: str, message: float) -> Collective:
        return Collective(kind, message, layout.shard, shard_nodes, shard_per_node)

    gather_unit = shard_collective("all-gather", unit_params * compute_b)
    gather_root = shard_collective("all-gather", counts.root * compute_b)
    scatter_unit = shard_collective("reduce-scatter", unit_trainable * reduce_b)
    scatter_root = shard_collective("reduce-scatter", counts.root_trainable * reduce_b)
    replicas = [Collective("all-reduce", trainable * reduce_b / layout.shard, layout.replicate, replica_nodes,
                           replica_per_node) for trainable in (unit_trainable, counts.root_trainable)]
    reduce_unit = [scatter_unit, replicas[0]] if layout.replicate > 1 else [scatter_unit]
    reduce_root = [scatter_root, replicas[1]] if layout.replicate > 1 else [scatter_root]

    # sequence parallelism: per layer, one rank trades half its send + receive buffers, forward and backward
    sp = setup.sequence_parallel_size
    text_config = text_config_of(config)
    exchanged = sum(exchange_bytes_per_token(text_config, kind, setup) for kind in layer_types(text_config)) / 2
    sp_nodes, sp_per_node = layout.spread(sp, contiguous=True)
    passes = 3 if setup.activation_checkpointing else 2  # forward, backward (+ the recomputed forward)
    all_to_all = Collective("all-to-all", exchanged * setup.tokens_per_rank / max(units, 1), sp, sp_nodes, sp_per_node)

    checkpointing = setup.activation_checkpointing
    compute = estimate_step_time(config, counts, setup, gpu) * (1.0 if checkpointing else 0.75)
    micro_batches = setup.gradient_accumulation_steps
    per_micro = compute / micro_batches
    backward_share = 0.75 if checkpointing else 2 / 3
    forward_layer = per_micro * (1 - backward_share) / units
    backward_layer = per_micro * backward_share / units

    def layer_time(collectives: list[Collective]) -> float:
        busy: dict[str, float] = {}
        for collective in collectives:
            _add(busy, collective.link_seconds(links))
        return max(busy.values(), default=0.0) + sum(c.latency_seconds() for c in collectives)

    regather = [gather_unit] if reshard_after_forward else []
    exposed_forward = gather_root.seconds(links) + gather_unit.seconds(links) + \
        (units - 1) * max(0.0, gather_unit.seconds(links) - forward_layer)
    # every micro-batch reduce-scatters (sft_recipes.distributed.reduce_scatter_every_micro_batch): its last unit's
    # and the root's reductions are exposed each time, as the next micro-batch's forward waits for them; under
    # HSDP only the step's last micro-batch all-reduces across replicas (`replicas_reduced_at_the_step_end`)
    def exposed_backward(unit: list[Collective], root: list[Collective]) -> float:
        return (units - 1) * max(0.0, layer_time(regather + unit) - backward_layer) + layer_time(unit) + layer_time(root)
    exposed_sp = passes * units * all_to_all.seconds(links)
    host_copy = offloaded_bytes / (PCIE_GBPS * GBIT * LINK_EFFICIENCY)  # each way: to the host, then back
    exposed_offload = max(0.0, host_copy - units * forward_layer) + max(0.0, host_copy - units * backward_layer)
    exposed = (micro_batches * (exposed_forward + exposed_sp + exposed_offload)
               + (micro_batches - 1) * exposed_backward([scatter_unit], [scatter_root])
               + exposed_backward(reduce_unit, reduce_root))

    busy: dict[str, float] = {INTRA: 0.0, INTER: 0.0}
    gathers_per_micro = units * (2 if reshard_after_forward else 1)
    _add(busy, gather_unit.link_seconds(links), micro_batches * gathers_per_micro)
    _add(busy, gather_root.link_seconds(links), micro_batches)
    _add(busy, all_to_all.link_seconds(links), micro_batches * passes * units)
    _add(busy, scatter_unit.link_seconds(links), micro_batches * units)
    _add(busy, scatter_root.link_seconds(links), micro_batches)
    if layout.replicate > 1:  # once per optimizer step
        _add(busy, replicas[0].link_seconds(links), units)
        _add(busy, replicas[1].link_seconds(links))
    if offloaded_bytes:
        busy[PCIE] = 2 * micro_batches * host_copy

    all_reduce_bytes = units * replicas[0].wire_bytes + replicas[1].wire_bytes if layout.replicate > 1 else 0.0
    collectives = micro_batches * (gathers_per_micro + 1 + (passes * units if sp > 1 else 0) + units + 1) + \
        ((units + 1) if layout.replicate > 1 else 0)
    candidates = {COMPUTE: compute, **busy}
    return CommunicationEstimate(
        layout=layout.name, nodes=layout.nodes, gpus_per_node=layout.gpus_per_node, replicate=layout.replicate,
        shard=layout.shard, gpu=gpu, intra_node_gbps=links.intra_node_gbps, inter_node_gbps=links.inter_node_gbps,
        all_gather_bytes=micro_batches * (gathers_per_micro * gather_unit.wire_bytes + gather_root.wire_bytes),
        reduce_scatter_bytes=micro_batches * (units * scatter_unit.wire_bytes + scatter_root.wire_bytes),
        all_reduce_bytes=all_reduce_bytes,
        all_to_all_bytes=micro_batches * passes * units * all_to_all.wire_bytes,
        collectives_per_step=collectives,
        compute_seconds=compute,
        link_seconds=busy,
        exposed_seconds=exposed,
        step_seconds=compute + exposed,
        bound=max(candidates, key=candidates.get),
    )

"""Sequence parallelism: two gloo ranks sharing each packed block compute what one rank computes alone.

The reference is the packed model on one process (itself proven equal to every example run alone
in test_packing_equivalence). Negative controls show the comparison catches the two ways SP can
go wrong: a rank mixing only its own chunk (no exchange), and labels shifted after chunking.
"""

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import free_port
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from test_packing_equivalence import ARCHITECTURES, LAYOUTS, packed_batch, tiny_model
from worker_processes import spawn

from sft_recipes.data.collator import IGNORE_INDEX
from sft_recipes.data.sequence_shards import shard_block, shift_labels
from sft_recipes.architectures import prepare_for_packing
from sft_recipes.architectures.sequence_parallel import (
    check_sequence_parallel_size,
    enable_sequence_parallel,
    gather_chunks,
    heads_to_seq,
    kv_heads_per_rank,
    new_sequence_parallel_group,
    sequence_parallel_layout,
    sequence_parallel_sizes_for,
    seq_to_heads,
)
from sft_recipes.tiny import real_config_dict
from sft_recipes.token_loss import global_token_mean, summed_token_loss

TOLERANCE = 1e-5
CLEAR_DIFFERENCE = 1e-2
SP_SIZE = 2
# Models run with the flash-attention stand-in, and the implementation it must agree with.
FLASH_STAND_IN_CASES = [("llama", "sdpa"), ("gpt_oss", "eager")]


# --- chunks and labels, with literal tokens -------------------------------------------------------


def test_shard_block_cuts_tokens_keeps_block_boundaries_and_shifts_labels_across_the_edge():
    # Two examples [10 11 12] [20 21 22 23 24] and a padding token, as BlockDiagonalCollator packs them.
    batch = {
        "input_ids": torch.tensor([[10, 11, 12, 20, 21, 22, 23, 24]]),
        "labels": torch.tensor([[-100, 11, 12, -100, 21, 22, 23, 24]]),
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
        "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32),
        "cu_seq_lens_q": torch.tensor([0, 3, 8], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 3, 8], dtype=torch.int32),
        "max_length_q": 5,
        "max_length_k": 5,
    }
    assert shift_labels(batch["labels"]).tolist() == [[11, 12, -100, 21, 22, 23, 24, -100]]
    first, second = shard_block(batch, 0, 2), shard_block(batch, 1, 2)
    assert first["input_ids"].tolist() == [[10, 11, 12, 20]] and second["input_ids"].tolist() == [[21, 22, 23, 24]]
    assert first["position_ids"].tolist() == [[0, 1, 2, 0]] and second["position_ids"].tolist() == [[1, 2, 3, 4]]
    # Token 20 ends the first chunk; its target 21 opens the second.
    assert first["shift_labels"].tolist() == [[11, 12, -100, 21]]
    assert second["shift_labels"].tolist() == [[22, 23, 24, -100]]
    for shard in (first, second):
        assert shard["seq_idx"] is batch["seq_idx"] and shard["cu_seq_lens_q"] is batch["cu_seq_lens_q"]
        assert shard["max_length_k"] == 5 and "labels" not in shard


def test_shard_block_refuses_a_block_that_does_not_split_evenly():
    batch = {"input_ids": torch.zeros(1, 10, dtype=torch.long), "labels": torch.zeros(1, 10, dtype=torch.long),
             "position_ids": torch.zeros(1, 10, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"10 tokens does not split into sequence_parallel_size=4.*multiple of 4"):
        shard_block(batch, 0, 4)


def test_layout_groups_consecutive_ranks_and_refuses_non_divisors():
    layout = sequence_parallel_layout(5, 8, 4)
    assert (layout.sp_rank, layout.dp_rank, layout.dp_size) == (1, 1, 2)
    with pytest.raises(ValueError, match=r"sequence_parallel_size=3 must be a positive divisor of the world size 8; "
                                         r"choose one of \[1, 2, 4, 8\]"):
        sequence_parallel_layout(0, 8, 3)


# --- head counts of the real models -------------------------------------------------------------


def real_text_config(model_type: str):
    from transformers import AutoConfig

    config = real_config_dict(model_type)
    return AutoConfig.for_model(config.pop("model_type"), **config).get_text_config()


def test_kv_heads_split_evenly_or_replicate_exactly():
    # Llama-3.1-8B, 32 q / 8 kv: SP 4 gives each rank 8 q heads and their 2 kv heads.
    assert kv_heads_per_rank(32, 8, 4) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    # gpt-oss-120b, 64 q / 8 kv at SP 16: 4 q heads per rank, two ranks share each kv head.
    assert kv_heads_per_rank(64, 8, 16) == [[rank // 2] for rank in range(16)]
    # Qwen3.5-27B full attention, 24 q / 4 kv at SP 8: 3 q heads per rank, inside one kv group of 6.
    assert kv_heads_per_rank(24, 4, 8) == [[0], [0], [1], [1], [2], [2], [3], [3]]
    # At SP 6 a rank's 4 q heads would straddle two kv groups of 6.
    with pytest.raises(ValueError, match=r"24 query / 4 kv heads.*Sizes that work: \[1, 2, 4, 8, 12, 24\]"):
        kv_heads_per_rank(24, 4, 6)


@pytest.mark.parametrize(
    ("model_type", "working"),
    [("llama", [1, 2, 4, 8, 16, 32]), ("gpt_oss", [1, 2, 4, 8, 16, 32, 64]), ("qwen3_5", [1, 2, 4, 8])],
)
def test_sequence_parallel_sizes_of_the_recipe_models(model_type, working):
    config = real_text_config(model_type)
    assert sequence_parallel_sizes_for(config) == working
    check_sequence_parallel_size(config, working[-1])


def test_qwen3_5_error_names_both_layer_kinds_and_the_sizes_that_work():
    # 12 splits the 24 q / 4 kv attention heads but not the 16 linear k heads.
    with pytest.raises(ValueError) as error:
        check_sequence_parallel_size(real_text_config("qwen3_5"), 12)
    message = str(error.value)
    assert "attention 24 query / 4 kv heads; linear attention 16 k / 48 v heads" in message
    assert message.endswith("Sizes that work: [1, 2, 4, 8].")


# --- two ranks against one ------------------------------------------------------------------------


def per_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.transpose(1, 2).float(), targets, ignore_index=IGNORE_INDEX, reduction="none")


def max_over_ranks(value: float) -> float:
    tensor = torch.tensor(value)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.item()


def compare_one_case(reference: torch.nn.Module, layout_name: str, sp_rank: int, group) -> dict:
    prepare_for_packing(reference)
    sp_model = copy.deepcopy(reference)
    enable_sequence_parallel(sp_model, group)
    batch = packed_batch(**LAYOUTS[layout_name][0])
    targets = shift_labels(batch["labels"])

    # One process, the whole block.
    model_inputs = {key: value for key, value in batch.items() if key != "labels"}
    reference_logits = reference(**model_inputs, use_cache=False).logits
    reference_losses = per_token_loss(reference_logits, targets)
    loss_sum, count = summed_token_loss(reference_logits, targets)
    reference_loss = loss_sum / count
    reference_loss.backward()

    # Two processes, a chunk each.
    shard = shard_block(batch, sp_rank, SP_SIZE)
    chunk_targets = shard.pop("shift_labels")
    logits = sp_model(**shard, use_cache=False).logits
    losses = per_token_loss(logits, chunk_targets)
    gathered = [torch.empty_like(losses) for _ in range(SP_SIZE)]
    dist.all_gather(gathered, losses.detach(), group=group)
    share, step_loss = global_token_mean(*summed_token_loss(logits, chunk_targets), group=group)
    share.backward()
    gradient_diff = 0.0
    for sp_param, param in zip(sp_model.parameters(), reference.parameters(), strict=True):
        if param.grad is None:
            continue
        gradient = sp_param.grad.clone()
        dist.all_reduce(gradient, group=group)
        gradient_diff = max(gradient_diff, (gradient - param.grad).abs().max().item())

    # Negative control 1: no exchange -- each rank's layers see only its chunk (boundaries of the chunk).
    chunk = slice(sp_rank * targets.shape[1] // SP_SIZE, (sp_rank + 1) * targets.shape[1] // SP_SIZE)
    with torch.no_grad():
        alone = reference(input_ids=shard["input_ids"], position_ids=shard["position_ids"],
                          seq_idx=batch["seq_idx"][:, chunk].contiguous(), use_cache=False).logits
    no_exchange = (per_token_loss(alone, chunk_targets) - reference_losses[:, chunk]).abs().max().item()
    # Negative control 2: labels shifted inside the chunk, so the chunk's last token loses its target.
    local_shift = shift_labels(batch["labels"][:, chunk])
    edge_labels = (per_token_loss(logits.detach(), local_shift) - reference_losses[:, chunk]).abs().max().item()
    return {
        "per_token_loss": (torch.cat(gathered, dim=1) - reference_losses).abs().max().item(),
        "step_loss": (step_loss - reference_loss).abs().item(),
        "gradients": gradient_diff,
        "supervised_tokens": int(count),
        "no_exchange": max_over_ranks(no_exchange),
        "chunk_edge_labels": max_over_ranks(edge_labels),
    }


# What the flash-attention stand-in was handed with cu_seq_lens: q shape [B, heads, L, D], cu_seq_lens_q, sinks.
VARLEN_CALLS: list[tuple[list[int], list[int], int | None]] = []


def torch_varlen_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                           cu_seq_lens_q=None, sliding_window=None, s_aux=None, **kwargs):
    """flash-attention's varlen contract in torch: examples from ``cu_seq_lens_q`` over the flattened
    rows (else where ``position_ids`` restart), a sliding window, gpt-oss's sinks (``s_aux``)."""
    batch_size, heads, length, _ = query.shape
    if cu_seq_lens_q is None:
        starts = (kwargs["position_ids"] == 0).flatten().long()
    else:
        VARLEN_CALLS.append((list(query.shape), cu_seq_lens_q.tolist(), None if s_aux is None else len(s_aux)))
        starts = torch.zeros(batch_size * length, dtype=torch.long)
        starts[cu_seq_lens_q[1:-1].long()] = 1
    example = starts.cumsum(0).reshape(batch_size, length)
    distance = torch.arange(length)[:, None] - torch.arange(length)[None]
    allowed = (distance >= 0) & (distance < (sliding_window or length))
    mask = (example[:, :, None] == example[:, None, :]) & allowed
    key, value = (x.repeat_interleave(heads // x.shape[1], dim=1) for x in (key, value))
    scores = (query @ key.transpose(-1, -2) * scaling).masked_fill(~mask[:, None], float("-inf"))
    if s_aux is not None:
        scores = torch.cat([scores, s_aux.reshape(1, -1, 1, 1).expand(batch_size, -1, length, 1)], dim=-1)
    probabilities = scores.softmax(dim=-1)[..., :length]
    return (probabilities @ value).transpose(1, 2), None


def compare_flash_varlen(model_type: str, attn_implementation: str, sp_rank: int, group) -> dict:
    """flash_attention_2 cannot run on CPU: a torch stand-in with its varlen contract takes its place."""
    ALL_ATTENTION_FUNCTIONS.register("flash_attention_2", torch_varlen_attention)
    layout = "split examples, two rows"
    model_inputs = {k: v for k, v in packed_batch(**LAYOUTS[layout][0]).items() if k != "labels"}
    model = tiny_model(model_type, attn_implementation)
    prepare_for_packing(model)
    with torch.no_grad():
        logits = model(**model_inputs, use_cache=False).logits
        model.config._attn_implementation = "flash_attention_2"
        stand_in_difference = (model(**model_inputs, use_cache=False).logits - logits).abs().max().item()
    VARLEN_CALLS.clear()
    result = compare_one_case(model, layout, sp_rank, group)
    return {**result, "stand_in_difference": stand_in_difference,
            "varlen_calls": sorted(set(map(repr, VARLEN_CALLS)))}


def sequence_parallel_worker(rank: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SP_SIZE)
    try:
        layout, group = new_sequence_parallel_group(SP_SIZE)
        results = {
            f"{model_type}-{implementation}-{layout_name}": compare_one_case(
                tiny_model(model_type, implementation), layout_name, layout.sp_rank, group
            )
            for model_type, implementation in ARCHITECTURES
            for layout_name in LAYOUTS
        }
        for model_type, implementation in FLASH_STAND_IN_CASES:
            results[f"{model_type}-flash_attention_2-split examples, two rows"] = compare_flash_varlen(
                model_type, implementation, layout.sp_rank, group
            )
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory) -> dict:
    out_path = tmp_path_factory.mktemp("sp") / "results.json"
    spawn(sequence_parallel_worker, args=(free_port(), str(out_path)), nprocs=SP_SIZE)
    return json.loads(out_path.read_text())


CASES = [f"{m}-{i}-{layout}" for m, i in ARCHITECTURES for layout in LAYOUTS]
CASES += [f"{model_type}-flash_attention_2-split examples, two rows" for model_type, _ in FLASH_STAND_IN_CASES]


@pytest.mark.fsdp
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_rank_on_the_same_packed_blocks(two_rank_results, case):
    result = two_rank_results[case]
    assert result["supervised_tokens"] > 0
    assert result["per_token_loss"] < TOLERANCE
    assert result["step_loss"] < TOLERANCE
    assert result["gradients"] < TOLERANCE


@pytest.mark.fsdp
@pytest.mark.parametrize(("model_type", "attn_implementation"), [*ARCHITECTURES, *((model_type, "flash_attention_2") for model_type, _ in FLASH_STAND_IN_CASES)])
def test_negative_controls_differ(two_rank_results, model_type, attn_implementation):
    # The split layout's chunk edge (token 8 of 16) falls inside an 11-token example; in the other
    # layout the edge precedes only an unsupervised token, so skipping the exchange changes no loss there.
    result = two_rank_results[f"{model_type}-{attn_implementation}-split examples, two rows"]
    assert result["no_exchange"] > CLEAR_DIFFERENCE
    assert result["chunk_edge_labels"] > CLEAR_DIFFERENCE


@pytest.mark.fsdp
@pytest.mark.parametrize(
    ("model_type", "head_dim", "sinks"), [("llama", 8, None), ("gpt_oss", 16, 8)]
)
def test_flash_varlen_gets_the_rank_s_heads_over_the_whole_block_with_its_boundaries(
    two_rank_results, model_type, head_dim, sinks
):
    result = two_rank_results[f"{model_type}-flash_attention_2-split examples, two rows"]
    assert result["stand_in_difference"] < TOLERANCE
    # Two rows of 16 tokens, examples [11 | 5] [1 | 9 | pad 6]; both tiny models have 8 query heads.
    block_boundaries = [0, 11, 16, 17, 26, 32]
    one_rank = repr(([2, 8, 16, head_dim], block_boundaries, sinks))
    sequence_parallel = repr(([2, 4, 16, head_dim], block_boundaries, sinks and sinks // 2))
    assert result["varlen_calls"] == sorted([one_rank, sequence_parallel])


# --- the exchange in every group, not only the one holding ranks 0..N-1 ------------------------------

GROUPS_OF_TWO = 4  # processes: two SP groups of two


def two_groups_worker(rank: int, port: int, out_path: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=GROUPS_OF_TWO)
    try:
        layout, group = new_sequence_parallel_group(2)
        # [B=1, 4 heads, 2 tokens, D=1]: value = 1000 * group + 100 * head + global token position.
        tokens = torch.arange(2) + 2 * layout.sp_rank
        x = (1000 * layout.dp_rank + 100 * torch.arange(4)[:, None] + tokens[None, :]).float()
        x = x[None, :, :, None].requires_grad_()
        heads = seq_to_heads(x, group, seq_dim=2, head_dim=1, heads_per_rank=[[0, 1], [2, 3]])
        back = heads_to_seq(heads, group, seq_dim=2, head_dim=1)
        (back * (layout.sp_rank + 1)).sum().backward()
        chunk = torch.tensor([[float(rank)]], requires_grad=True)
        gathered = torch.cat(gather_chunks(chunk, group))
        (gathered * (layout.sp_rank + 1)).sum().backward()
        result = {"heads": heads[0, :, :, 0].tolist(), "round_trip": torch.equal(back, x),
                  "grad": x.grad.unique().tolist(), "gathered": gathered[:, 0].tolist(), "chunk_grad": chunk.grad.item()}
        Path(out_path, f"{rank}.json").write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


@pytest.mark.fsdp
def test_the_exchange_is_right_in_every_group_of_two_groups(tmp_path):
    """4 gloo ranks as SP groups {0, 1} and {2, 3}: torch.distributed.nn's all_to_all failed in the second."""
    spawn(two_groups_worker, args=(free_port(), str(tmp_path)), nprocs=GROUPS_OF_TWO)
    results = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(GROUPS_OF_TWO)]
    for rank, result in enumerate(results):
        group, sp_rank = divmod(rank, 2)
        own_heads = [2 * sp_rank, 2 * sp_rank + 1]
        assert result["heads"] == [[1000 * group + 100 * head + token for token in range(4)] for head in own_heads]
        assert result["round_trip"] is True
        assert result["grad"] == [sp_rank + 1]  # the gradient went back to the chunk it came from
        assert result["gathered"] == [2 * group, 2 * group + 1]
        assert result["chunk_grad"] == 3  # 1 + 2: both ranks' weights

"""The dry-run planner: exact counts, the memory model against measured peaks, FLOPs, the reference recipes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from trl.trainer.utils import add_fused_lm_head

from sft_recipes.loading import model_class_for
from sft_recipes.architectures.towers import freeze_vision_tower
from sft_recipes.launch import read_accelerate_config
from sft_recipes.loading import read_model_config
from sft_recipes.config import load_recipe
from sft_recipes.errors import RecipeError
from sft_recipes.planner.communication import estimate_step_time
from sft_recipes.planner.memory import (
    FRAGMENTATION_FRACTION, GIB, MemoryEstimate, activation_bytes_per_token, estimate_memory,
)
from sft_recipes.planner.model_math import GPUS, attention_flops_per_token, count_parameters, flops_per_token
from sft_recipes.planner.report import format_plan, make_plan, plan_recipe
from sft_recipes.planner.setup import TrainingSetup
from sft_recipes.tiny import REALWORLD_DIR, tiny_config

from conftest import REPO_ROOT

CONFIGS = REALWORLD_DIR / "model_configs"
LLAMA_8B = CONFIGS / "meta-llama__Llama-3.1-8B.json"
QWEN_27B = CONFIGS / "Qwen__Qwen3.5-27B.derived.json"
GPT_OSS_120B = CONFIGS / "openai__gpt-oss-120b.derived.json"

# The seed's LoRA (shared/seeds/003): r=32 on every linear layer, rank 8 on the expert tensors.
GPT_OSS_SEED_LORA = dict(
    r=32,
    lora_alpha=32,
    target_modules="all-linear",
    rank_pattern={"mlp.experts.gate_up_proj": 8, "mlp.experts.down_proj": 8},
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
    lora_dropout=0.0,
    bias="none",
    task_type="CAUSAL_LM",
)
TINY_EXPERT_LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules="all-linear",
    rank_pattern={"mlp.experts.gate_up_proj": 2, "mlp.experts.down_proj": 2},
    target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
)


def instantiated(config, lora: dict | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    model = model_class_for(config)._from_config(config, dtype=torch.float32)
    return model if lora is None else get_peft_model(model, LoraConfig(**lora))


# --------------------------------------------------------------------------------------------
# Parameter counts


@pytest.mark.parametrize("model_type", ["llama", "qwen3_5", "gpt_oss"])
def test_meta_counts_equal_the_instantiated_tiny_model(model_type):
    config = tiny_config(model_type)
    model = instantiated(config)
    decoder = model.get_decoder()

    counts = count_parameters(config)

    assert counts.total == sum(p.numel() for p in model.parameters())
    vision = freeze_vision_tower(model)  # text-only SFT: a VLM's vision tower is frozen, not planned as trained
    assert (vision > 0) == (model_type == "qwen3_5")
    assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) == counts.total - vision
    assert counts.embedding == model.get_input_embeddings().weight.numel()
    assert counts.decoder_layers == tuple(sum(p.numel() for p in layer.parameters()) for layer in decoder.layers)


@pytest.mark.parametrize("model_type", ["llama", "gpt_oss"])
def test_meta_lora_counts_equal_the_instantiated_tiny_peft_model(model_type):
    lora = TINY_EXPERT_LORA if model_type == "gpt_oss" else dict(r=4, lora_alpha=8, target_modules="all-linear")
    config = tiny_config(model_type)
    model = instantiated(config, lora)

    counts = count_parameters(config, LoraConfig(**lora))

    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_applied_lora_ranks_are_read_back_and_the_false_peft_warning_is_not_passed_on():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        counts = count_parameters(tiny_config("gpt_oss"), LoraConfig(**TINY_EXPERT_LORA))

    assert counts.lora_ranks == {
        "model.layers.*.mlp.experts.down_proj": [2],
        "model.layers.*.mlp.experts.gate_up_proj": [2],
        "model.layers.*.self_attn.k_proj": [4],
        "model.layers.*.self_attn.o_proj": [4],
        "model.layers.*.self_attn.q_proj": [4],
        "model.layers.*.self_attn.v_proj": [4],
    }
    assert not [w for w in caught if "did not match" in str(w.message)]
    # tiny gpt_oss: 4 experts, hidden 64, intermediate 128: gate_up 4*64*256 + down 4*128*64
    assert counts.lora_targeted_per_layer == 4 * 64 * 256 + 4 * 128 * 64


def test_real_counts_match_the_published_sizes():
    llama = count_parameters(read_model_config(LLAMA_8B, download=False))
    gpt_oss = count_parameters(read_model_config(GPT_OSS_120B, download=False))

    assert llama.total == 8_030_261_248  # shared/realworld/README.md, an independent dense count
    assert llama.total == pytest.approx(8.03e9, rel=0.01)
    assert gpt_oss.total == pytest.approx(116.8e9, rel=0.01)
    assert gpt_oss.flop_params == pytest.approx(5.1e9, rel=0.01)  # published: 5.1B active per token


def test_the_vlm_checkpoint_is_built_with_its_vision_tower():
    config = read_model_config(QWEN_27B, download=False)

    assert model_class_for(config).__name__ == "Qwen3_5ForConditionalGeneration"
    assert count_parameters(config).total == pytest.approx(27.35e9, rel=0.01)  # 26.90B text + vision tower


# --------------------------------------------------------------------------------------------
# Loading the config without weights


def test_a_directory_holding_only_config_json_is_enough(tmp_path):
    shutil.copy(LLAMA_8B, tmp_path / "config.json")

    plan = make_plan(str(tmp_path), TrainingSetup(world_size=16, micro_batch_size=4, seq_len=1024))

    assert plan.model_type == "llama"
    assert plan.counts.total == 8_030_261_248


def test_a_bare_json_file_and_a_tiny_stand_in_load():
    assert read_model_config(str(GPT_OSS_120B), download=False).num_local_experts == 128
    assert read_model_config("tiny:qwen3_5", download=False).get_text_config().hidden_size == 64


def _written(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("make_path", "message"),
    [
        (lambda tmp: tmp / "missing" / "config.json", "does not exist"),
        (lambda tmp: tmp, "has no config.json"),
        (lambda tmp: REPO_ROOT / "data" / "samples" / "alpaca.jsonl",
         r"alpaca.jsonl is not a model config transformers \S+ reads \(It looks like the config file at .* is not a "
         r"valid JSON file.\): point model_name_or_path at a model's config.json or its directory.$"),
        (lambda tmp: _written(tmp / "config.json", '{"model_type": "nosuch"}'),
         r"config.json is not a model config transformers \S+ reads \(The checkpoint you are trying to load has model "
         r"type `nosuch` but Transformers does not recognize this architecture. [^\n]*\): point"),
        (lambda tmp: "sft-recipes-tests/not-a-cached-model", "hf download"),
    ],
)
def test_unloadable_configs_name_the_fix(tmp_path, make_path, message):
    with pytest.raises(ValueError, match=message):
        read_model_config(make_path(tmp_path), download=False)


# --------------------------------------------------------------------------------------------
# FLOPs


def test_flops_per_token_is_6n_plus_causal_attention_for_a_dense_model():
    config = tiny_config("llama")  # hidden 64, 8 heads x 8, 2 kv heads, intermediate 128, 2 layers
    h, q, kv, inter, layers, vocab, seq = 64, 8 * 8, 2 * 8, 128, 2, 512, 100
    per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h
    matmul_params = layers * per_layer + vocab * h
    attention = layers * 12 * q * (seq + 1) / 2

    assert flops_per_token(config, count_parameters(config), seq) == 6 * matmul_params + attention


def test_sliding_window_layers_attend_at_most_the_window():
    config = tiny_config("gpt_oss")  # layers: sliding (window 16), full; 8 heads x 16
    seq, window, q = 64, 16, 8 * 16
    sliding_keys = sum(min(position + 1, window) for position in range(seq)) / seq
    full_keys = sum(position + 1 for position in range(seq)) / seq

    assert attention_flops_per_token(config, seq) == pytest.approx(12 * q * (sliding_keys + full_keys))


def test_lora_counts_4n_for_the_frozen_base_and_6_per_trainable_parameter():
    config = tiny_config("gpt_oss")
    full = count_parameters(config)
    lora = count_parameters(config, LoraConfig(**TINY_EXPERT_LORA))

    difference = flops_per_token(config, lora, 64) - flops_per_token(config, full, 64)

    assert difference == -2 * full.flop_params + 6 * lora.trainable


def test_the_qwen_seed_step_time_implies_a_plausible_mfu():
    # Seed 001: 8 x B300, one 32768-token block per GPU, "about 8 seconds per step".
    config = read_model_config(QWEN_27B, download=False)
    setup = TrainingSetup(world_size=8, micro_batch_size=1, seq_len=32768, mfu=0.4)

    at_40_percent = estimate_step_time(config, count_parameters(config), setup, "B300")
    implied_mfu = 0.4 * at_40_percent / 8.0

    assert 0.25 < implied_mfu < 0.45


# --------------------------------------------------------------------------------------------
# The reference recipes (shared/seeds)


@pytest.fixture(scope="module")
def qwen_counts():
    config = read_model_config(QWEN_27B, download=False)
    return config, count_parameters(config)


def qwen_seed_setup(seq_len: int, loss: str = "full_logits", master: bool = False) -> TrainingSetup:
    # Seed 001: plain torch FSDP2, bf16 weights (no fp32 master), fp32 reduce, non-reentrant
    # checkpointing, flash-attention-2, the model's own loss over full logits.
    return TrainingSetup(
        world_size=8,
        micro_batch_size=1,
        seq_len=seq_len,
        attn_implementation="flash_attention_2",
        reduce_dtype=torch.float32,
        fp32_master_weights=master,
        loss_implementation=loss,
    )


def fits(config, counts, setup: TrainingSetup) -> dict[str, bool]:
    total = estimate_memory(config, counts, setup).total
    return {gpu.name: total <= gpu.memory_gib for gpu in GPUS}


def test_qwen_32k_blocks_fit_b300_but_not_h100_where_8k_blocks_fit(qwen_counts):
    config, counts = qwen_counts

    assert fits(config, counts, qwen_seed_setup(32768))["B300"]
    assert not fits(config, counts, qwen_seed_setup(32768))["H100"]
    assert fits(config, counts, qwen_seed_setup(8192))["H100"]


def test_qwen_8k_blocks_do_not_fit_h100_with_fp32_master_weights(qwen_counts):
    # accelerate's upcast: 16 bytes per parameter = 51 GiB of state per GPU before activations
    config, counts = qwen_counts

    assert not fits(config, counts, qwen_seed_setup(8192, master=True))["H100"]


# --------------------------------------------------------------------------------------------
# Long blocks: sequence parallelism and activation offloading, on the shipped qwen27b recipe


def qwen_recipe_plan(max_length: int, sp: int, offloading: bool = False):
    """The qwen27b recipe on 8 GPUs with accelerate_configs/fsdp2_8gpu.yaml, as `--dry-run` plans it."""
    recipe = load_recipe(REPO_ROOT / "recipes" / "qwen27b.yaml", {
        "model_name_or_path": str(QWEN_27B), "max_length": max_length, "sequence_parallel_size": sp,
        "activation_offloading": offloading}, planning=True)
    return plan_recipe(recipe, read_accelerate_config(REPO_ROOT / "accelerate_configs" / "fsdp2_8gpu.yaml"), 8)


def test_qwen_recipe_32k_blocks_fit_8_h100_from_sequence_parallel_size_4():
    fits_h100 = {sp: qwen_recipe_plan(32768, sp).fits["H100"] for sp in (1, 2, 4)}

    assert fits_h100 == {1: False, 2: False, 4: True}


def test_qwen_recipe_32k_blocks_fit_8_h100_with_sequence_parallel_size_2_and_offloading():
    with_offloading = qwen_recipe_plan(32768, 2, offloading=True)

    assert with_offloading.fits["H100"]
    # what left the GPU: 63 of the 64 checkpointed layer inputs of the rank's 16,384 tokens, bf16 x 5120
    assert with_offloading.memory.activations_offloaded * GIB == 16384 * 63 * 2 * 5120


def test_qwen_recipe_131k_blocks_fit_8_b300_without_sequence_parallelism_and_8_h100_need_sp_8_and_offloading():
    assert qwen_recipe_plan(131072, 1).fits["B300"]
    assert not qwen_recipe_plan(131072, 8).fits["H100"]
    assert qwen_recipe_plan(131072, 8, offloading=True).fits["H100"]


def test_qwen_recipe_262k_blocks_need_sequence_parallel_size_2_on_b300():
    assert not qwen_recipe_plan(262144, 1).fits["B300"]
    assert qwen_recipe_plan(262144, 2).fits["B300"]


def test_sequence_parallelism_keeps_the_recipes_global_batch_through_derived_accumulation():
    # The recipe states global_batch_size: 8 blocks; SP 4 on 8 GPUs leaves 2 data-parallel groups, so 4 accumulation
    # steps keep 262,144 tokens per step (a fixed accumulation would have shrunk it to 65,536).
    sp1, sp4 = qwen_recipe_plan(32768, 1), qwen_recipe_plan(32768, 4)

    assert (sp1.sequences_per_step, sp4.sequences_per_step) == (8, 8)
    assert sp1.tokens_per_step == sp4.tokens_per_step == 8 * 32768
    # each device holds a quarter of each block's tokens, 4 times per step, at the same FLOPs per token (attention
    # over the whole block): the same work per device per step
    assert sp4.flops_per_token == sp1.flops_per_token
    assert sp4.compute_seconds["H100"] == pytest.approx(sp1.compute_seconds["H100"])
    text = format_plan(sp4)
    assert "1 seq/group x 32768 tokens x 4 accumulation x 2 groups = 8 sequences = 262,144 tokens" in text
    assert "SP 4: 2 groups of 4 devices share each block, 8,192 tokens per device" in text


def test_sequence_parallel_activations_per_held_token_add_the_out_projection_copy_and_replicated_kv_heads():
    config = tiny_config("llama")  # 8 heads x 8, 2 kv heads, hidden 64, 2 layers, bf16: b = 2
    q, dim, b = 8 * 8, 8, 2

    def per_token(sp: int) -> float:
        return activation_bytes_per_token(config, TrainingSetup(world_size=8, micro_batch_size=1, seq_len=64,
                                                                sequence_parallel_size=sp), checkpointing=False)

    assert per_token(2) - per_token(1) == 2 * b * q  # both layers: the out projection's input is its own tensor
    # SP 4 > 2 kv heads: every rank keeps one replicated kv head (k and v) over the whole block
    assert per_token(4) - per_token(1) == 2 * (b * q + 2 * b * dim * (4 * 1 - 2))


def test_sequence_parallel_memory_holds_a_block_share_plus_one_layers_all_to_all_buffers():
    config = tiny_config("llama", vocab_size=16)  # a small vocabulary: the peak is in a layer's backward
    counts = count_parameters(config)
    q, kv, b, tokens = 8 * 8, 2 * 8, 2, 1024

    def memory(sp: int):
        setup = TrainingSetup(world_size=4, micro_batch_size=2, seq_len=512, sequence_parallel_size=sp,
                              loss_implementation="full_logits")
        return estimate_memory(config, counts, setup, cuda_context_gib=0), setup

    (sp1, _), (sp2, setup2) = memory(1), memory(2)

    assert sp1.peak_at == sp2.peak_at == "layer backward"
    assert sp1.all_to_all == 0
    # send + receive of q, k, v and the output for the rank's 512 tokens
    assert sp2.all_to_all * GIB == tokens / 2 * 2 * b * (2 * q + 2 * kv)
    assert sp2.activations * GIB == tokens / 2 * activation_bytes_per_token(config, setup2, checkpointing=True)
    assert sp2.activations < 0.6 * sp1.activations


def test_offloading_leaves_one_layer_on_the_gpu_and_the_rest_on_the_host():
    config = tiny_config("llama", num_hidden_layers=6, vocab_size=16)
    counts = count_parameters(config)
    hidden, b, tokens = 64, 2, 4096

    def memory(offloading: bool):
        setup = TrainingSetup(world_size=1, micro_batch_size=8, seq_len=512, activation_offloading=offloading,
                              loss_implementation="full_logits")
        return estimate_memory(config, counts, setup, cuda_context_gib=0)

    kept, offloaded = memory(False), memory(True)

    assert kept.peak_at == offloaded.peak_at == "layer backward"

    assert offloaded.activations_offloaded * GIB == tokens * 5 * b * hidden  # 6 layer inputs, one brought back
    assert kept.activations_offloaded == 0
    assert (kept.activations - offloaded.activations) * GIB == tokens * 5 * b * hidden


def test_bad_sequence_parallel_setups_name_the_fix():
    with pytest.raises(ValueError, match="must divide the world size"):
        TrainingSetup(world_size=8, micro_batch_size=1, seq_len=1024, sequence_parallel_size=3)
    with pytest.raises(ValueError, match="block length"):
        TrainingSetup(world_size=8, micro_batch_size=1, seq_len=1023, sequence_parallel_size=2)


def test_llama_8b_at_4_x_1024_fits_16_h100():
    config = read_model_config(LLAMA_8B, download=False)
    setup = TrainingSetup(world_size=16, micro_batch_size=4, seq_len=1024, gradient_accumulation_steps=2)

    assert make_plan(config, setup).fits["H100"]


def test_gpt_oss_120b_lora_fits_8_h100_and_full_fine_tuning_does_not():
    config = read_model_config(GPT_OSS_120B, download=False)
    setup = TrainingSetup(
        world_size=8, micro_batch_size=1, seq_len=2048, gradient_accumulation_steps=4, attn_implementation="eager"
    )

    lora_plan = make_plan(config, setup, LoraConfig(**GPT_OSS_SEED_LORA))

    assert lora_plan.fits["H100"]
    assert lora_plan.counts.lora_ranks["model.layers.*.mlp.experts.gate_up_proj"] == [8]
    assert lora_plan.counts.lora_ranks["model.layers.*.self_attn.q_proj"] == [32]
    assert not make_plan(config, setup).fits["H100"]


# --------------------------------------------------------------------------------------------
# The plan as printed and written


def test_plan_json_has_the_documented_keys_and_the_batch_derivation():
    setup = TrainingSetup(
        world_size=16, micro_batch_size=4, seq_len=1024, gradient_accumulation_steps=2, dataset_sequences=52002
    )
    plan = make_plan(tiny_config("llama"), setup)

    written = json.loads(plan.to_json())

    assert written["world_size"] == 16
    assert written["tokens_per_step"] == 4 * 1024 * 2 * 16
    assert written["steps_per_epoch"] == 52002 // (4 * 2 * 16)  # whole global batches only
    assert written["total_params"] == plan.counts.total
    assert written["trainable_params"] == plan.counts.trainable
    memory = written["per_device_memory_gib"]
    assert {"params", "grads", "optimizer", "activations", "total"} <= set(memory)
    assert memory["total"] == pytest.approx(sum(memory[name] for name in MemoryEstimate.COMPONENTS))
    assert set(written["fits"]) == {"H100", "H200", "B200", "B300"}


def test_format_plan_prints_every_factor():
    setup = TrainingSetup(world_size=8, micro_batch_size=2, seq_len=512, gradient_accumulation_steps=3)
    text = format_plan(make_plan(tiny_config("gpt_oss"), setup, LoraConfig(**TINY_EXPERT_LORA)))

    assert "2 seq/device x 512 tokens x 3 accumulation x 8 devices = 48 sequences = 24,576 tokens" in text
    assert "model.layers.*.mlp.experts.gate_up_proj: 2" in text
    for name in (*MemoryEstimate.COMPONENTS, "total", "H100", "H200", "B200", "B300", "MFU"):
        assert name in text


def test_bad_setup_and_unknown_gpu_name_the_fix():
    with pytest.raises(ValueError, match="world_size must be at least 1"):
        TrainingSetup(world_size=0, micro_batch_size=1, seq_len=8)
    config = tiny_config("llama")
    setup = TrainingSetup(world_size=1, micro_batch_size=1, seq_len=8)
    with pytest.raises(ValueError, match="use one of"):
        estimate_step_time(config, count_parameters(config), setup, "A100")


# --------------------------------------------------------------------------------------------
# The memory model against a measured peak: one FSDP2 step on CPU
#
# CPU has no allocator statistics and RSS includes the allocator's caching, so the peak is taken
# exactly from the tensors themselves: a dispatch mode adds up the bytes of every storage an ATen
# op creates (DTensors counted through their local shards) and a weakref finalizer subtracts them
# when the storage dies. The second step is measured, so optimizer states exist, as in training.
# The estimate is compared without its CUDA/NCCL/fragmentation allowance. Stated factor: the
# estimate is within 0.85x-1.2x of the measured peak. TRL's fused LM head sits at the low end on
# CPU: without Triton it folds each logit tile with a few fp32 temporaries the GPU kernel avoids.
# qwen3_5 is not measured here: on CPU its gated-delta layers run the pure-torch reference path,
# which keeps several times what the flash-linear-attention kernels the planner models keep.


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages, counted at every ATen op."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._counted: weakref.WeakSet = weakref.WeakSet()

    def track(self, tensor: torch.Tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):
            for name in tensor.__tensor_flatten__()[0]:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self.track(inner)
            return
        storage = tensor.untyped_storage()
        if storage in self._counted:
            return
        self._counted.add(storage)
        self.live += storage.nbytes()
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._release, storage.nbytes())

    def _release(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out


def measured_peak_bytes(config, setup: TrainingSetup, lora: dict | None = None) -> int:
    """Peak tensor bytes of the second training step of ``config``'s model under FSDP2 as ``setup`` says."""
    torch.manual_seed(0)
    storage_dtype = torch.float32 if setup.fp32_master_weights and lora is None else setup.weights_dtype
    model_class = model_class_for(config)
    model = model_class._from_config(config, dtype=storage_dtype, attn_implementation=setup.attn_implementation)
    if setup.loss_implementation == "fused_lm_head":
        add_fused_lm_head(model)
    if lora is not None:
        model = get_peft_model(model, LoraConfig(**lora))  # adapters in fp32: the master weights
    if setup.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=setup.compute_dtype, reduce_dtype=setup.reduce_dtype)
    for layer in model.get_decoder().layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    vocab = config.get_text_config().vocab_size
    fused = {"fused_lm_head": True} if setup.loss_implementation == "fused_lm_head" else {}

    def step():
        ids = torch.randint(0, vocab, (setup.micro_batch_size, setup.seq_len))
        model(input_ids=ids, labels=ids, **fused).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = LiveTensorBytes()
    states = [value for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)]
    for tensor in [*model.parameters(), *model.buffers(), *states]:
        tracker.track(tensor)
    with tracker:
        step()
    return tracker.peak


WIDE_LLAMA = dict(
    vocab_size=256, hidden_size=256, intermediate_size=1024, num_attention_heads=8, head_dim=32, num_hidden_layers=4
)
WIDE_EXPERTS = dict(vocab_size=64, num_local_experts=16, intermediate_size=256, num_hidden_layers=4)
# accelerate's FSDP2 with mixed_precision bf16 (trainable weights upcast to fp32) and an fp32 reduce policy
ACCELERATE = dict(world_size=1, fp32_master_weights=True, reduce_dtype=torch.float32, loss_implementation="full_logits")
# the seeds' plain-torch FSDP2: the bf16 model is trained as it is loaded
SEED_BF16 = dict(world_size=1, fp32_master_weights=False, loss_implementation="full_logits")
GPT_OSS = dict(attn_implementation="eager")  # transformers has no sdpa for gpt_oss


@pytest.mark.parametrize(
    ("model_type", "sizes", "setup", "lora"),
    [
        # bound by parameter state: params, grads, AdamW, gathered units, reduce buffers
        ("llama", WIDE_LLAMA, dict(ACCELERATE, micro_batch_size=1, seq_len=64), None),
        # eager attention's fp32 softmax over S x S, every layer kept without checkpointing
        (
            "llama",
            dict(vocab_size=1024),
            dict(
                SEED_BF16, micro_batch_size=2, seq_len=512, attn_implementation="eager", activation_checkpointing=False
            ),
            None,
        ),
        # TRL's fused LM head
        (
            "llama",
            dict(vocab_size=256),
            dict(SEED_BF16, micro_batch_size=2, seq_len=512, loss_implementation="fused_lm_head"),
            None,
        ),
        # MoE with gpt_oss' bf16 softmax
        ("gpt_oss", dict(vocab_size=64), dict(SEED_BF16, **GPT_OSS, micro_batch_size=1, seq_len=1024), None),
        # LoRA on the expert tensors: peft's merged W + B @ A dominates, with and without checkpointing
        ("gpt_oss", WIDE_EXPERTS, dict(ACCELERATE, **GPT_OSS, micro_batch_size=1, seq_len=64), TINY_EXPERT_LORA),
        (
            "gpt_oss",
            WIDE_EXPERTS,
            dict(ACCELERATE, **GPT_OSS, micro_batch_size=1, seq_len=64, activation_checkpointing=False),
            TINY_EXPERT_LORA,
        ),
    ],
)
def test_memory_estimate_is_within_the_stated_factor_of_the_measured_peak(
    single_rank_group, model_type, sizes, setup, lora
):
    config = tiny_config(model_type, **sizes)
    setup = TrainingSetup(**setup)

    measured = measured_peak_bytes(config, setup, lora)
    counts = count_parameters(config, None if lora is None else LoraConfig(**lora))
    estimated = estimate_memory(config, counts, setup, cuda_context_gib=0).allocated * GIB

    assert 0.85 <= estimated / measured <= 1.2, f"estimated {estimated / 1e6:.2f} MB, measured {measured / 1e6:.2f} MB"


def test_eval_peak_keeps_no_gradients_and_no_full_logits():
    # qwen27b.yaml evaluates one 32k block per GPU. With the model's own loss the full logits
    # (T V (2 + 8) bytes, ~76 GiB) made eval, not training, the peak; TRL's fused head, which eval
    # now uses as training does, holds one 4096 x 32768 tile of them.
    config = read_model_config(QWEN_27B, download=False)
    setup = TrainingSetup(world_size=8, micro_batch_size=1, seq_len=32768, eval_micro_batch_size=1)
    plan = make_plan(config, setup)
    assert make_plan(config, dataclasses.replace(setup, eval_micro_batch_size=None)).eval_gib is None
    assert plan.eval_gib < plan.memory.total  # training is the peak again
    # The training state without gradients, plus one layer's forward: nothing kept for a backward.
    state = plan.memory.params + plan.memory.optimizer + plan.memory.unsharded_params
    assert state < plan.eval_gib < state + plan.memory.grads + plan.memory.overhead
    full_logits = make_plan(config, dataclasses.replace(setup, loss_implementation="full_logits"))
    logits_gib = 32768 * config.text_config.vocab_size * 10 / GIB
    assert full_logits.eval_gib - plan.eval_gib > 0.99 * logits_gib * (1 + FRAGMENTATION_FRACTION) - 1
    assert "eval" in format_plan(plan)
    # Under SP each rank evaluates whole blocks: training's peak shrinks with the SP size, eval's does not.
    sp = make_plan(config, dataclasses.replace(setup, sequence_parallel_size=4))
    assert sp.memory.total < plan.memory.total and sp.eval_gib == pytest.approx(plan.eval_gib)


def test_a_model_neither_here_nor_on_the_hub_is_one_line_before_the_tokenizer_or_the_weights(tmp_path, monkeypatch):
    import transformers

    import sft_recipes.loading as loading

    asked = []

    def offline_hub(name, **kwargs):  # what AutoConfig raises offline, after huggingface_hub's ~30 s of retries
        asked.append(f"{name} (cache only)" if kwargs.get("local_files_only") else name)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in "
                      "the cached files.\nCheck your internet connection or see how to run the library in offline mode")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", offline_hub)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)  # as on a machine whose DNS answers
    source = loading.ModelSource(SimpleNamespace(model_name_or_path="meta-llama/Llama-3.1-8B", model_revision=None))
    with pytest.raises(RecipeError) as err:
        source.ensure_files()  # a run and --audit-data call it before loading the tokenizer or the weights
    assert str(err.value) == (
        "meta-llama/Llama-3.1-8B is not a folder here and the Hugging Face Hub does not give it (We couldn't connect "
        "to 'https://huggingface.co' to load the files, and couldn't find them in the cached files.): fix "
        "model_name_or_path (a model folder or a Hub id; model_revision for another revision, HF_TOKEN for a gated "
        "model).")
    # A name under a folder that is here, with no Hub to ask: a mistyped path, refused at once (not after ~30 s of
    # retries), naming what is there.
    (tmp_path / "outputs" / "demo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "huggingface.co does not resolve: no network")
    for download in (True, False):
        with pytest.raises(RecipeError) as err:
            read_model_config("outputs/dmeo", download=download)
        assert str(err.value) == ("outputs/dmeo is not a folder here (outputs is; it holds demo), and the Hugging Face "
                                  "Hub cannot be asked for it (huggingface.co does not resolve: no network): fix "
                                  "model_name_or_path.")
    assert asked == ["meta-llama/Llama-3.1-8B"]
    # Where the Hub can be asked, it is: `meta-llama/Llama-3.1-70B` beside a downloaded meta-llama/ folder is a Hub id.
    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)
    with pytest.raises(RecipeError, match="^outputs/dmeo is not a folder here and the Hugging Face Hub does not give"):
        read_model_config("outputs/dmeo")
    assert asked == ["meta-llama/Llama-3.1-8B", "outputs/dmeo"]
    # No Hub to ask: the cache only, at once (huggingface_hub would retry for ~30 s first).
    monkeypatch.setattr(loading, "hub_unreachable", lambda: "HF_HUB_OFFLINE is set")
    with pytest.raises(RecipeError) as err:
        read_model_config("meta-llama/Llama-3.1-70B")
    assert str(err.value) == (
        "meta-llama/Llama-3.1-70B is not a folder here nor in the Hugging Face cache, and the Hub cannot be asked for "
        "it (HF_HUB_OFFLINE is set): fix model_name_or_path, or run where the Hub answers (HF_TOKEN for a gated model).")
    assert asked[-1] == "meta-llama/Llama-3.1-70B (cache only)"


def test_the_hub_is_unreachable_offline_or_without_a_connection(monkeypatch):
    import socket

    from huggingface_hub import constants

    import sft_recipes.loading as loading
    from sft_recipes import network

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert loading.hub_unreachable() == "HF_HUB_OFFLINE is set"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(network, "_answers", {})  # a new process
    clock = [1000.0]
    monkeypatch.setattr(network, "monotonic", lambda: clock[0])
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    tried = []

    def connections_end_with(error: OSError | None):
        def connect(address, timeout):
            tried.append((address, timeout))
            if error:
                raise error
            return socket.socket()  # closed by the caller

        monkeypatch.setattr(socket, "create_connection", connect)
        clock[0] += network.REMEMBERED_S  # the last answer is forgotten: asked again

    connections_end_with(socket.gaierror(socket.EAI_NONAME, "Name or service not known"))
    assert loading.hub_unreachable() == "huggingface.co does not resolve: no network"
    assert tried == [(("huggingface.co", 443), network.CONNECT_TIMEOUT_S)]
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.internal:3128")  # the proxy connects to the Hub, not us
    assert loading.hub_unreachable() is None
    monkeypatch.setenv("NO_PROXY", "huggingface.co")  # ... unless the Hub is not reached through it
    assert loading.hub_unreachable() == "huggingface.co does not resolve: no network"
    assert len(tried) == 1  # the first answer serves a run's start
    connections_end_with(TimeoutError("timed out"))  # a firewall that drops the packets
    assert loading.hub_unreachable() == "no connection to huggingface.co:443 within 5 s: a firewall?"
    connections_end_with(ConnectionRefusedError(111, "Connection refused"))  # ... or refuses them
    assert loading.hub_unreachable() == "no connection to huggingface.co:443: Connection refused"
    monkeypatch.setattr(constants, "ENDPOINT", "http://hub.internal:8080")  # a mirror (HF_ENDPOINT), on its own port
    assert loading.hub_unreachable() == "no connection to hub.internal:8080: Connection refused"
    assert tried[-1] == (("hub.internal", 8080), 5)
    connections_end_with(None)
    assert loading.hub_unreachable() is None


def test_a_model_missing_from_the_cache_names_the_shipped_config_files(tmp_path, monkeypatch):
    import sft_recipes.loading as loading

    assert (REPO_ROOT / loading.SHIPPED_MODEL_CONFIGS / "meta-llama__Llama-3.1-8B.json").is_file()
    name = "sft-recipes-tests/not-a-cached-model"
    with pytest.raises(ValueError) as err:
        read_model_config(name, download=False)
    assert str(err.value) == (
        f"{name} is not in the Hugging Face cache and the planner never downloads: run `.venv/bin/hf download {name} "
        "config.json`, or point model_name_or_path at a local config.json file (or a directory holding one), e.g. one "
        "of the shipped data/realworld/model_configs/*.json.")
    (tmp_path / "sft-recipes-tests__not-a-cached-model.derived.json").write_text("{}")
    monkeypatch.setattr(loading, "SHIPPED_MODEL_CONFIGS", tmp_path)
    with pytest.raises(ValueError) as err:
        read_model_config(name, download=False)
    assert str(err.value).endswith(
        f"e.g. `--model_name_or_path {tmp_path.as_posix()}/sft-recipes-tests__not-a-cached-model.derived.json` "
        "(shipped with this clone).")

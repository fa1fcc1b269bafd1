"""Packed rows must compute exactly what the examples compute alone, for every recipe architecture.

The reference is independent of the packing code: every segment of a packed batch (written out
literally) is run through the same model on its own, and the loss is rebuilt from those logits.
Negative controls show the comparison does catch the leaks it guards against.
"""

import inspect
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback
from transformers.models.qwen3_5 import modeling_qwen3_5

from sft_recipes.data.collator import BlockDiagonalCollator
from sft_recipes.architectures import check_packing_leak, prepare_for_packing
from sft_recipes.architectures import registry
from sft_recipes.architectures.preflight import shrink_config
from sft_recipes.architectures.qwen3_5 import install_segment_aware_fallbacks, segment_bounds
from sft_recipes.tiny import DEFAULT_VOCAB_SIZE, real_config_dict, tiny_config

LENGTHS = (11, 6, 9)
TOLERANCE = 1e-5
# Leaks measured on these fixtures are 0.1-0.6; anything above this is unmistakably one.
CLEAR_LEAK = 1e-2


def tiny_model(model_type: str, attn_implementation: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if model_type == "qwen3_5":
        # The recipe's model is the VLM checkpoint; packing must work through its text tower.
        model = AutoModelForImageTextToText.from_config(tiny_config("qwen3_5"), attn_implementation=attn_implementation)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, modeling_qwen3_5.Qwen3_5GatedDeltaNet):
                    # Decay exp(-exp(-7) * softplus(a)) ~ 0.9995 per token: a carried-over state would show.
                    module.A_log.fill_(-7.0)
                    module.dt_bias.fill_(0.0)
    elif model_type == "gpt_oss":
        # A window shorter than the examples, so the sliding layers really slide.
        config = tiny_config("gpt_oss", sliding_window=4)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation)
    else:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation=attn_implementation)
    return model.float().eval()


def packed_batch(max_length: int, split_examples: bool) -> dict:
    generator = torch.Generator().manual_seed(1)
    examples = [{"input_ids": torch.randint(DEFAULT_VOCAB_SIZE, (n,), generator=generator).tolist()} for n in LENGTHS]
    return BlockDiagonalCollator(max_length=max_length, pad_token_id=0, split_examples=split_examples)(examples)


def segments_alone(model: torch.nn.Module, batch: dict, segments: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, L, V] and mean loss with every ``(row, start, end)`` segment run through ``model`` alone."""
    logits = torch.empty(*batch["input_ids"].shape, model.config.get_text_config().vocab_size)
    loss_sum = torch.zeros(())
    for row, start, end in segments:
        segment_logits = model(input_ids=batch["input_ids"][row, start:end].unsqueeze(0), use_cache=False).logits[0]
        logits[row, start:end] = segment_logits
        targets = batch["labels"][row, start + 1 : end]
        loss_sum = loss_sum + F.cross_entropy(segment_logits[:-1], targets, ignore_index=-100, reduction="sum")
    return logits, loss_sum / (batch["labels"][:, 1:] != -100).sum()


# (collator arguments, the segments they must produce from examples of LENGTHS 11, 6, 9)
LAYOUTS = {
    # [11 | 6 | 9 | pad 6] in one row.
    "whole examples, one padded row": (
        dict(max_length=32, split_examples=False),
        [(0, 0, 11), (0, 11, 17), (0, 17, 26), (0, 26, 32)],
    ),
    # [11 | 5 of 6] [1 of 6 | 9 | pad 6]: two rows, a split example and a one-token segment.
    "split examples, two rows": (
        dict(max_length=16, split_examples=True),
        [(0, 0, 11), (0, 11, 16), (1, 0, 1), (1, 1, 10), (1, 10, 16)],
    ),
}


def max_difference(model: torch.nn.Module, layout: str, inputs: tuple[str, ...] | None = None) -> float:
    """Max |packed - alone| over logits and loss, giving the packed model only ``inputs`` of the batch."""
    collator_args, segments = LAYOUTS[layout]
    batch = packed_batch(**collator_args)
    with torch.no_grad():
        packed = model(**{key: batch[key] for key in inputs or batch}, use_cache=False)
        logits, loss = segments_alone(model, batch, segments)
    return max((packed.logits - logits).abs().max().item(), (packed.loss - loss).abs().item())


ARCHITECTURES = [("llama", "sdpa"), ("llama", "eager"), ("qwen3_5", "sdpa"), ("gpt_oss", "eager")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("model_type", "attn_implementation"), ARCHITECTURES)
def test_packed_logits_loss_and_gradients_equal_examples_run_alone(model_type, attn_implementation, layout):
    model = tiny_model(model_type, attn_implementation)
    prepare_for_packing(model)
    collator_args, segments = LAYOUTS[layout]
    batch = packed_batch(**collator_args)
    assert segment_bounds(*batch["input_ids"].shape, seq_idx=batch["seq_idx"]) == segments

    packed = model(**batch, use_cache=False)
    packed.loss.backward()
    packed_grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    logits, loss = segments_alone(model, batch, segments)
    loss.backward()
    alone_grads = [p.grad for p in model.parameters() if p.grad is not None]

    assert (packed.logits - logits).abs().max().item() < TOLERANCE
    assert (packed.loss - loss).abs().item() < TOLERANCE
    assert len(packed_grads) == len(alone_grads) > 0
    assert max((a - b).abs().max().item() for a, b in zip(packed_grads, alone_grads)) < TOLERANCE


def test_negative_control_qwen3_5_leaks_with_position_ids_alone():
    model = tiny_model("qwen3_5", "sdpa")
    prepare_for_packing(model)
    # The linear-attention layers never see position_ids: without seq_idx / cu_seq_lens they
    # convolve and carry state across examples even with the fallbacks installed.
    position_ids_only = ("input_ids", "labels", "position_ids")
    assert max_difference(model, "whole examples, one padded row", inputs=position_ids_only) > CLEAR_LEAK
    assert max_difference(model, "whole examples, one padded row") < TOLERANCE


def test_negative_control_gpt_oss_eager_leaks_without_its_fix():
    model = tiny_model("gpt_oss", "eager")
    assert max_difference(model, "whole examples, one padded row") > CLEAR_LEAK
    prepare_for_packing(model)
    assert max_difference(model, "whole examples, one padded row") < TOLERANCE


# --- the qwen3_5 reference kernels on their own -------------------------------------------------

install_segment_aware_fallbacks(modeling_qwen3_5)
CONV = modeling_qwen3_5.causal_conv1d_fn
CHUNK_RULE = modeling_qwen3_5.torch_chunk_gated_delta_rule


def test_segment_bounds_from_seq_idx_and_from_cu_seqlens_agree():
    expected = [(0, 0, 2), (0, 2, 5), (1, 0, 3), (1, 3, 5)]
    seq_idx = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 3, 3]], dtype=torch.int32)
    assert segment_bounds(2, 5, seq_idx=seq_idx) == expected
    assert segment_bounds(2, 5, cu_seqlens=torch.tensor([0, 2, 5, 8, 10], dtype=torch.int32)) == expected
    # Rows separate examples even where cu_seqlens do not say so.
    assert segment_bounds(2, 5, cu_seqlens=torch.tensor([0, 2, 8, 10], dtype=torch.int32)) == expected


def conv_inputs(lengths: list[int], kernel_size: int = 4):
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, 8, sum(lengths), generator=generator)
    weight = torch.randn(8, kernel_size, generator=generator)
    seq_idx = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))[None]
    pieces = hidden.split(lengths, dim=2)
    # Each example alone: a plain depthwise causal convolution.
    causal = [F.conv1d(x, weight.unsqueeze(1), padding=kernel_size - 1, groups=8)[..., : x.shape[-1]] for x in pieces]
    alone = F.silu(torch.cat(causal, dim=2))
    return hidden, weight, seq_idx, alone


def test_transformers_torch_conv_bleeds_exactly_kernel_size_minus_one_tokens():
    hidden, weight, _, alone = conv_inputs([5, 3, 6])
    leaky = CONV.__wrapped__(hidden, weight, None, activation="silu")
    bled = ((leaky - alone).abs() > 1e-6).any(dim=1)[0].nonzero().flatten().tolist()
    assert bled == [5, 6, 7, 8, 9, 10]


def test_transformers_torch_conv_refuses_seq_idx():
    hidden, weight, seq_idx, _ = conv_inputs([5, 3, 6])
    with pytest.raises(ValueError, match="can't keep packed sequences apart without `causal_conv1d`"):
        CONV.__wrapped__(hidden, weight, None, activation="silu", seq_idx=seq_idx)


def test_segment_aware_conv_equals_each_example_alone():
    hidden, weight, seq_idx, alone = conv_inputs([5, 3, 6])
    assert (CONV(hidden, weight, None, activation="silu", seq_idx=seq_idx) - alone).abs().max() < 1e-6
    cu_seq_lens = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    assert (CONV(hidden, weight, None, activation="silu", cu_seq_lens_q=cu_seq_lens) - alone).abs().max() < 1e-6


def delta_rule_inputs(lengths: list[int]):
    generator = torch.Generator().manual_seed(0)
    total = sum(lengths)
    query, key, value = (torch.randn(1, total, 2, 8, generator=generator) for _ in range(3))
    g = -1e-3 * torch.rand(1, total, 2, generator=generator)  # decay ~1: state would carry over
    beta = torch.rand(1, total, 2, generator=generator)
    return query, key, value, g, beta


def test_segment_aware_delta_rule_equals_each_example_alone_and_reference_leaks():
    lengths = [5, 3, 6]
    query, key, value, g, beta = delta_rule_inputs(lengths)
    kwargs = dict(use_qk_l2norm_in_kernel=True)
    alone = torch.cat(
        [
            CHUNK_RULE.__wrapped__(
                query[:, s:e], key[:, s:e], value[:, s:e], g=g[:, s:e], beta=beta[:, s:e], **kwargs
            )[0]
            for s, e in [(0, 5), (5, 8), (8, 14)]
        ],
        dim=1,
    )
    cu_seqlens = torch.tensor([0, 5, 8, 14], dtype=torch.int32)
    packed, _ = CHUNK_RULE(query, key, value, g=g, beta=beta, cu_seqlens=cu_seqlens, **kwargs)
    assert (packed - alone).abs().max() < 1e-6
    leaky, _ = CHUNK_RULE.__wrapped__(query, key, value, g=g, beta=beta, **kwargs)
    # The carried-over state changes every token of every later example, not just the first few.
    assert ((leaky - alone).abs().amax(dim=(2, 3))[0, 5:] > 1e-4).all()
    assert (leaky[:, :5] - alone[:, :5]).abs().max() < 1e-6


def test_bound_kernels_receive_the_boundaries_and_fla_one_row(monkeypatch):
    received = {}

    def causal_conv1d_fn(x, weight, bias=None, seq_idx=None, activation=None):
        received["seq_idx"] = seq_idx
        return x

    def chunk_gated_delta_rule(q, k, v, g, beta, initial_state=None, output_final_state=False, cu_seqlens=None):
        if cu_seqlens is not None and q.shape[0] != 1:  # as fla-core 0.6.0 refuses it
            raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`.")
        received["cu_seqlens"], received["rows"] = cu_seqlens, list(q.shape[:2])
        return v * 2, None

    conv_package = types.ModuleType("fake_causal_conv1d")
    conv_package.causal_conv1d_fn = causal_conv1d_fn
    fla, ops, rule = (types.ModuleType(name) for name in ("fake_fla", "fake_fla.ops", "fake_fla.ops.gated_delta_rule"))
    fla.ops, ops.gated_delta_rule, rule.chunk_gated_delta_rule = ops, rule, chunk_gated_delta_rule
    for module in (conv_package, fla, ops, rule):
        monkeypatch.setitem(sys.modules, module.__name__, module)

    def torch_path(*args, **kwargs):
        raise AssertionError("the torch path must not run when a kernel is bound")

    modeling = types.ModuleType("fake_modeling")
    bind_kernel = use_kernel_func_from_hub_with_fallback
    modeling.causal_conv1d_fn = bind_kernel("causal_conv1d_fn", "fake_causal_conv1d")(torch_path)
    modeling.torch_chunk_gated_delta_rule = bind_kernel("chunk_gated_delta_rule", "fake_fla")(torch_path)
    conv = modeling.causal_conv1d_fn
    install_segment_aware_fallbacks(modeling)
    assert modeling.causal_conv1d_fn is conv  # causal-conv1d takes seq_idx per row: left in place

    seq_idx, cu_seqlens = torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32)
    modeling.causal_conv1d_fn(torch.zeros(1, 2, 4), torch.zeros(2, 4), None, activation="silu", seq_idx=seq_idx)
    modeling.torch_chunk_gated_delta_rule(*[torch.zeros(1, 4, 1, 2)] * 3, g=None, beta=None, cu_seqlens=cu_seqlens)
    assert received["seq_idx"] is seq_idx and received["cu_seqlens"] is cu_seqlens

    # Two packed rows of 4 reach the kernel as one row of 8; the row edge 4 joins cu_seqlens that lack it.
    value = torch.arange(16.0).reshape(2, 4, 1, 2)
    output, _ = modeling.torch_chunk_gated_delta_rule(
        value, value, value, g=value[..., 0], beta=value[..., 0], cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.int32)
    )
    assert received["rows"] == [1, 8] and received["cu_seqlens"].tolist() == [0, 3, 4, 8]
    assert torch.equal(output, value * 2)


def test_two_rows_handed_to_a_one_row_kernel_compute_what_the_two_rows_do():
    """The flattening itself is exact: a one-row-only stand-in (our torch rule) gives the two-row result."""
    from sft_recipes.architectures.qwen3_5 import _as_one_row, _chunk_rule

    def one_row_only(query, *args, cu_seqlens=None, **kwargs):
        assert query.shape[0] == 1
        return CHUNK_RULE(query, *args, cu_seqlens=cu_seqlens, **kwargs)

    query, key, value, g, beta = (x.reshape(2, 7, *x.shape[2:]) for x in delta_rule_inputs([5, 3, 6]))
    cu_seqlens = torch.tensor([0, 5, 7, 8, 14], dtype=torch.int32)  # [5 | 2 of 3] [1 of 3 | 6]
    kwargs = dict(g=g, beta=beta, cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=True)
    two_rows, _ = CHUNK_RULE(query, key, value, **kwargs)
    flattened, _ = _chunk_rule(one_row_only, _as_one_row)(query, key, value, **kwargs)
    assert flattened.shape == two_rows.shape == (2, 7, 2, 8)
    assert torch.equal(flattened, two_rows)


def test_fla_installed_without_a_gpu_runs_transformers_torch_reference():
    # transformers binds fla whenever it imports; without a GPU or Triton's interpreter it cannot run
    # (RuntimeError: 0 active drivers), so sft_recipes.architectures.kernels puts the torch reference back.
    import importlib.util

    from sft_recipes.architectures.kernels import kernel_bound, triton_runs_here

    assert not triton_runs_here()
    assert importlib.util.find_spec("fla") is not None, "fla-core is in requirements-test.txt"
    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        function = getattr(modeling_qwen3_5, name)
        assert not kernel_bound(function)
        assert inspect.unwrap(function).__module__ == modeling_qwen3_5.__name__


# --- the preflight ------------------------------------------------------------------------------


def real_config(model_type: str):
    """The full-size config of the recipe's model (Llama-3.1-8B, Qwen3.5-27B, gpt-oss-120b)."""
    config = real_config_dict(model_type)
    return AutoConfig.for_model(config.pop("model_type"), **config)


@pytest.mark.parametrize(
    ("model_type", "attn_implementation"),
    [("llama", "sdpa"), ("qwen3_5", "flash_attention_2"), ("gpt_oss", "eager")],
)
def test_preflight_passes_for_every_recipe_architecture(model_type, attn_implementation):
    check_packing_leak(real_config(model_type), attn_implementation)


def test_preflight_refuses_an_architecture_whose_fix_is_missing(monkeypatch):
    monkeypatch.delitem(registry.PACKING_QUIRKS, "gpt_oss")
    with pytest.raises(ValueError, match=r"leak into each other for model_type 'gpt_oss'.*Turn packing off"):
        check_packing_leak(real_config("gpt_oss"), "eager")


def test_shrunk_config_keeps_the_real_structure():
    qwen = shrink_config(real_config("qwen3_5"))
    assert qwen.model_type == "qwen3_5_text"
    assert qwen.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (qwen.num_attention_heads, qwen.num_key_value_heads, qwen.head_dim) == (6, 1, 256)
    assert (qwen.linear_num_key_heads, qwen.linear_num_value_heads, qwen.linear_conv_kernel_dim) == (1, 3, 4)
    gpt_oss = shrink_config(real_config("gpt_oss"))
    assert gpt_oss.layer_types == ["sliding_attention", "full_attention"]
    assert (gpt_oss.sliding_window, gpt_oss.num_local_experts, gpt_oss.num_attention_heads) == (4, 4, 8)

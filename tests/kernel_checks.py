"""fla's real gated-delta kernel under Triton's interpreter on the qwen3_5 twins, through our packing path.

Run in a fresh interpreter (``tests/test_kernels_interpreter.py`` does): ``python tests/kernel_checks.py OUT.json``.
Every check runs once and records its numbers (or its error) under its name; the tests assert on them.
Kept small for the interpreter (~2 s per kernel call): the tiny twin's sizes with 2 decoder layers
(one gated-delta, one full attention), examples of 11, 6 and 9 tokens.
"""

from __future__ import annotations

import inspect
import json
import re
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import triton_interpreter  # noqa: E402  (before transformers: sets the interpreter, binds fla)

modeling_qwen3_5 = triton_interpreter.install()

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: E402

from sft_recipes.architectures import check_packing_leak, prepare_for_packing  # noqa: E402
from sft_recipes.architectures.preflight import (  # noqa: E402
    check_image_packing_leak,
    example_inputs,
    probe_image_examples,
)
from sft_recipes.architectures.qwen3_5 import prepare_for_image_packing  # noqa: E402
from sft_recipes.architectures.registry import PACKING_QUIRKS  # noqa: E402
from sft_recipes.data.blocks import join_examples  # noqa: E402
from sft_recipes.data.collator import BlockDiagonalCollator  # noqa: E402
from sft_recipes.data.vision import VisionBlockCollator  # noqa: E402
from sft_recipes.tiny import tiny_config  # noqa: E402

LENGTHS = (11, 6, 9)
LAYER_TYPES = ["linear_attention", "full_attention"]


def twin_config():
    """The tiny qwen3_5 twin (recipes/tiny/qwen27b.yaml's model, VLM config) cut to one layer of each kind."""
    config = tiny_config("qwen3_5")
    config.text_config.layer_types = LAYER_TYPES
    config.text_config.num_hidden_layers = len(LAYER_TYPES)
    return config


def examples() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    vocab = twin_config().text_config.vocab_size
    return [torch.randint(vocab, (n,), generator=generator).tolist() for n in LENGTHS]


def text_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(twin_config().text_config, attn_implementation="sdpa").float()
    PACKING_QUIRKS["qwen3_5"].expose_leaks(model)  # slow gates: a carried-over state would show
    prepare_for_packing(model)
    return model


def run(model, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], float]:
    """Logits, parameter gradients and loss of one forward + backward."""
    model.zero_grad()
    output = model(**batch, use_cache=False)
    output.loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.logits.detach(), grads, output.loss.item()


def separate_batch(ids: list[list[int]]) -> dict:
    """Each example alone in its own row, right-padded: every layer is causal, so a row's real tokens see only
    themselves (fla's kernel without cu_seqlens); padded tokens carry no label."""
    width = max(len(example) for example in ids)
    input_ids = torch.zeros(len(ids), width, dtype=torch.long)
    labels = torch.full((len(ids), width), -100)
    for row, example in enumerate(ids):
        input_ids[row, : len(example)] = torch.tensor(example)
        labels[row, : len(example)] = torch.tensor(example)
    return {"input_ids": input_ids, "labels": labels}


def compare(packed, separate, places) -> dict:
    """Max |Δ| of the examples' logits, of the loss, and the largest gradient difference relative to its tensor."""
    packed_logits, packed_grads, packed_loss = packed
    separate_logits, separate_grads, separate_loss = separate
    logit_difference = max(
        (packed_logits[row, start : start + length] - separate_logits[example, :length]).abs().max().item()
        for example, (row, start, length) in enumerate(places)
    )
    grad_difference = max(
        ((packed_grads[name] - grad).abs().max() / grad.abs().max().clamp_min(1e-30)).item()
        for name, grad in separate_grads.items()
    )
    assert packed_grads.keys() == separate_grads.keys()
    return {"logits": logit_difference, "loss": abs(packed_loss - separate_loss), "grads_relative": grad_difference,
            "grad_tensors": len(separate_grads)}


def check_text(results: dict) -> None:
    ids = examples()
    model = text_model()
    dispatcher = modeling_qwen3_5.torch_chunk_gated_delta_rule
    # Ours, in front of transformers' binding, whose closure holds the implementation it calls.
    results["dispatcher"] = inspect.getclosurevars(dispatcher).nonlocals["packed"].__name__  # its route for packed rows
    results["kernel"] = inspect.getclosurevars(dispatcher.__wrapped__).nonlocals["implementation"].__module__
    separate = run(model, separate_batch(ids))
    # One block per row: [11 | 6 | 9 | pad 6], as pack_blocks + the collator build it.
    one_row = BlockDiagonalCollator(max_length=32, pad_token_id=0, split_examples=False)(
        [{"input_ids": example} for example in ids]
    )
    results["one_row_shape"] = list(one_row["input_ids"].shape)
    results["one_row"] = compare(run(model, one_row), separate, [(0, 0, 11), (0, 11, 6), (0, 17, 9)])
    # Two packed blocks per device batch (per_device_train_batch_size 2): [11 | 6] and [9 | pad 8].
    blocks = [{"input_ids": ids[0] + ids[1], "seq_lengths": [11, 6]}, {"input_ids": ids[2]}]
    two_rows = BlockDiagonalCollator(max_length=17, pad_token_id=0, block_per_row=True)(blocks)
    results["two_rows_shape"] = list(two_rows["input_ids"].shape)
    results["two_rows_cu_seq_lens"] = two_rows["cu_seq_lens_q"].tolist()
    results["two_rows"] = compare(run(model, two_rows), separate, [(0, 0, 11), (0, 11, 6), (1, 0, 9)])
    # Negative control: the same row without its boundaries (no cu_seq_lens, seq_idx or restarting positions).
    with torch.no_grad():
        leaked = model(input_ids=one_row["input_ids"], use_cache=False).logits
    results["leak_control"] = {"logits": max(
        (leaked[0, start : start + length] - separate[0][example, :length]).abs().max().item()
        for example, (start, length) in enumerate([(11, 6), (17, 9)])
    )}
    # What fla itself accepts: transformers' binding of it, given the two rows as they are.
    fla_bound = modeling_qwen3_5.torch_chunk_gated_delta_rule.__wrapped__
    q = torch.zeros(2, 17, 2, 16)
    try:
        fla_bound(q, q, torch.zeros(2, 17, 6, 16), g=torch.zeros(2, 17, 6), beta=torch.zeros(2, 17, 6),
                  cu_seqlens=two_rows["cu_seq_lens_q"])
        results["fla_two_rows_error"] = None
    except ValueError as error:
        results["fla_two_rows_error"] = str(error)


def check_vlm(results: dict) -> None:
    """The VLM class of the twin (Qwen3_5ForConditionalGeneration, its vision tower) on image + text examples:
    two packed blocks per device batch, collated by VisionBlockCollator, against each example run alone."""
    config = twin_config()
    # The probe's random text ids stay below the vision ids: put those at the top of the vocabulary.
    for offset, key in enumerate(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")):
        setattr(config, key, config.text_config.vocab_size - 1 - offset)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="sdpa").float()
    PACKING_QUIRKS["qwen3_5"].expose_leaks(model)
    prepare_for_packing(model)
    prepare_for_image_packing(model)
    probe = probe_image_examples(config)  # 11, 6, 9 text tokens with 2, 0 and 1 images' tokens among them
    blocks = [join_examples([vars(example) for example in probe[:2]]), join_examples([vars(probe[2])])]
    width = max(len(block["input_ids"]) for block in blocks)
    batch = VisionBlockCollator(width, pad_token_id=0)(blocks)
    results["vlm_shape"] = list(batch["input_ids"].shape)
    results["vlm_images"] = int(batch["image_grid_thw"].shape[0])
    packed = run(model, batch)
    # Alone: each example through the model's own path (it computes its mRoPE positions), the packed loss
    # rebuilt as the target-weighted mean of the examples' losses.
    targets = [sum(label != -100 for label in example.labels[1:]) for example in probe]
    model.zero_grad()
    logits, loss = [], 0.0
    for example, count in zip(probe, targets):
        output = model(**example_inputs(example, model.config, "cpu"), use_cache=False)
        (output.loss * count / sum(targets)).backward()
        logits.append(output.logits[0].detach())
        loss += output.loss.item() * count / sum(targets)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    width_alone = max(len(example.input_ids) for example in probe)
    separate_logits = torch.zeros(len(probe), width_alone, logits[0].shape[-1])
    for index, example_logits in enumerate(logits):
        separate_logits[index, : len(example_logits)] = example_logits
    lengths = [len(example.input_ids) for example in probe]
    places = [(0, 0, lengths[0]), (0, lengths[0], lengths[1]), (1, 0, lengths[2])]
    results["vlm_two_rows"] = compare(packed, (separate_logits, grads, loss), places)


def check_preflights(results: dict) -> None:
    """The packing gates on the kernel path: the text probe and the image + text probe (the VLM class)."""
    messages = [check_packing_leak(twin_config(), "sdpa"), check_image_packing_leak(twin_config())]
    results["preflight_messages"] = messages
    results["preflight_differences"] = [float(re.search(r"= (\S+)$", m).group(1)) for m in messages]


def main() -> None:
    results: dict = {}
    for check in (check_text, check_vlm, check_preflights):
        started = time.perf_counter()
        try:
            check(results)
        except Exception:  # recorded, so each test reports its own failure
            results[f"{check.__name__}_error"] = traceback.format_exc()
        results[f"{check.__name__}_seconds"] = round(time.perf_counter() - started, 1)
    Path(sys.argv[1]).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

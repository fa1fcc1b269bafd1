"""fla's real Triton kernels, run on CPU by Triton's interpreter, on the qwen3_5 twins through our packing path.

One fresh interpreter (``tests/kernel_checks.py``, set up by ``tests/triton_interpreter.py`` before
transformers imports) runs every check once (55 s on the 2 shared cores); each test asserts on its part of
the results. The same model and examples (11, 6, 9 tokens) run packed and as separate sequences; tolerances
are fp32 rounding, measured leaks are > 0.5 (docs/kernels.md).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # one Triton-interpreter subprocess of ~1 min for the module
TESTS = Path(__file__).resolve().parent
TOLERANCE = 1e-5  # logits, loss and gradients relative to each tensor's largest entry (measured <= 1e-6)
CLEAR_LEAK = 1e-1


@pytest.fixture(scope="module")
def kernel_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("kernels") / "results.json"
    subprocess.run([sys.executable, str(TESTS / "kernel_checks.py"), str(out)], check=True, timeout=600,
                   cwd=TESTS.parent)
    return json.loads(out.read_text())


def no_error(results: dict, check: str) -> None:
    assert f"{check}_error" not in results, results[f"{check}_error"]


def test_fla_kernel_runs_behind_our_one_row_dispatcher(kernel_results):
    no_error(kernel_results, "check_text")
    assert kernel_results["kernel"] == "fla.ops.gated_delta_rule.chunk"
    assert kernel_results["dispatcher"] == "_as_one_row"


@pytest.mark.parametrize("layout, shape", [("one_row", [1, 32]), ("two_rows", [2, 17])])
def test_packed_equals_separate_on_fla_forward_and_backward(kernel_results, layout, shape):
    no_error(kernel_results, "check_text")
    assert kernel_results[f"{layout}_shape"] == shape
    differences = kernel_results[layout]
    assert differences["grad_tensors"] == 28  # every parameter of the 2-layer twin got a gradient
    assert differences["logits"] < TOLERANCE
    assert differences["loss"] < TOLERANCE
    assert differences["grads_relative"] < TOLERANCE


def test_vlm_two_image_blocks_per_batch_equal_their_examples_alone_on_fla(kernel_results):
    # Qwen3_5ForConditionalGeneration with its vision tower: [ex 1 (2 images) | ex 2] and [ex 3 (1 image) | pad].
    no_error(kernel_results, "check_vlm")
    assert kernel_results["vlm_shape"][0] == 2 and kernel_results["vlm_images"] == 3
    differences = kernel_results["vlm_two_rows"]
    assert differences["logits"] < TOLERANCE
    assert differences["loss"] < TOLERANCE
    assert differences["grads_relative"] < TOLERANCE


def test_fla_refuses_two_rows_that_our_dispatcher_flattens(kernel_results):
    # What fla requires of cu_seqlens: a batch of one row. Two packed blocks per device reach it as one row of 34.
    no_error(kernel_results, "check_text")
    assert kernel_results["fla_two_rows_error"].startswith(
        "The batch size is expected to be 1 rather than 2 when using `cu_seqlens`."
    )
    assert kernel_results["two_rows_cu_seq_lens"] == [0, 11, 17, 26, 34]


def test_packed_without_boundaries_leaks_on_fla(kernel_results):
    no_error(kernel_results, "check_text")
    assert kernel_results["leak_control"]["logits"] > CLEAR_LEAK


def test_packing_preflights_pass_on_the_kernel_path(kernel_results):
    no_error(kernel_results, "check_preflights")
    text, image = kernel_results["preflight_messages"]
    assert text.startswith("packing preflight passed for qwen3_5 (attention sdpa")
    assert image.startswith("image packing preflight passed for qwen3_5")
    assert max(kernel_results["preflight_differences"]) < TOLERANCE

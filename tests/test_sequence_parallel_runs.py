"""Sequence parallelism in real runs: what is refused, and `accelerate launch` with 2 CPU processes and
`--sequence_parallel_size 2` training like one process, for the tiny Llama, Qwen3.5 and gpt-oss twins."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO_ROOT, launch_sft, read_summary
from sft_recipes.config import load_recipe
from sft_recipes.errors import RecipeError
from sft_recipes.run.sequence_parallel import refuse_unworkable_sequence_parallel
from sft_recipes.tiny import tiny_config

TINY = REPO_ROOT / "recipes" / "tiny"
PACKED_CHAT = ("--dataset_name", "data/samples/ultrachat.jsonl", "--dataset_format", "messages",
               "--pack_blocks", "true")


def sp_recipe(tmp_path, **changes):
    values = {"model_name_or_path": "tiny:llama", "dataset_name": "data/samples/ultrachat.jsonl",
              "dataset_format": "messages", "pack_blocks": True, "max_length": 256, "output_dir": "outputs/x",
              "use_cpu": True, "bf16": False, "attn_implementation": "sdpa", "sequence_parallel_size": 2, **changes}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(values))
    return load_recipe(path)


@pytest.mark.parametrize(("changes", "world_size", "model_type", "expected"), [
    ({"pack_blocks": False}, 2, "llama", "set pack_blocks: true"),
    ({}, 3, "llama", r"must divide the world size 3: choose one of \[1, 3\]"),
    ({"max_length": 255}, 2, "llama", "max_length=255 is not a multiple of 2"),
    ({"attn_implementation": "flex_attention"}, 2, "llama", "not attn_implementation 'flex_attention'"),
    ({"sequence_parallel_size": 8}, 8, "qwen3_5", "does not split this model"),
])
def test_unworkable_sequence_parallel_is_refused_with_its_fix(tmp_path, changes, world_size, model_type, expected):
    with pytest.raises(RecipeError, match=expected):
        refuse_unworkable_sequence_parallel(sp_recipe(tmp_path, **changes), world_size, tiny_config(model_type))


def test_workable_sequence_parallel_passes(tmp_path):
    refuse_unworkable_sequence_parallel(sp_recipe(tmp_path), 4, tiny_config("llama"))
    refuse_unworkable_sequence_parallel(sp_recipe(tmp_path, pack_blocks=False, sequence_parallel_size=1), 3,
                                        tiny_config("llama"))

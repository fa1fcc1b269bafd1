"""What a run imports before its first step: a run that cannot be LoRA never imports PEFT
(sft_recipes.environment.without_peft_unless_lora, called first thing by scripts/sft.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from conftest import REPO_ROOT, command_environment
from sft_recipes.environment import may_use_lora

TINY = REPO_ROOT / "recipes" / "tiny"


@pytest.mark.parametrize(("argv", "parameters", "lora"), [
    (["recipes/tiny/llama8b.yaml", "--max_steps", "2"], None, False),
    (["recipes/tiny/gptoss120b.yaml"], None, True),                         # use_peft: true in the recipe
    (["recipes/tiny/llama8b.yaml", "--use_peft", "true"], None, True),      # on the command line
    (["recipes/tiny/llama8b.yaml"], {"use_peft": True}, True),             # in HYPERPARAMETERS_PATH's file
    (["recipes/tiny/llama8b.yaml"], {"max_steps": 3}, False),
    (["--config_file", "accelerate_configs/fsdp2_cpu.yaml", "missing.yaml"], None, False),  # the loader refuses it
])
def test_a_run_may_be_lora_only_when_a_source_mentions_use_peft(tmp_path, monkeypatch, argv, parameters, lora):
    monkeypatch.chdir(REPO_ROOT)
    environ = {}
    if parameters is not None:
        (tmp_path / "parameters.yaml").write_text(yaml.safe_dump(parameters))
        environ["HYPERPARAMETERS_PATH"] = str(tmp_path / "parameters.yaml")
    assert may_use_lora(argv, environ) is lora


IMPORTS_OF_A_RUN = """
import sys
sys.argv = ["scripts/sft.py", *sys.argv[1:]]
from sft_recipes.environment import without_peft_unless_lora
hidden = without_peft_unless_lora(sys.argv[1:])
from sft_recipes.config import load_recipe           # scripts/sft.py's imports, in its order
from sft_recipes.run import complete_run, start_run
from importlib.metadata import version
from transformers.utils import is_peft_available
import trl
trl.SFTTrainer
print(hidden, version("peft"), is_peft_available(), sys.modules.get("peft") is not None)
"""


def test_a_run_that_is_not_lora_never_imports_peft_although_it_is_installed():
    # A fresh interpreter: the tests' own process (and the warm launcher) imported peft long ago.
    result = subprocess.run([sys.executable, "-c", IMPORTS_OF_A_RUN, str(TINY / "llama8b.yaml")], cwd=REPO_ROOT,
                            env=command_environment(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[-2] == "True 0.21.2 False False"

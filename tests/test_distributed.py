"""The start-up guard refuses runs that are not what the launcher asked for (accelerate's silent fallbacks)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from accelerate.state import AcceleratorState

from sft_recipes.distributed import process_group_destroyed_on_exit, verify_distributed
from sft_recipes.errors import RecipeError
from sft_recipes.config import ModelArguments
from sft_recipes.loading import load_model
from sft_recipes.tiny import ensure_tiny

from conftest import free_port


@pytest.fixture
def make_trainer(tmp_path):
    from transformers import Trainer, TrainingArguments

    model = load_model(ModelArguments(model_name_or_path=ensure_tiny("llama"), dtype="float32"))

    def make(use_cpu: bool = True):
        args = TrainingArguments(output_dir=str(tmp_path), use_cpu=use_cpu, report_to=[])
        return Trainer(model=model, args=args)

    yield make
    AcceleratorState._reset_state(reset_partial_state=True)


def test_single_process_without_fsdp_passes(make_trainer, monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert verify_distributed(make_trainer()) == "NO over 1 process(es) on cpu"


def test_fsdp_requested_but_not_active_is_refused(make_trainer, monkeypatch):
    # What `accelerate launch` with an FSDP config exports; on CPU accelerate ignores it silently.
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(RecipeError, match="the accelerate config asks for FSDP but the trainer runs NO"):
        verify_distributed(make_trainer())


def test_process_training_alone_is_refused(make_trainer, monkeypatch):
    # Without `use_cpu`, accelerate on a GPU-less machine ignores the launcher: every process of an
    # N-process launch trains alone on the full data, and exits 0.
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RecipeError, match=r"WORLD_SIZE=2 processes but the trainer sees num_processes=1"):
        verify_distributed(make_trainer(use_cpu=False))


@pytest.mark.parametrize("exit_code", [0, 75])
def test_process_group_is_destroyed_however_the_script_exits(exit_code):
    # Left to interpreter shutdown, gloo can abort a finished rank with SIGABRT (pytorch PR #179291).
    with pytest.raises(SystemExit) as exited:
        with process_group_destroyed_on_exit():
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
            dist.barrier()
            raise SystemExit(exit_code)
    assert exited.value.code == exit_code
    assert not dist.is_initialized()


@pytest.mark.fsdp
@pytest.mark.parametrize("teardown", ["ours", "torch's"])
def test_a_finished_run_leaves_no_gloo_thread_to_interpreter_exit(teardown, tmp_path):
    """The threads behind the SIGABRT after a clean run ("terminate called without an active exception"): torch's
    destroy_process_group() leaves them running (DTensor's caches keep the device mesh and its groups alive);
    ours stops them. The torch case stays as the proof that the test sees the threads at all."""
    from backend_threads_worker import gloo_threads_after

    for rank in gloo_threads_after("ours" if teardown == "ours" else "torch", tmp_path, free_port()):
        assert rank["during"].count("pt_gloo_runloop") >= 2 and "gloo_tcp_loop" in rank["during"], rank
        assert rank["after"] == ([] if teardown == "ours" else rank["during"]), rank


def test_an_hsdp_run_records_its_mesh_not_only_its_process_count(monkeypatch):
    """What run_summary.json's `distributed` says: accelerate's mesh from the config (hsdp_cpu.yaml: 2 x 2)."""
    from types import SimpleNamespace

    import torch
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    accelerator = SimpleNamespace(num_processes=4, distributed_type=DistributedType.FSDP, device=torch.device("cpu"),
                                  state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=2)),
                                  parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2))
    trainer = SimpleNamespace(accelerator=accelerator, is_fsdp_enabled=True, args=None)
    assert verify_distributed(trainer) == (
        "FSDP2 HSDP 2 replicas x 2 shards (dp_replicate x dp_shard) over 4 processes on cpu")
    accelerator.parallelism_config = ParallelismConfig(dp_shard_size=4)  # flat: as before
    assert verify_distributed(trainer) == "FSDP2 over 4 process(es) on cpu"

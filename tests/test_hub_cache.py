"""A Hub id where the Hub cannot be asked (an air-gapped node with a filled Hugging Face cache): every file is read
from the cache, and no request is made. huggingface_hub would retry each one for ~30 s first (docs/traps.md)."""

from __future__ import annotations

import importlib.util
import shutil
import socket
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from huggingface_hub import constants
from transformers import AutoImageProcessor

import sft_recipes.loading as loading
from conftest import REPO_ROOT
from sft_recipes.errors import RecipeError
from sft_recipes.export import copy_processor_files
from sft_recipes.tiny import ensure_tiny

COMMIT = "0123456789abcdef0123456789abcdef01234567"
NO_NETWORK = "huggingface.co does not resolve: no network"


def cache_a_hub_model(cache: Path, repo_id: str, files_from: str | Path) -> Path:
    """`files_from`'s files laid out as huggingface_hub caches `repo_id` at main; the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files_from, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture
def offline_cache(tmp_path, monkeypatch) -> tuple[Path, list]:
    """An empty Hugging Face cache, a Hub that cannot be asked, and the requests anything tried to make for a file."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(loading, "hub_unreachable", lambda: NO_NETWORK)
    asked = []

    def record_a_request(host, *args, **kwargs):
        # huggingface_hub asks once per process for its user-agent's list of agents, even for a cached file: one try
        # of 3 s, never retried (huggingface_hub#4904). Any other request is for a file, and would be retried.
        if any(frame.name == "_fetch_registry" for frame in traceback.extract_stack()):
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        asked.append(host)
        raise RuntimeError(f"asked {host} for a file: where it does not resolve, that is retried for ~30 s")

    monkeypatch.setattr(socket, "getaddrinfo", record_a_request)
    return cache, asked


def test_a_cached_hub_model_is_loaded_from_the_cache_without_a_request(offline_cache, tmp_path):
    cache, asked = offline_cache
    export = tmp_path / "export"
    export.mkdir()
    local = ensure_tiny("qwen3_5")
    snapshot = cache_a_hub_model(cache, "acme/tiny-vlm", local)
    source = loading.ModelSource(SimpleNamespace(model_name_or_path="acme/tiny-vlm", model_revision=None,
                                                 dtype="float32", attn_implementation="sdpa", dequantize_mxfp4=False))
    assert source.cache_only == NO_NETWORK
    assert source.ensure_files() == "acme/tiny-vlm"
    tokenizer, model = source.load_tokenizer(), source.load_model()
    image_processor = source.load_image_processor()
    assert source.processor_files() == {"preprocessor_config.json": snapshot / "preprocessor_config.json"}
    copy_processor_files(source.processor_files(), export)  # the export loads with the image processor it came with
    assert AutoImageProcessor.from_pretrained(export).to_dict() == image_processor.to_dict()
    assert asked == []
    # The very files of the folder it was cached from.
    here = loading.ModelSource(SimpleNamespace(model_name_or_path=local, model_revision=None, dtype="float32",
                                               attn_implementation="sdpa", dequantize_mxfp4=False))
    assert here.cache_only is None
    text = "Hello, cache."
    assert tokenizer(text)["input_ids"] == here.load_tokenizer()(text)["input_ids"]
    theirs = here.load_model().state_dict()
    assert all(torch.equal(tensor, theirs[name]) for name, tensor in model.state_dict().items())
    assert image_processor.to_dict() == here.load_image_processor().to_dict()
    assert here.processor_files() == {"preprocessor_config.json": Path(local) / "preprocessor_config.json"}


def test_a_hub_id_missing_from_the_cache_is_one_refusal_without_a_request(offline_cache):
    _, asked = offline_cache
    source = loading.ModelSource(SimpleNamespace(model_name_or_path="acme/not-cached", model_revision=None))
    with pytest.raises(RecipeError) as refused:
        source.ensure_files()
    assert str(refused.value) == (
        f"acme/not-cached is not a folder here nor in the Hugging Face cache, and the Hub cannot be asked for it "
        f"({NO_NETWORK}): fix model_name_or_path, or run where the Hub answers (HF_TOKEN for a gated model).")
    assert asked == []


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_evaluate_scores_a_cached_hub_model_without_a_request(offline_cache):
    cache, asked = offline_cache
    cache_a_hub_model(cache, "acme/tiny-llama", ensure_tiny("llama"))
    evaluate = _script("evaluate")
    model, tokenizer = evaluate.load_model("acme/tiny-llama", None)
    assert type(model).__name__ == "LlamaForCausalLM" and tokenizer("Hi")["input_ids"]
    with pytest.raises(RecipeError) as refused:
        evaluate.load_model("acme/not-cached", None)
    assert str(refused.value) == (
        f"MODEL 'acme/not-cached' is not a folder here nor in the Hugging Face cache, and the Hub cannot be asked for "
        f"it ({NO_NETWORK}): pass a run's output_dir, a model folder, or a Hub id (run where the Hub answers; HF_TOKEN "
        "for a gated model)")
    assert asked == []


def test_evaluate_hands_vllm_a_cached_hub_id_and_refuses_one_not_cached_before_vllm_starts(offline_cache,
                                                                                            monkeypatch):
    import contextlib
    import sys

    cache, asked = offline_cache
    cache_a_hub_model(cache, "acme/tiny-llama", ensure_tiny("llama"))
    evaluate = _script("evaluate")
    started = []  # vLLM is not installed here: lm-eval's VLLM is replaced by what records what it was given
    monkeypatch.setitem(sys.modules, "lm_eval.models.vllm_causallms",
                        SimpleNamespace(VLLM=lambda pretrained, **kwargs: started.append(pretrained)))
    with contextlib.ExitStack() as folders:
        evaluate.vllm_model(SimpleNamespace(model="acme/tiny-llama", revision=None), SimpleNamespace(seed=0), folders)
        with pytest.raises(RecipeError, match="^MODEL 'acme/not-cached' is not a folder here nor in the Hugging Face "
                                              "cache"):
            evaluate.vllm_model(SimpleNamespace(model="acme/not-cached", revision=None), SimpleNamespace(seed=0),
                                folders)
    assert started == ["acme/tiny-llama"]
    assert asked == []


def test_merge_lora_takes_a_cached_hub_base_without_a_request(offline_cache, tmp_path):
    cache, asked = offline_cache
    snapshot = cache_a_hub_model(cache, "acme/tiny-gpt-oss", ensure_tiny("gpt_oss"))
    merge_lora = _script("merge_lora")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"base_model_name_or_path": "acme/tiny-gpt-oss"}')
    assert merge_lora.resolve_base(adapter, None) == snapshot
    with pytest.raises(RecipeError) as refused:
        merge_lora.resolve_base(adapter, "acme/not-cached")
    assert str(refused.value) == (
        f"The base acme/not-cached is not a folder here nor in the Hugging Face cache, and the Hub cannot be asked for "
        f"it ({NO_NETWORK}): pass --base with the base checkpoint's folder, or run where the Hub answers.")
    assert asked == []


def hub_dataset_args(name: str) -> SimpleNamespace:
    return SimpleNamespace(dataset_name=name, dataset_train_split="train", dataset_config=None, dataset_revision=None,
                           dataset_streaming=False, max_train_samples=None)


def test_a_hub_dataset_with_no_hub_to_ask_is_one_refusal_at_once(offline_cache, monkeypatch, tmp_path):
    import datasets.config

    from sft_recipes.data.sources import load_raw_dataset

    _, asked = offline_cache
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    was_offline = datasets.config.HF_HUB_OFFLINE
    with pytest.raises(RecipeError) as refused:
        load_raw_dataset(hub_dataset_args("acme/some-chats"))
    assert str(refused.value) == (
        f"Dataset acme/some-chats is not a file or folder here nor in the datasets cache, and the Hugging Face Hub "
        f"cannot be asked for it ({NO_NETWORK}): fix dataset_name, or download it where the Hub answers "
        "(`.venv/bin/hf download acme/some-chats --repo-type dataset --local-dir DIR`) and give DIR there.")
    assert asked == []
    assert datasets.config.HF_HUB_OFFLINE is was_offline  # after the call, datasets asks the Hub as it did before
    (tmp_path / "data" / "samples").mkdir(parents=True)  # a folder's name mistyped: said as such
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RecipeError) as refused:
        load_raw_dataset(hub_dataset_args("data/samplez"))
    assert str(refused.value) == (
        f"Dataset data/samplez is not a folder here (data is; it holds samples), and the Hugging Face Hub cannot be "
        f"asked for it ({NO_NETWORK}): fix dataset_name.")


def test_a_hub_dataset_the_hub_does_not_give_is_one_refusal(monkeypatch):
    from datasets.exceptions import DatasetNotFoundError

    import sft_recipes.data.sources as sources

    def not_on_the_hub(name, *args, **kwargs):  # what datasets raises for a missing or gated dataset id
        raise DatasetNotFoundError(f"Dataset '{name}' doesn't exist on the Hub or cannot be accessed.")

    monkeypatch.setattr(loading, "hub_unreachable", lambda: None)
    monkeypatch.setattr(sources, "load_dataset", not_on_the_hub)
    with pytest.raises(RecipeError) as refused:
        sources.load_raw_dataset(hub_dataset_args("acme/no-such-chats"))
    assert str(refused.value) == (
        "Dataset acme/no-such-chats is not a file or folder here and the Hugging Face Hub does not give it (Dataset "
        "'acme/no-such-chats' doesn't exist on the Hub or cannot be accessed.): fix dataset_name (its config and "
        "revision; HF_TOKEN for a gated dataset).")


def test_an_adapter_on_a_cached_hub_base_loads_without_a_request(offline_cache, tmp_path):
    import json

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft_recipes.reporting.load_export import load_export

    cache, asked = offline_cache
    local = ensure_tiny("llama")
    cache_a_hub_model(cache, "acme/tiny-llama", local)
    export = tmp_path / "export"  # what a LoRA run of `model_name_or_path: acme/tiny-llama` exports
    adapter = get_peft_model(AutoModelForCausalLM.from_pretrained(local), LoraConfig(r=2, target_modules=["q_proj"]))
    adapter.save_pretrained(export)
    AutoTokenizer.from_pretrained(local).save_pretrained(export)
    config = json.loads((export / "adapter_config.json").read_text())
    (export / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "acme/tiny-llama"}))
    model, tokenizer = load_export(export)  # the samples after training, the tuned score, chat, show_run
    assert type(model.base_model.model).__name__ == "LlamaForCausalLM" and tokenizer("Hi")["input_ids"]
    assert asked == []


def test_a_mixture_entry_the_hub_cannot_give_is_named_by_its_key(offline_cache, monkeypatch, tmp_path):
    from sft_recipes.config import load_recipe
    from sft_recipes.data.formats import Tokenization
    from sft_recipes.data.mixture import build_source_data

    from transformers import AutoTokenizer

    monkeypatch.chdir(REPO_ROOT)
    tokenizer = AutoTokenizer.from_pretrained(ensure_tiny("llama"))
    for key in ("datasets", "eval_datasets"):
        entries = {"datasets": [{"path": "data/samples/ultrachat.jsonl", "dataset_format": "messages"}],
                   key: [{"path": "data/samples/ultrachat.jsonl", "dataset_format": "messages"},
                         {"path": "data/samplez", "dataset_format": "messages"}]}
        recipe = load_recipe(REPO_ROOT / "recipes" / "tiny" / "llama8b.yaml", {"dataset_name": None, **entries,
                                                                               "output_dir": str(tmp_path)})
        with pytest.raises(RecipeError) as refused:
            build_source_data(recipe.data, Tokenization(max_length=256), tokenizer, seed=0)
        assert str(refused.value) == (
            "Dataset data/samplez is not a folder here (data is; it holds realworld, samples), and the Hugging Face "
            f"Hub cannot be asked for it ({NO_NETWORK}): fix {key}.")

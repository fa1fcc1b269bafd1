"""Where a recipe's model comes from: its config (read once, at its revision), tokenizer and weights.

Loading through `config.architectures` (not a fixed AutoModelForCausalLM) is what keeps a VLM-style
checkpoint such as qwen3_5 whole: the exported model has the architecture that came in.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from sft_recipes import network
from sft_recipes.errors import RecipeError

TINY_SCHEME = "tiny:"  # "tiny:llama" -> a tiny random stand-in built offline (sft_recipes.tiny)
# The real models' config.json files, copied into the clone: what an offline dry run plans (README, docs/planner.md).
SHIPPED_MODEL_CONFIGS = Path("data/realworld/model_configs")
# A VLM checkpoint's processor files besides the tokenizer's: what AutoImageProcessor / AutoProcessor read.
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def read_model_config(model_name_or_path: str | Path, revision: str | None = None, *,
                      download: bool = True) -> PretrainedConfig:
    """The model's config from a local directory (``config.json`` alone is enough), a ``.json`` file, a
    Hub id (``config.json`` alone, never a weight; from the cache only when ``download`` is False), or
    ``tiny:<model_type>`` (the stand-in's config without building it)."""
    name = str(model_name_or_path)
    if name.startswith(TINY_SCHEME):
        from sft_recipes.tiny import tiny_config

        return tiny_config(name[len(TINY_SCHEME) :])
    path = Path(name).expanduser()
    if path.is_file() or path.is_dir():
        if path.is_dir() and not (path / "config.json").is_file():
            raise RecipeError(
                f"{path} has no config.json: point model_name_or_path at a model directory or a config file."
            )
        try:
            return AutoConfig.from_pretrained(str(path))
        except (OSError, ValueError) as error:  # not JSON; no or an unknown model_type (a paragraph: its first line)
            raise RecipeError(
                f"{path} is not a model config transformers {transformers.__version__} reads "
                f"({str(error).strip().splitlines()[0]}): point model_name_or_path at a model's config.json or its "
                "directory."
            ) from None
    refuse_a_missing_local_model(name)
    unreachable = cache_only(name) if download else None
    try:
        return AutoConfig.from_pretrained(name, revision=revision, local_files_only=not download or bool(unreachable))
    except OSError as error:
        if unreachable:
            raise RecipeError(f"{name} is not a folder here nor in the Hugging Face cache, and the Hub cannot be asked "
                              f"for it ({unreachable}): fix model_name_or_path, or run where the Hub answers (HF_TOKEN "
                              "for a gated model).") from None
        if download:  # no such repo or revision, a gated model without a token: transformers' first line
            raise RecipeError(
                f"{name} is not a folder here and the Hugging Face Hub does not give it "
                f"({str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__}): fix "
                "model_name_or_path (a model folder or a Hub id; model_revision for another revision, HF_TOKEN for a "
                "gated model)."
            ) from None
        raise ConfigNotInTheCache(name) from error


class ConfigNotInTheCache(RecipeError):
    """A Hub id whose config.json the planner needs and the Hugging Face cache lacks; `shipped`: this clone's copy."""

    def __init__(self, name: str):
        self.name = name
        self.shipped = next((path for path in (SHIPPED_MODEL_CONFIGS / f"{name.replace('/', '__')}{suffix}"
                                               for suffix in (".json", ".derived.json")) if path.is_file()), None)
        example = (f"`--model_name_or_path {self.shipped.as_posix()}` (shipped with this clone)" if self.shipped else
                   f"one of the shipped {SHIPPED_MODEL_CONFIGS.as_posix()}/*.json")
        super().__init__(f"{name} is not in the Hugging Face cache and the planner never downloads: run "
                         f"`.venv/bin/hf download {name} config.json`, or point model_name_or_path at a local "
                         f"config.json file (or a directory holding one), e.g. {example}.")


def refuse_a_missing_local_model(name: str) -> None:
    """A model_name_or_path written as a path here (a .json, ./, /, ~, or under a folder that is here) that is not
    here: refused without asking the Hub. Anything else is left to the Hub (or is here)."""
    path = Path(name).expanduser()
    if name.startswith(TINY_SCHEME) or path.exists():
        return
    if path.suffix == ".json" or name.startswith((".", "/", "~")):
        raise RecipeError(f"Model config {path} does not exist: fix model_name_or_path.")
    mistyped = a_mistyped_local_folder(name)
    if mistyped:
        raise RecipeError(f"{name} {mistyped}: fix model_name_or_path.")


def a_mistyped_local_folder(name: str) -> str | None:
    """Why `name` can only be a mistyped path here, said after it ("is not a folder here (outputs is; it holds demo),
    and the Hugging Face Hub cannot be asked for it (...)"), or None. Such a name sits under a folder that is here
    (`outputs/dmeo`); it could also be a Hub id whose owner is a folder here (`meta-llama/...` beside a downloaded
    `meta-llama/`), so it is a path only where the Hub cannot be asked (`hub_unreachable`), which would retry ~30 s."""
    parent = Path(name).expanduser().parent
    if parent == Path(".") or not parent.is_dir():
        return None
    unreachable = hub_unreachable()
    if not unreachable:
        return None
    folders = sorted(entry.name for entry in parent.iterdir() if entry.is_dir())
    shown = ", ".join(folders[:8]) + (f" and {len(folders) - 8} more" if len(folders) > 8 else "")
    held = f"it holds {shown}" if folders else "it holds no folder"
    return (f"is not a folder here ({parent} is; {held}), and the Hugging Face Hub cannot be asked for it "
            f"({unreachable})")


def cache_only(model_name_or_path: str) -> str | None:
    """Why a Hub id's files are read from the Hugging Face cache only: the Hub cannot be asked (`hub_unreachable`).
    None for a folder or file here, a `tiny:` stand-in, or a Hub that can be asked. Asking where it cannot answer,
    huggingface_hub retries every file for ~30 s before it falls back to the cache: 2.7 minutes for a cached tiny
    Llama's tokenizer and weights (docs/traps.md)."""
    if model_name_or_path.startswith(TINY_SCHEME) or Path(model_name_or_path).expanduser().exists():
        return None
    return hub_unreachable()


def hub_unreachable() -> str | None:
    """Why asking the Hugging Face Hub could only fail, or None: HF_HUB_OFFLINE, or no connection to its host
    (`network.unreachable`: it does not resolve, or a firewall refuses or drops it; not asked behind a proxy). One
    connection (its answer serves a run's start), no request: where huggingface_hub would retry each file for ~30 s."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    return network.unreachable(constants.ENDPOINT)


def resolve_model_path(model_name_or_path: str) -> str:
    if model_name_or_path.startswith(TINY_SCHEME):
        from sft_recipes.tiny import ensure_tiny

        return ensure_tiny(model_name_or_path[len(TINY_SCHEME) :])
    return model_name_or_path


def model_class_for(config) -> type[PreTrainedModel]:
    """The class the checkpoint was saved from (e.g. Qwen3_5ForConditionalGeneration)."""
    from sft_recipes.architectures.kernels import use_torch_references_where_triton_cannot_run

    cls = next((getattr(transformers, name) for name in config.architectures or [] if hasattr(transformers, name)),
               transformers.AutoModelForCausalLM)
    # Resolving the class imported its modeling module, which may have bound a Triton kernel that cannot run here.
    use_torch_references_where_triton_cannot_run()
    return cls


def load_tokenizer(model_args, model_path: str | None = None, *,
                   local_files_only: bool = False) -> PreTrainedTokenizerBase:
    path = model_path or resolve_model_path(model_args.model_name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(path, revision=model_args.model_revision,
                                              local_files_only=local_files_only)
    if tokenizer.pad_token is None:
        # Base checkpoints (Llama-3.1-8B) ship no pad token. Padding never reaches the loss: the
        # collator sets labels to -100 on every padded position, whatever token fills them.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def mxfp4_loading(config, dequantize_mxfp4: bool, path: str) -> transformers.Mxfp4Config | None:
    """`Mxfp4Config(dequantize=True)` for an MXFP4 checkpoint (gpt-oss), None for any other.

    MXFP4 weights cannot be trained (no gradients through the packed FP4 kernels), so an MXFP4
    checkpoint without `dequantize_mxfp4` is refused rather than loaded frozen or left to
    transformers' hardware-dependent fallback.
    """
    quantization = getattr(config, "quantization_config", None) or {}
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization.quant_method
    if method != "mxfp4":
        return None
    if not dequantize_mxfp4:
        raise RecipeError(
            f"{path} is an MXFP4-quantized checkpoint, which cannot be trained as it is: set `dequantize_mxfp4: true` "
            "in the recipe to load it dequantized to `dtype` (bfloat16 for gpt-oss)."
        )
    return transformers.Mxfp4Config(dequantize=True)


def load_model(model_args, model_path: str | None = None, config: PretrainedConfig | None = None, *,
               local_files_only: bool = False) -> PreTrainedModel:
    path = model_path or resolve_model_path(model_args.model_name_or_path)
    config = config or AutoConfig.from_pretrained(path, revision=model_args.model_revision,
                                                  local_files_only=local_files_only)
    dtype = model_args.dtype if model_args.dtype in (None, "auto") else DTYPES[model_args.dtype]
    model = model_class_for(config).from_pretrained(
        path,
        revision=model_args.model_revision,
        local_files_only=local_files_only,
        dtype=dtype,
        attn_implementation=model_args.attn_implementation,
        quantization_config=mxfp4_loading(config, model_args.dequantize_mxfp4, path),
    )
    # A KV cache is useless in training and disables transformers' packed-sequence detection.
    model.config.use_cache = False
    if hasattr(model.config, "text_config"):
        model.config.get_text_config().use_cache = False
    return model


class ModelSource:
    """The recipe's model: its config read once (at `model_revision`), its local path, its tokenizer
    and weights. A `tiny:` stand-in is built on first use of `path` (by the caller's main process first)."""

    def __init__(self, model_args) -> None:
        self.model_args = model_args

    @cached_property
    def config(self) -> PretrainedConfig:
        return read_model_config(self.model_args.model_name_or_path, self.model_args.model_revision)

    @cached_property
    def path(self) -> str:
        return resolve_model_path(self.model_args.model_name_or_path)

    @cached_property
    def cache_only(self) -> str | None:
        """Why the model's files are read from the Hugging Face cache only (see `cache_only`), or None."""
        return cache_only(self.model_args.model_name_or_path)

    def ensure_files(self) -> str:
        """The local path, a `tiny:` stand-in built there first if it is not yet; the config read, so that a model
        neither here nor on the Hub is one refusal here, not a traceback from the tokenizer or the weights."""
        self.config  # noqa: B018
        return self.path

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.model_args, self.path, local_files_only=bool(self.cache_only))

    def load_model(self) -> PreTrainedModel:
        return load_model(self.model_args, self.path, self.config, local_files_only=bool(self.cache_only))

    def load_image_processor(self):
        """A VLM's image processor (its preprocessor_config.json), PIL-backed: no torchvision needed."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(self.path, revision=self.model_args.model_revision, backend="pil",
                                                  local_files_only=bool(self.cache_only))

    def processor_files(self) -> dict[str, Path]:
        """The checkpoint's processor files besides the tokenizer's (`PROCESSOR_FILES`) that it has, by name: from its
        folder, or from the Hub (the cache only where the Hub cannot be asked) for a Hub id."""
        if Path(self.path).is_dir():
            return {name: Path(self.path) / name for name in PROCESSOR_FILES if (Path(self.path) / name).is_file()}
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError

        found = {}
        for name in PROCESSOR_FILES:
            try:
                found[name] = Path(hf_hub_download(self.path, name, revision=self.model_args.model_revision,
                                                   local_files_only=bool(self.cache_only)))
            except EntryNotFoundError:  # the checkpoint has no such file (or, cache only, it was never downloaded)
                continue
        return found

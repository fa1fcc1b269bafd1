"""Open recipes for supervised fine-tuning with TRL, Accelerate and FSDP2.

`from sft_recipes import train` is the Python entry point (sft_recipes.python_api); importing the package
itself loads nothing heavy.
"""

from sft_recipes.environment import drop_library_noise

drop_library_noise()


def __getattr__(name: str):
    if name == "RecipeError":  # what train() raises, for `except RecipeError` in a notebook
        from sft_recipes.errors import RecipeError

        return RecipeError
    if name in ("train", "RunResult"):
        from sft_recipes.environment import set_runtime_defaults

        set_runtime_defaults()  # before huggingface_hub and CUDA are first used, as scripts/sft.py does
        from sft_recipes import python_api, run

        return python_api.train if name == "train" else run.RunResult
    raise AttributeError(f"module 'sft_recipes' has no attribute {name!r}")

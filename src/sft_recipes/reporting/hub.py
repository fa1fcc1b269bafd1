"""Publish the checked export and its card to the Hugging Face Hub (`push_to_hub: true`).

The recipe's `push_to_hub` / `hub_model_id` / `hub_private_repo` are TRL's own SFTConfig fields;
`take_over_hub_push` reads them and switches the Trainer's push off (it would create the repo at
start and push unchecked weights at every save), so the only push is ours: after the export check
passed, from rank 0, with the token from the environment, through `HfApi.upload_folder` unmodified.
A push the Hub fails after training (no connection, an HTTP error) is a refusal, not a traceback: the export stays,
and the `error:` line holds the `hf upload` command that publishes the same files (`push_or_refusal`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from sft_recipes.errors import RecipeError
from sft_recipes.reporting.card import CARD_FILE
from sft_recipes.reporting.export_check import ExportCheck

MISSING_ID = "push_to_hub: true needs hub_model_id (e.g. hub_model_id: my-org/my-model) in the recipe."


@dataclass(frozen=True)
class HubPush:
    repo_id: str | None
    private: bool


def take_over_hub_push(training_args) -> HubPush | None:
    """The push the recipe asks for (None: no push), with the Trainer's own push switched off.

    Call before building the Trainer; it fails early (at start, not after training) when the id or
    the token is missing (RecipeError).
    """
    if not training_args.push_to_hub:
        return None
    refuse_a_push_without_an_id(training_args)
    push = HubPush(training_args.hub_model_id,
                   True if training_args.hub_private_repo is None else bool(training_args.hub_private_repo))
    training_args.push_to_hub = False
    try:
        hub_token()
    except ValueError as err:
        raise RecipeError(str(err)) from None
    from sft_recipes import loading  # the module: tests stand in for its hub_unreachable

    if unreachable := loading.hub_unreachable():  # refused now, not after the training it would follow
        raise RecipeError(f"push_to_hub: true, but the Hugging Face Hub cannot be asked from here ({unreachable}): the "
                          "push after training would fail. Set push_to_hub: false and upload the export later "
                          f"(`{upload_command(push, 'OUTPUT_DIR')}`), or run where the Hub answers.")
    return push


def refuse_a_token_that_cannot_push(push: HubPush) -> None:
    """A token the Hub rejects (401), or a read-only one, would fail the push after training: refused by the launch
    pre-check, once per node (the Hub rate-limits whoami strictly, so not once per rank). Whatever else happens
    asking (a busy Hub, a timeout) is left to the push, which asks again."""
    import httpx2  # huggingface_hub's HTTP client: every error of its request is one of its HTTPError
    from huggingface_hub import HfApi

    try:
        who = HfApi().whoami(token=hub_token())
    except (httpx2.HTTPError, ValueError) as err:  # ValueError: an answer that is not the Hub's JSON (a proxy's page)
        response = getattr(err, "response", None)
        if response is None or response.status_code != 401:
            return
        raise RecipeError(f"push_to_hub: true, but the Hugging Face Hub rejects the token in HF_TOKEN (401, invalid or "
                          f"revoked): the push of {push.repo_id} after training would fail. Set HF_TOKEN to a token "
                          "with write access (https://huggingface.co/settings/tokens).") from None
    token = (who.get("auth") or {}).get("accessToken") or {}
    if token.get("role") == "read":
        raise RecipeError(f"push_to_hub: true, but the token in HF_TOKEN ({token.get('displayName', 'unnamed')}) is "
                          f"read-only: the Hub would refuse the push of {push.repo_id} after training. Set HF_TOKEN to "
                          f"a write token, or a fine-grained one that may write to {push.repo_id.split('/')[0]}.")


def refuse_a_push_without_an_id(training_args) -> None:
    """The recipe's half of a push (the dry run checks it too; the token is the training machine's, not the plan's)."""
    if training_args.push_to_hub and not training_args.hub_model_id:
        raise RecipeError(MISSING_ID)


def hub_token() -> str:
    """The token from the environment only: HF_TOKEN, or the file HF_TOKEN_PATH names (never a recipe, never a
    stored login)."""
    token = os.environ.get("HF_TOKEN")
    if not token and os.environ.get("HF_TOKEN_PATH") and Path(os.environ["HF_TOKEN_PATH"]).is_file():
        token = Path(os.environ["HF_TOKEN_PATH"]).read_text().strip()
    if not token:
        raise ValueError("push_to_hub: true needs a Hugging Face token with write access in the HF_TOKEN environment "
                         "variable (or a file named by HF_TOKEN_PATH); it is never read from the recipe.")
    return token


def files_to_upload(output_dir: str | Path) -> list[str]:
    """The export (weights, configs, tokenizer, or the PEFT adapter), the card and the run's picture/samples:
    every top-level file of output_dir; checkpoints and set-aside folders stay home."""
    output_dir = Path(output_dir)
    if not (output_dir / CARD_FILE).is_file():
        raise FileNotFoundError(f"{output_dir / CARD_FILE} is missing: write the model card before pushing.")
    return sorted(path.name for path in output_dir.iterdir() if path.is_file())


def push_export(push: HubPush, output_dir: str | Path, export_check: ExportCheck, api=None):
    """Create the (private by default) repo and upload the export folder; rank 0 only.

    Refuses unless the export check passed. `api` defaults to `huggingface_hub.HfApi()`.
    Returns what `upload_folder` returns (the commit info).
    """
    if export_check.status != "passed":
        raise RuntimeError(
            f"Not pushing {output_dir} to {push.repo_id}: the export check {export_check.describe()}. "
            + ("Set verify_export: true so the export is checked before it is published."
               if export_check.status == "skipped" else "Fix the export (re-export from the last checkpoint) first.")
        )
    if not push.repo_id:
        raise ValueError(MISSING_ID)
    token = hub_token()
    files = files_to_upload(output_dir)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()
    api.create_repo(push.repo_id, private=push.private, exist_ok=True, token=token)
    return api.upload_folder(repo_id=push.repo_id, folder_path=str(output_dir), allow_patterns=files, token=token,
                             commit_message="Upload fine-tuned model (sft-recipes)")


def upload_command(push: HubPush, output_dir: str | Path) -> str:
    """The `hf upload` that publishes what `push_export` does: output_dir's top-level files. `--exclude "*/*"`: its
    checkpoint-*/ and other folders stay home (the CLI matches each path with fnmatch, whose `*` crosses folders)."""
    return f'.venv/bin/hf upload {push.repo_id} {output_dir} --exclude "*/*"' + (" --private" if push.private else "")


def push_or_refusal(push: HubPush, output_dir: str | Path, export_check: ExportCheck, api=None) -> str | None:
    """`push_export`; when the Hub fails it (no connection, a proxy, an HTTP error after huggingface_hub's retries),
    the refusal: the export is kept, and the command that uploads it. None: pushed."""
    import httpx2  # huggingface_hub's HTTP client: its transport errors are not OSErrors, its HTTP errors are both

    try:
        push_export(push, output_dir, export_check, api)
    except (httpx2.HTTPError, OSError) as err:
        reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}" if str(err).strip() else type(err).__name__
        return (f"the push of {output_dir} to {push.repo_id} on the Hugging Face Hub failed ({reason}). The export "
                f"is kept there, checked, with its card and run_summary.json: upload it once the Hub answers, with "
                f"`{upload_command(push, output_dir)}`")
    return None

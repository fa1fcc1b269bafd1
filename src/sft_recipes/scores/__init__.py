"""Benchmark scores with EleutherAI's lm-evaluation-harness: which tasks (tasks.py), scoring a loaded model with a
cache (harness.py), base against tuned with the gate, tables and picture (compare.py). docs/evaluation.md."""

"""The reference recipes' data code (shared/seeds/000 and 001), reproduced as the baselines.

The bodies are the seeds' own, line for line; only what ties them to a cluster changed: the block
length is a parameter instead of the module constant ``SEQ_LEN``, examples come from an iterable
instead of a Hub stream, tensors stay on the CPU, and module globals became attributes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


class Seed001PackedBlocks:
    """Seed 001 (Qwen3.8-27B recipe): ``PackedTokenDataset._tokenize_sft``, ``__iter__`` and ``_pack_block``.

    Note what the seed does at the end of a shard: the last, partial buffer is never yielded (its
    tokens are dropped), then one all-masked block flags ``ran_out``.
    """

    def __init__(self, tokenizer, seq_len: int):
        self.tok = tokenizer
        self.seq_len = seq_len
        self.device = torch.device("cpu")

    def _tokenize_sft(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        full_ids = self.tok.apply_chat_template(messages, tokenize=True, return_dict=False)
        loss_mask = [False] * len(full_ids)
        for i, msg in enumerate(messages):
            if msg["role"] != "assistant":
                continue
            prefix = self.tok.apply_chat_template(
                messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            through = self.tok.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
            for j in range(len(prefix), min(len(through), len(full_ids))):
                loss_mask[j] = True  # this assistant turn's response tokens contribute to loss
        return full_ids, loss_mask

    def _pack_block(self, ids: list[int], interior_starts: list[int], loss_mask: list[bool]):
        seq_len = self.seq_len
        bounds = [0, *sorted({s for s in interior_starts if 0 < s < seq_len}), seq_len]
        ids_t = torch.tensor(ids, dtype=torch.long)
        position_ids = torch.empty(seq_len, dtype=torch.long)
        seq_idx = torch.empty(seq_len, dtype=torch.int32)
        labels = ids_t.clone()
        labels[~torch.tensor(loss_mask, dtype=torch.bool)] = -100  # SFT: mask prompt tokens
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            position_ids[a:b] = torch.arange(b - a)
            seq_idx[a:b] = i
            if a > 0:
                labels[a] = -100  # causal-shifted target would come from the previous segment
        cu_seqlens = torch.tensor(bounds, dtype=torch.int32)
        max_len = max(b - a for a, b in zip(bounds[:-1], bounds[1:]))
        return (
            ids_t.unsqueeze(0).to(self.device),
            labels.unsqueeze(0).to(self.device),
            position_ids.unsqueeze(0).to(self.device),
            cu_seqlens.to(self.device),
            seq_idx.unsqueeze(0).to(self.device),
            max_len,
        )

    def blocks(self, examples: Iterable[dict]) -> Iterator[tuple[tuple, torch.Tensor]]:
        """The seed's ``__iter__`` over ``examples`` (rows with ``messages``)."""
        seq_len = self.seq_len
        buf: list[int] = []  # token ids, examples jammed end-to-end
        loss: list[bool] = []  # parallel SFT mask: True where the token contributes to loss
        starts: list[int] = []  # offsets in buf where each example begins
        for ex in examples:
            starts.append(len(buf))
            ids, ex_loss = self._tokenize_sft(ex["messages"])
            buf.extend(ids)
            loss.extend(ex_loss)
            while len(buf) >= seq_len:
                yield self._pack_block(buf[:seq_len], starts, loss[:seq_len]), torch.tensor(0.0)
                buf = buf[seq_len:]
                loss = loss[seq_len:]
                # keep only example starts landing in the carried-over remainder
                starts = [s - seq_len for s in starts if s - seq_len > 0]
        yield self._pack_block([0] * seq_len, [], [False] * seq_len), torch.tensor(1.0)


def seed000_text(row: dict, eos: str) -> str:
    """Seed 000 (Llama-3.1-8B recipe): ``build_dataset.format_example``, verbatim."""
    instruction = row.get("instruction", "")
    context = row.get("input", "")
    response = row.get("output", "")
    prompt = f"### Instruction:\n{instruction}\n\n"
    if context:
        prompt += f"### Input:\n{context}\n\n"
    return f"{prompt}### Response:\n{response}{eos}"


def seed000_tokenize(tokenizer, row: dict, max_seq_len: int) -> dict[str, list[int]]:
    """Seed 000: ``seed000_text`` tokenized and padded to ``max_seq_len``."""
    out = tokenizer(seed000_text(row, tokenizer.eos_token), truncation=True, max_length=max_seq_len,
                    padding="max_length")
    out["labels"] = out["input_ids"].copy()
    return out

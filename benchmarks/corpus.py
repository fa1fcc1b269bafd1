"""Benchmark inputs, all offline and deterministic: an UltraChat-like corpus, alpaca rows, real-size tokenizers.

* ``ultrachat_like(n, seed)``: multi-turn conversations with UltraChat 200k's shape -- 1 to 10 user
  turns (mean ~3.3), user messages of 50-150 words, assistant replies of 150-300 words in
  paragraphs and lists -- in English-like text: words drawn with Zipf frequencies from a lexicon
  built from the real alpaca rows and the project's sample data, plus derived forms (suffixes,
  prefixes, compounds, numbers) that give the long tail a real vocabulary has.
* ``alpaca_rows()``: the real alpaca rows in ``data/realworld/data`` (copies of ``shared/realworld``) plus ``data/samples/alpaca.jsonl``.
* ``standin_tokenizer(family)``: there is no Hub access here, so the real Llama-3 / Qwen3 tokenizers
  cannot be loaded. Instead a byte-level BPE with the real family's pre-tokenizer regex, its
  special tokens and its real chat template, trained on a few MB of this corpus with a real-size
  vocabulary target. Its speed class is the real one (same Rust BPE, same regex, same added-token
  matching); its tokens-per-word ratio is reported next to every result.

Everything is cached under ``.cache/bench`` (git-ignored), keyed by the arguments and this file.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Iterator
from itertools import accumulate
from pathlib import Path
from typing import Any

from sft_recipes.tiny import REALWORLD_DIR, SAMPLES_DIR, strings_in

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO_ROOT / ".cache" / "bench"
ALPACA_FILES = (
    REALWORLD_DIR / "data" / "tatsu-lab__alpaca.stanford_alpaca_pr152_subset300.jsonl",
    REALWORLD_DIR / "data" / "tatsu-lab__alpaca.torchtune_alpaca_tiny.jsonl",
    SAMPLES_DIR / "alpaca.jsonl",
)

# Chat templates by benchmark name. "qwen3-trl" is TRL 1.16's bundled copy of the Qwen3 template
# (the current Hub revision): the only one here that TRL's assistant_only_loss accepts, because TRL
# swaps in a {% generation %} training template only for templates byte-identical to its copies.
TEMPLATES = {
    "llama3.1": ("llama", REALWORLD_DIR / "chat_templates" / "meta-llama__Llama-3.1-8B-Instruct.jinja"),
    "qwen3": ("qwen", REALWORLD_DIR / "chat_templates" / "Qwen__Qwen3-0.6B.jinja"),
    "qwen3-trl": ("qwen", None),
}

# UltraChat 200k: user turns per conversation, 1..10 with mean ~3.3.
TURN_WEIGHTS = (0.15, 0.24, 0.23, 0.15, 0.09, 0.05, 0.035, 0.025, 0.015, 0.01)
USER_WORDS = (50, 150)
ASSISTANT_WORDS = (150, 300)

_WORD = re.compile(r"[A-Za-z]+")
_SUFFIXES = ("s", "ed", "ing", "er", "ly", "ness", "tion", "able", "ment", "ful", "less", "ize", "ist", "ity")
_PREFIXES = ("un", "re", "pre", "over", "non", "anti", "inter", "multi", "sub", "co", "micro", "semi")

# The real Llama-3 tokenizer.json pre-tokenizer (tiktoken's cl100k-style split, numbers in 1-3 digits).
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LLAMA3_SPECIALS = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>", "<|end_header_id|>",
    "<|eom_id|>", "<|eot_id|>", "<|python_tag|>", *(f"<|reserved_special_token_{i}|>" for i in range(3, 248)),
)
QWEN3_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)
QWEN3_PLAIN_ADDED = ("<tool_call>", "</tool_call>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>",
                     "<repo_name>", "<file_sep>", "<tool_response>", "</tool_response>", "<think>", "</think>")
# Real vocabulary sizes (BPE merges, without added tokens): the trainer stops earlier if the text runs out.
REAL_BPE_VOCAB = {"llama": 128000, "qwen": 151643}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def alpaca_rows() -> list[dict[str, str]]:
    """Every real alpaca row we have offline (700), with ``instruction``/``input``/``output``."""
    return [
        {"instruction": row["instruction"], "input": row.get("input") or "", "output": row["output"]}
        for path in ALPACA_FILES
        for row in read_jsonl(path)
    ]


class EnglishLike:
    """Sentences and paragraphs of Zipf-distributed words from a lexicon with a realistic long tail."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        lexicon = self._lexicon()
        # Zipf's law over ranks (s = 1.07, a Mandelbrot offset of 2.7 as fitted to English corpora).
        self.words = lexicon
        self.cumulative = list(accumulate(1.0 / (rank + 2.7) ** 1.07 for rank in range(len(lexicon))))

    def _lexicon(self) -> list[str]:
        counts: Counter[str] = Counter()
        for path in [*ALPACA_FILES, *sorted(SAMPLES_DIR.glob("*.jsonl"))]:
            for row in read_jsonl(path):
                for text in strings_in(row):
                    counts.update(word.lower() for word in _WORD.findall(text))
        base = [word for word, _ in counts.most_common()]
        stems = [word for word in base if len(word) >= 4]
        derived = {stem + suffix for stem in stems for suffix in _SUFFIXES}
        derived |= {prefix + stem for stem in stems for prefix in _PREFIXES}
        derived |= {a + b for a, b in zip(stems, reversed(stems))}
        derived |= {f"{a}-{b}" for a, b in zip(stems[::2], stems[1::2])}
        tail = sorted(derived - set(base))
        self.rng.shuffle(tail)
        return base + tail

    def word(self) -> str:
        if self.rng.random() < 0.025:
            return self.number()
        return self.rng.choices(self.words, cum_weights=self.cumulative)[0]

    def number(self) -> str:
        kind = self.rng.random()
        if kind < 0.4:
            return str(self.rng.randint(1, 100))
        if kind < 0.7:
            return str(self.rng.randint(1800, 2030))
        if kind < 0.9:
            return f"{self.rng.uniform(0, 100):.1f}%"
        return f"{self.rng.randint(1, 999):,}"

    def sentence(self, n_words: int) -> str:
        words = [self.word() for _ in range(n_words)]
        for i in range(1, n_words - 1):
            if self.rng.random() < 0.07:
                words[i] += self.rng.choice((",", ",", ",", ";", ":"))
            elif self.rng.random() < 0.03:
                words[i] = words[i].capitalize()  # names and places
        if self.rng.random() < 0.04 and n_words > 4:
            words[1] = "(" + words[1]
            words[3] += ")"
        return words[0].capitalize() + " " + " ".join(words[1:]) + self.rng.choice((".", ".", ".", ".", "?", "!"))

    def passage(self, n_words: int, paragraphs: bool) -> str:
        """About ``n_words`` words of sentences; with ``paragraphs``, blank-line paragraphs and lists."""
        pieces, written = [], 0
        while written < n_words:
            length = min(self.rng.randint(6, 24), max(3, n_words - written))
            pieces.append(self.sentence(length))
            written += length
        if not paragraphs or len(pieces) < 4:
            return " ".join(pieces)
        out, i = [], 0
        while i < len(pieces):
            if self.rng.random() < 0.2 and len(pieces) - i >= 3:  # a numbered or bulleted list
                items = pieces[i : i + self.rng.randint(3, 5)]
                bullet = self.rng.choice(("{n}. ", "- ", "* "))
                out.append("\n".join(bullet.format(n=n + 1) + item for n, item in enumerate(items)))
                i += len(items)
            else:
                size = self.rng.randint(2, 4)
                out.append(" ".join(pieces[i : i + size]))
                i += size
        return "\n\n".join(out)


def ultrachat_like(n_conversations: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """``n_conversations`` UltraChat-shaped conversations (user/assistant alternating, no system message)."""
    text = EnglishLike(seed)
    rng = random.Random(seed + 1)
    conversations = []
    for _ in range(n_conversations):
        turns = rng.choices(range(1, len(TURN_WEIGHTS) + 1), weights=TURN_WEIGHTS)[0]
        conversation = []
        for _ in range(turns):
            conversation.append({"role": "user", "content": text.passage(rng.randint(*USER_WORDS), paragraphs=False)})
            conversation.append(
                {"role": "assistant", "content": text.passage(rng.randint(*ASSISTANT_WORDS), paragraphs=True)}
            )
        conversations.append(conversation)
    return conversations


def cached_ultrachat_like(n_conversations: int, seed: int = 0) -> Path:
    """Path of a JSONL file with ``{"messages": ...}`` rows of ``ultrachat_like(n, seed)``."""
    path = CACHE_DIR / f"ultrachat_like-{n_conversations}-{seed}-{_source_key()}.jsonl"
    if not path.exists():
        rows = "".join(json.dumps({"messages": c}) + "\n" for c in ultrachat_like(n_conversations, seed))
        _write_atomically(path, rows)
    return path


def load_conversations(path: Path) -> list[list[dict[str, str]]]:
    return [row["messages"] for row in read_jsonl(path)]


def standin_tokenizer(template: str, training_conversations: int = 600, vocab_size: int | None = None):
    """A fast tokenizer standing in for the real one of ``template``'s family (see the module docstring).

    ``training_conversations`` (~6.5 kB each) sets how much text the BPE learns from; the vocabulary
    aims at the real size unless ``vocab_size`` says otherwise. Built once, then loaded from the cache.
    """
    from transformers import AutoTokenizer

    family, template_path = TEMPLATES[template]
    target = vocab_size or REAL_BPE_VOCAB[family]
    directory = CACHE_DIR / f"tokenizer-{family}-{training_conversations}-{target}-{_source_key()}"
    if not (directory / "tokenizer.json").exists():
        _train_standin(family, training_conversations, target).save_pretrained(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = _chat_template(template_path)
    return tokenizer


def _chat_template(path: Path | None) -> str:
    if path is not None:
        return path.read_text(encoding="utf-8")
    from trl.chat_template_utils import qwen3_chat_template

    return qwen3_chat_template


def _train_standin(family: str, training_conversations: int, vocab_size: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # The real Llama-3 tokenizer.json sets ignore_merges (a word in the vocabulary is one token,
    # looked up without running merges); Qwen's does not.
    backend = Tokenizer(models.BPE(ignore_merges=family == "llama"))
    if family == "llama":
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

        qwen = Qwen3_5Tokenizer().backend_tokenizer  # the real Qwen normalizer (NFC) and split regex
        backend.normalizer, backend.pre_tokenizer = qwen.normalizer, qwen.pre_tokenizer
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    # Held-out text: the benchmark corpora use seeds 0.., the tokenizer learns from seed 1000.
    texts = (message["content"] for conversation in ultrachat_like(training_conversations, seed=1000)
             for message in conversation)
    backend.train_from_iterator(texts, trainer=trainer)
    specials = LLAMA3_SPECIALS if family == "llama" else QWEN3_SPECIALS
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    if family == "qwen":
        backend.add_tokens([AddedToken(token, special=False, normalized=False) for token in QWEN3_PLAIN_ADDED])
        return PreTrainedTokenizerFast(
            tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=131072
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", add_bos_token=True,
        model_max_length=131072,
    )


def _source_key() -> str:
    """Changes whenever this file or the data the lexicon is built from changes."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    for path in [*ALPACA_FILES, *sorted(SAMPLES_DIR.glob("*.jsonl"))]:
        digest.update(path.read_bytes())
    return digest.hexdigest()[:10]


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{random.getrandbits(32):08x}")
    staging.write_text(text, encoding="utf-8")
    staging.replace(path)

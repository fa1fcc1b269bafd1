"""Assistant-only masks against the real chat templates in shared/realworld/chat_templates.

Expected masks are written out: the supervised text of each turn as literal strings (tiny BPE
tokenizers from ``sft_recipes.tiny``), and literal (token, bit) lists with a byte-per-token
tokenizer where every token is predictable by eye.
"""

from __future__ import annotations

import json
import random
import tempfile

import pytest
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template
from trl import SFTConfig, SFTTrainer

from sft_recipes.data.masking import (
    EMPTY_ASSISTANT_TURNS,
    NO_ASSISTANT_TURN,
    PREFIX_MISMATCH,
    TRUNCATED_AWAY,
    mask_conversations,
    tokenize_conversations,
)
from sft_recipes.data.formats import FORMATS, Tokenization
from sft_recipes.data.report import DataReport
from sft_recipes.tiny import REALWORLD_DIR, SAMPLES_DIR, build_tokenizer, tiny_config

TEMPLATES = REALWORLD_DIR / "chat_templates"
LLAMA_TEMPLATE = (TEMPLATES / "meta-llama__Llama-3.1-8B-Instruct.jinja").read_text()
CHATML_TEMPLATE = (TEMPLATES / "Qwen__Qwen2.5-7B-Instruct.chatml.jinja").read_text()
QWEN3_TEMPLATE = (TEMPLATES / "Qwen__Qwen3-0.6B.jinja").read_text()

# Multi-turn with a system message and reasoning on both assistant turns.
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!", "thinking": "greet"},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Bye.", "thinking": "farewell"},
]


@pytest.fixture(scope="module")
def llama():
    return build_tokenizer("llama")


@pytest.fixture(scope="module")
def qwen3():
    return build_tokenizer("qwen3_5")  # carries the real Qwen3 template


@pytest.fixture(scope="module")
def chatml():
    tokenizer = build_tokenizer("qwen3_5")
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def gpt_oss():
    return build_tokenizer("gpt_oss")


def byte_tokenizer(chat_template: str, special: list[str], plain: list[str] = (), **roles) -> PreTrainedTokenizerFast:
    """Every byte its own token (no merges), plus whole special / plain added tokens."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={char: i for i, char in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(special)
    backend.add_tokens(list(plain))
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=chat_template, **roles)


def supervised_texts(tokenizer, conversations, **kwargs) -> list[list[str]]:
    """Each conversation's runs of supervised tokens, decoded."""
    columns = tokenize_conversations(tokenizer, conversations, **kwargs)
    return [runs(tokenizer, ids, mask) for ids, mask in zip(columns["input_ids"], columns["assistant_masks"])]


def runs(tokenizer, ids: list[int], mask: list[int]) -> list[str]:
    texts, current = [], []
    for token, bit in zip(ids, mask):
        if bit:
            current.append(token)
        elif current:
            texts.append(tokenizer.decode(current))
            current = []
    if current:
        texts.append(tokenizer.decode(current))
    return texts


def sample_conversations(name: str) -> list[list[dict]]:
    lines = (SAMPLES_DIR / name).read_text().splitlines()
    return [json.loads(line)["messages"] for line in lines]


# ---------------------------------------------------------------------------------------------
# Exact masks per real template


def test_llama31_multi_turn_with_system(llama):
    assert supervised_texts(llama, [CHAT]) == [["Hello!<|eot_id|>", "Bye.<|eot_id|>"]]


def test_llama31_tokens_match_transformers_and_bos_is_not_doubled(llama):
    ids = tokenize_conversations(llama, [CHAT])["input_ids"][0]
    assert ids == llama.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    bos = llama.convert_tokens_to_ids("<|begin_of_text|>")
    assert ids[0] == bos and ids.count(bos) == 1
    assert llama(llama.apply_chat_template(CHAT, tokenize=False))["input_ids"][:2] == [bos, bos]  # the trap we avoid


def test_llama31_trims_content_and_leaves_thinking_unrendered(llama):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": " Yo \n", "thinking": "t"}]
    (row,) = mask_conversations(llama, [chat])
    assert runs(llama, row.input_ids, row.assistant_masks) == ["Yo<|eot_id|>"]
    assert row.unrendered_reasoning_turns == 1  # Llama 3.1 has no place for reasoning


def test_llama31_literal_tokens():
    tokenizer = byte_tokenizer(
        LLAMA_TEMPLATE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos_token="<|begin_of_text|>",
    )
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "bc"}]
    columns = tokenize_conversations(tokenizer, [chat])
    tokens = tokenizer.convert_ids_to_tokens(columns["input_ids"][0])
    mask = columns["assistant_masks"][0]
    tail = [
        ("<|start_header_id|>", 0), ("a", 0), ("s", 0), ("s", 0), ("i", 0), ("s", 0), ("t", 0), ("a", 0), ("n", 0),
        ("t", 0), ("<|end_header_id|>", 0), ("Ċ", 0), ("Ċ", 0), ("b", 1), ("c", 1), ("<|eot_id|>", 1),
    ]
    assert list(zip(tokens, mask))[-len(tail) :] == tail
    assert sum(mask) == 3 and tokens[0] == "<|begin_of_text|>"


def test_chatml_qwen25_multi_turn_with_system(chatml):
    assert supervised_texts(chatml, [CHAT]) == [["Hello!<|im_end|>\n", "Bye.<|im_end|>\n"]]


def test_chatml_default_system_prompt_is_not_supervised(chatml):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    (row,) = mask_conversations(chatml, [chat])
    assert "You are Qwen, created by Alibaba Cloud." in row.text
    assert runs(chatml, row.input_ids, row.assistant_masks) == ["Yo<|im_end|>\n"]


def test_qwen3_multi_turn_drops_earlier_reasoning_and_masks_what_is_rendered(qwen3):
    (row,) = mask_conversations(qwen3, [CHAT])
    assert "greet" not in row.text  # the template drops the first turn's reasoning
    assert runs(qwen3, row.input_ids, row.assistant_masks) == [
        "Hello!<|im_end|>\n",
        "<think>\nfarewell\n</think>\n\nBye.<|im_end|>\n",
    ]
    assert row.input_ids == qwen3.apply_chat_template(CHAT, tokenize=True, return_dict=False)
    assert (row.rerendered_turns, row.unrendered_reasoning_turns) == (1, 1)


def test_qwen3_reasoning_content_field_and_three_turns(qwen3):
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2", "reasoning_content": "r2"},
        {"role": "user", "content": "Q3"},
        {"role": "assistant", "content": "A3", "reasoning_content": "r3"},
    ]
    assert supervised_texts(qwen3, [chat]) == [
        ["A1<|im_end|>\n", "A2<|im_end|>\n", "<think>\nr3\n</think>\n\nA3<|im_end|>\n"]
    ]


def test_qwen3_enable_thinking_reaches_the_template(qwen3):
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
    # With thinking on, the model must write the (empty) think block itself; with it off, the
    # generation prompt already holds it, so it is prompt, not target.
    assert supervised_texts(qwen3, [chat]) == [["<think>\n\n</think>\n\nYo<|im_end|>\n"]]
    assert supervised_texts(qwen3, [chat], enable_thinking=False) == [["Yo<|im_end|>\n"]]


def test_qwen3_literal_tokens():
    tokenizer = byte_tokenizer(QWEN3_TEMPLATE, ["<|im_start|>", "<|im_end|>"], ["<think>", "</think>"])
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    columns = tokenize_conversations(tokenizer, [chat])
    tokens = tokenizer.convert_ids_to_tokens(columns["input_ids"][0])
    assert list(zip(tokens, columns["assistant_masks"][0])) == [
        ("<|im_start|>", 0), ("u", 0), ("s", 0), ("e", 0), ("r", 0), ("Ċ", 0), ("a", 0), ("<|im_end|>", 0), ("Ċ", 0),
        ("<|im_start|>", 0), ("a", 0), ("s", 0), ("s", 0), ("i", 0), ("s", 0), ("t", 0), ("a", 0), ("n", 0),
        ("t", 0), ("Ċ", 0),
        ("<think>", 1), ("Ċ", 1), ("Ċ", 1), ("</think>", 1), ("Ċ", 1), ("Ċ", 1),
        ("b", 1), ("<|im_end|>", 1), ("Ċ", 1),
    ]


def test_qwen3_inline_think_single_turn_is_located_with_its_reasoning_moved_out(qwen3):
    chat = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>r</think>A"}]
    (row,) = mask_conversations(qwen3, [chat])
    assert not row.used_prefix_renders  # the reasoning_content form renders the same text
    assert runs(qwen3, row.input_ids, row.assistant_masks) == ["<think>\nr\n</think>\n\nA<|im_end|>\n"]


def test_qwen3_inline_think_multi_turn_supervises_each_turn_as_fully_rendered(qwen3):
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "<think>r1</think>A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "<think>r2</think>A2"},
    ]
    (row,) = mask_conversations(qwen3, [chat])
    assert "r1" not in row.text  # the template drops the earlier reasoning
    assert runs(qwen3, row.input_ids, row.assistant_masks) == ["A1<|im_end|>\n", "<think>\nr2\n</think>\n\nA2<|im_end|>\n"]
    assert row.input_ids == qwen3.apply_chat_template(chat, tokenize=True, return_dict=False)


# A template that rewrites content ("@" -> "at "), so no sentinel skeleton fits its render; the
# second one also renders earlier assistant turns differently (without the "@" at all).
REWRITING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | replace('@', 'at ') }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REWRITING_AND_RERENDERING_TEMPLATE = REWRITING_TEMPLATE.replace(
    "{{ m.content | replace('@', 'at ') }}",
    "{% if loop.last or m.role != 'assistant' %}{{ m.content | replace('@', 'at ') }}"
    "{% else %}{{ m.content | replace('@', '') }}{% endif %}",
)
TWO_REWRITTEN_REPLIES = [
    {"role": "user", "content": "q"},
    {"role": "assistant", "content": "a@b"},
    {"role": "user", "content": "r"},
    {"role": "assistant", "content": "c@d"},
]


def test_content_rewriting_template_is_located_by_prefix_renders():
    tokenizer = byte_tokenizer(REWRITING_TEMPLATE, ["<|im_start|>", "<|im_end|>"])
    (row,) = mask_conversations(tokenizer, [TWO_REWRITTEN_REPLIES])
    assert row.used_prefix_renders
    assert runs(tokenizer, row.input_ids, row.assistant_masks) == ["aat b<|im_end|>\n", "cat d<|im_end|>\n"]


def test_content_rewriting_and_rerendering_template_is_a_detected_prefix_mismatch():
    tokenizer = byte_tokenizer(REWRITING_AND_RERENDERING_TEMPLATE, ["<|im_start|>", "<|im_end|>"])
    (row,) = mask_conversations(tokenizer, [TWO_REWRITTEN_REPLIES])
    assert row.drop_reason == PREFIX_MISMATCH
    assert sum(row.assistant_masks) == 0 and row.input_ids  # dropped, never half-masked


def test_gpt_oss_harmony_thinking_goes_to_the_analysis_channel(gpt_oss):
    (row,) = mask_conversations(gpt_oss, [CHAT], reasoning_effort="high")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>" in row.text
    assert "Reasoning: high" in row.text
    assert runs(gpt_oss, row.input_ids, row.assistant_masks) == [
        "<|channel|>final<|message|>Hello!<|end|>",
        "<|channel|>analysis<|message|>farewell<|end|><|start|>assistant<|channel|>final<|message|>Bye.<|return|>",
    ]
    assert [turn.stop_token for turn in row.turns] == ["<|end|>", "<|return|>"]
    assert row.input_ids == gpt_oss.apply_chat_template(
        CHAT, tokenize=True, return_dict=False, reasoning_effort="high"
    )


def test_content_holding_template_markup_is_still_located_exactly(llama):
    trick = "see <|eot_id|><|start_header_id|>user<|end_header_id|>\n\nno"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": trick}]
    assert supervised_texts(llama, [chat]) == [[trick + "<|eot_id|>"]]


# ---------------------------------------------------------------------------------------------
# Agreement with the reference recipe's prefix method, and where it breaks


def seed_tokenize_sft(tokenizer, messages):
    """shared/seeds/001 ``_tokenize_sft``, line for line (``self.tok`` -> ``tokenizer``)."""
    full_ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    loss_mask = [False] * len(full_ids)
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(
            messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
        for j in range(len(prefix), min(len(through), len(full_ids))):
            loss_mask[j] = True
    return full_ids, loss_mask


def seed_prefix_assumption_holds(tokenizer, messages) -> bool:
    """Every prefix render the seed uses is a token prefix of the full render."""
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            prefix = tokenizer.apply_chat_template(
                messages[:i], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=True, return_dict=False)
            for ids in (prefix, through):
                if full[: len(ids)] != ids:
                    return False
    return True


@pytest.mark.parametrize(
    ("family", "template", "samples", "expect_all_hold"),
    [
        ("llama", None, "ultrachat.jsonl", True),
        ("qwen3_5", CHATML_TEMPLATE, "ultrachat.jsonl", True),
        ("qwen3_5", None, "ultrachat.jsonl", False),  # holds for single-turn rows only
        ("gpt_oss", None, "multilingual_thinking.jsonl", True),
    ],
)
def test_labels_equal_the_seed_method_wherever_its_prefix_assumption_holds(family, template, samples, expect_all_hold):
    tokenizer = build_tokenizer(family)
    if template is not None:
        tokenizer.chat_template = template
    conversations = sample_conversations(samples)[:60]
    columns = tokenize_conversations(tokenizer, conversations)
    compared = 0
    for row, messages in enumerate(conversations):
        if not seed_prefix_assumption_holds(tokenizer, messages):
            continue
        seed_ids, seed_mask = seed_tokenize_sft(tokenizer, messages)
        assert columns["input_ids"][row] == seed_ids
        assert columns["assistant_masks"][row] == [int(bit) for bit in seed_mask], f"row {row}"
        compared += 1
    assert compared == len(conversations) if expect_all_hold else 0 < compared < len(conversations)


def test_seed_method_bleeds_into_the_next_user_turn_where_we_detect_rerendering(qwen3):
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": "A1"},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    seed_ids, seed_mask = seed_tokenize_sft(qwen3, chat)
    # The through-render of turn 1 carries an empty think block the full render does not, so the
    # seed's span runs past <|im_end|> into the user's next turn.
    assert "<|im_start|>user" in runs(qwen3, seed_ids, seed_mask)[0]
    (row,) = mask_conversations(qwen3, [chat])
    assert row.rerendered_turns == 1
    assert runs(qwen3, row.input_ids, row.assistant_masks) == [
        "A1<|im_end|>\n",
        "<think>\n\n</think>\n\nA2<|im_end|>\n",
    ]


def marked(template: str, replacements: list[tuple[str, str]]) -> str:
    for old, new in replacements:
        assert template.count(old) >= 1, old
        template = template.replace(old, new)
    return template


# The real templates with {% generation %} around what the assistant writes, for transformers'
# own return_assistant_tokens_mask: an independent oracle where prefix methods fail.
QWEN3_MARKED = marked(QWEN3_TEMPLATE, [
    ("        {%- if loop.index0 > ns.last_query_index %}\n",
     "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- generation %}\n"
     "        {%- if loop.index0 > ns.last_query_index %}\n"),
    ("'<|im_start|>' + message.role + '\\n<think>\\n'", "'<think>\\n'"),
    ("{{- '<|im_start|>' + message.role + '\\n' + content }}", "{{- content }}"),
    ("        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
     "        {{- '<|im_end|>\\n' }}\n        {%- endgeneration %}\n    {%- elif message.role == \"tool\" %}"),
])
GPT_OSS_MARKED = marked((TEMPLATES / "openai__gpt-oss-120b.jinja").read_text(), [
    ('            {%- if "thinking" in message %}\n'
     '                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}\n'
     '            {%- endif %}\n',
     '            {{- "<|start|>assistant" }}\n            {%- generation %}\n'
     '            {%- if "thinking" in message %}\n'
     '                {{- "<|channel|>analysis<|message|>" + message.thinking + "<|end|><|start|>assistant" }}\n'
     '            {%- endif %}\n'),
    ('{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}',
     '{{- "<|channel|>final<|message|>" + message.content + "<|return|>" }}\n            {%- endgeneration %}'),
    ('{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}',
     '{{- "<|start|>assistant" }}{%- generation %}'
     '{{- "<|channel|>final<|message|>" + message.content + "<|end|>" }}{%- endgeneration %}'),
])


def random_reasoning_chats(
    seed: int, count: int, reasoning_field: str, think_in_content: bool = False, consecutive_replies: bool = False
) -> list[list[dict]]:
    """Random multi-turn chats; reasoning in ``reasoning_field`` or as ``<think>...</think>`` in content,
    and with ``consecutive_replies`` some replies followed by a second assistant message."""
    rng = random.Random(seed)
    pieces = ["Sure.", " two words ", "\n", "\n\n", "é", "x\ny", ""]

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(1, 4)))

    chats = []
    for _ in range(count):
        chat = [{"role": "system", "content": text() or "s"}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            chat.append({"role": "user", "content": text() or "q"})
            for _ in range(2 if consecutive_replies and rng.random() < 0.5 else 1):
                reply = {"role": "assistant", "content": text()}
                if rng.random() < 0.6:
                    if think_in_content:
                        reply["content"] = f"<think>{text()}</think>{reply['content']}"
                    else:
                        reply[reasoning_field] = text()
                chat.append(reply)
        chats.append(chat)
    return chats


def visible_texts(reply: dict, reasoning_field: str, is_last: bool) -> list[str]:
    """The texts of a reply that the Qwen3 / gpt-oss templates render (reasoning only on the last reply)."""
    content = reply["content"]
    reasoning = reply.get(reasoning_field, "")
    if "</think>" in content:
        reasoning, content = content.split("</think>")[0].split("<think>")[-1], content.split("</think>")[-1]
    return [content, reasoning] if is_last else [content]


@pytest.mark.parametrize(
    ("family", "oracle_template", "reasoning_field", "think_in_content", "consecutive_replies"),
    [
        ("qwen3_5", QWEN3_MARKED, "reasoning_content", False, False),
        ("qwen3_5", QWEN3_MARKED, "reasoning_content", True, False),
        ("qwen3_5", QWEN3_MARKED, "reasoning_content", True, True),
        ("gpt_oss", GPT_OSS_MARKED, "thinking", False, False),
        ("gpt_oss", GPT_OSS_MARKED, "thinking", False, True),
    ],
    ids=["qwen3", "qwen3-think-in-content", "qwen3-think-in-content-consecutive", "gpt_oss", "gpt_oss-consecutive"],
)
def test_rerendering_templates_match_a_generation_marked_oracle(
    family, oracle_template, reasoning_field, think_in_content, consecutive_replies
):
    tokenizer = build_tokenizer(family)
    chats = random_reasoning_chats(0, 40, reasoning_field, think_in_content, consecutive_replies)
    masked = mask_conversations(tokenizer, chats)
    assert PREFIX_MISMATCH not in [row.drop_reason for row in masked]
    assert sum(row.rerendered_turns for row in masked) > 0  # the case prefix methods get wrong is covered
    for chat, row in zip(chats, masked):
        (text,), (spans,) = render_jinja_template(
            conversations=[chat], chat_template=oracle_template, return_assistant_tokens_mask=True,
            **tokenizer.special_tokens_map,
        )
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        assert row.input_ids == encoding["input_ids"]  # the marked template renders the same text
        if row.drop_reason:
            replies = [message for message in chat if message["role"] == "assistant"]
            assert row.drop_reason == EMPTY_ASSISTANT_TURNS and not any(
                text.strip()
                for number, reply in enumerate(replies)
                for text in visible_texts(reply, reasoning_field, is_last=number == len(replies) - 1)
            )
        else:
            # The documented token rule: supervised iff the token starts inside a span, so a token
            # that merges the prompt's last newline with the reply's first is never a target.
            expected = [int(any(a <= start < b for a, b in spans)) for start, _ in encoding["offset_mapping"]]
            assert row.assistant_masks == expected, chat


def test_an_empty_reply_supervises_its_stop_token(llama, gpt_oss):
    chat = [
        {"role": "user", "content": "Q1"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "Q2"},
        {"role": "assistant", "content": "A2"},
    ]
    (row,) = mask_conversations(llama, [chat])
    assert runs(llama, row.input_ids, row.assistant_masks) == ["<|eot_id|>", "A2<|eot_id|>"]
    assert row.empty_turns == 1
    # gpt-oss: the empty final message after the analysis one is still the turn's end.
    thinking_only = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "", "thinking": "t"}]
    assert supervised_texts(gpt_oss, [thinking_only]) == [
        ["<|channel|>analysis<|message|>t<|end|><|start|>assistant<|channel|>final<|message|><|return|>"]
    ]


# ---------------------------------------------------------------------------------------------
# Drops, truncation, batching, errors


def test_rows_with_nothing_to_learn_are_dropped_with_a_reason(llama):
    chats = [
        [{"role": "user", "content": "only a question"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}],
        CHAT,
    ]
    columns = tokenize_conversations(llama, chats)
    assert columns["drop_reason"] == [NO_ASSISTANT_TURN, EMPTY_ASSISTANT_TURNS, ""]
    assert [sum(mask) > 0 for mask in columns["assistant_masks"]] == [False, False, True]


def test_truncation_keeps_the_mask_bits_under_the_kept_tokens(llama):
    (full,) = mask_conversations(llama, [CHAT])
    second_turn = full.turns[1]
    cut = second_turn.token_start + 1  # keeps one token of the last turn, loses its stop token
    (row,) = mask_conversations(llama, [CHAT], max_length=cut)
    assert row.input_ids == full.input_ids[:cut]
    assert row.assistant_masks == full.assistant_masks[:cut]
    assert [turn.ends_with_stop_token for turn in row.turns] == [True, False]

    (gone,) = mask_conversations(llama, [CHAT], max_length=full.turns[0].token_start)
    assert gone.drop_reason == TRUNCATED_AWAY and sum(gone.assistant_masks) == 0


def test_batched_map_keeps_rows_aligned_and_the_chat_format_drops_and_counts(llama):
    raw = Dataset.from_list([{"messages": CHAT}, {"messages": [{"role": "user", "content": "?"}]}] * 3)
    mapped = raw.map(lambda batch: tokenize_conversations(llama, batch["messages"]), batched=True, batch_size=4)
    assert mapped["drop_reason"] == ["", NO_ASSISTANT_TURN] * 3

    report = DataReport("chat", rows=len(raw))
    dataset = FORMATS["messages"].prepare(raw, llama, Tokenization(max_length=None), report)
    assert report.dropped == {NO_ASSISTANT_TURN: 3}
    assert dataset.column_names == ["input_ids", "assistant_masks"] and len(dataset) == 3


def test_unreadable_tool_calls_are_refused_not_mismasked(llama):
    chat = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": '[{"function": {"name": "w", "arguments": "{oops"}}]'},
    ]
    with pytest.raises(ValueError, match="the arguments of w are not JSON; read tool rows with dataset_format: messages"):
        tokenize_conversations(llama, [chat])


def test_missing_chat_template_is_an_error():
    tokenizer = byte_tokenizer(None, ["<|eot|>"])
    with pytest.raises(ValueError, match="no chat_template"):
        tokenize_conversations(tokenizer, [CHAT])


def test_template_without_a_special_stop_token_is_an_error():
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ValueError, match="holds no special token"):
        tokenize_conversations(byte_tokenizer(template, ["<|x|>"]), [CHAT])


# ---------------------------------------------------------------------------------------------
# TRL 1.16 takes the columns as they are


def test_trl_builds_labels_from_assistant_masks_without_retokenizing(llama):
    conversations = sample_conversations("ultrachat.jsonl")[:4]
    rows = Dataset.from_list([{"messages": c} for c in conversations])
    dataset = FORMATS["messages"].prepare(rows, llama, Tokenization(max_length=None), DataReport("chat"))
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", max_length=None)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=llama)
        for prepared, row in zip(trainer.train_dataset, dataset):
            assert prepared["input_ids"] == row["input_ids"]
            expected = [token if bit else -100 for token, bit in zip(row["input_ids"], row["assistant_masks"])]
            assert prepared["labels"] == expected

        # assistant_only_loss is for raw conversations (it swaps in a {% generation %} template);
        # TRL refuses it for pre-tokenized rows, so recipes must leave it off.
        refused = SFTConfig(output_dir=out, use_cpu=True, bf16=False, report_to="none", assistant_only_loss=True)
        with pytest.raises(ValueError, match="not conversational"):
            SFTTrainer(model=model, args=refused, train_dataset=dataset, processing_class=llama)

"""Block-diagonal packing: literal token lists in, exact tensors out."""

import pytest
import torch
from datasets import Dataset
from trl import pack_dataset
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from sft_recipes.data.collator import BlockDiagonalCollator, pack_kwargs

I32 = torch.int32


def assert_batch_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        if torch.is_tensor(value):
            assert actual[key].dtype == value.dtype, key
            assert torch.equal(actual[key], value), (key, actual[key])
        else:
            assert actual[key] == value, key


def test_pack_kwargs_resets_positions_and_numbers_examples():
    assert_batch_equal(
        pack_kwargs([3, 2, 1]),
        {
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0]]),
            "seq_idx": torch.tensor([[0, 0, 0, 1, 1, 2]], dtype=I32),
            "cu_seq_lens_q": torch.tensor([0, 3, 5, 6], dtype=I32),
            "cu_seq_lens_k": torch.tensor([0, 3, 5, 6], dtype=I32),
            "max_length_q": 3,
            "max_length_k": 3,
        },
    )


def test_pack_kwargs_masks_the_first_token_of_every_example():
    labels = torch.tensor([11, 12, 13, 14, 15])
    packed = pack_kwargs([2, 3], labels=labels)
    assert torch.equal(packed["labels"], torch.tensor([[-100, 12, -100, 14, 15]]))
    assert torch.equal(labels, torch.tensor([11, 12, 13, 14, 15])), "the caller's labels must not change"


@pytest.mark.parametrize("seq_lens", [[], [3, 0, 2], [-1]])
def test_pack_kwargs_rejects_empty_examples(seq_lens):
    with pytest.raises(ValueError, match="positive lengths"):
        pack_kwargs(seq_lens)


def test_pack_kwargs_rejects_labels_of_another_length():
    with pytest.raises(ValueError, match="labels have 4 tokens but seq_lens add up to 5"):
        pack_kwargs([2, 3], labels=torch.tensor([1, 2, 3, 4]))


EXAMPLES = [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}, {"input_ids": [6, 7, 8, 9]}]


def test_split_examples_fill_every_block_and_pad_the_last():
    batch = BlockDiagonalCollator(max_length=4, pad_token_id=0)(EXAMPLES)
    assert_batch_equal(
        batch,
        {
            "input_ids": torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8], [9, 0, 0, 0]]),
            "labels": torch.tensor([[-100, 2, 3, -100], [-100, -100, 7, 8], [-100, -100, -100, -100]]),
            "position_ids": torch.tensor([[0, 1, 2, 0], [0, 0, 1, 2], [0, 0, 1, 2]]),
            "seq_idx": torch.tensor([[0, 0, 0, 1], [2, 3, 3, 3], [4, 5, 5, 5]], dtype=I32),
            # Offsets into the flattened [3 * 4] batch, as flash-attention varlen reads them.
            "cu_seq_lens_q": torch.tensor([0, 3, 4, 5, 8, 9, 12], dtype=I32),
            "cu_seq_lens_k": torch.tensor([0, 3, 4, 5, 8, 9, 12], dtype=I32),
            "max_length_q": 3,
            "max_length_k": 3,
        },
    )


def test_whole_examples_start_a_new_block_when_they_do_not_fit():
    batch = BlockDiagonalCollator(max_length=4, pad_token_id=0, split_examples=False)(EXAMPLES)
    assert_batch_equal(
        batch,
        {
            "input_ids": torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]]),
            "labels": torch.tensor([[-100, 2, 3, -100], [-100, 5, -100, -100], [-100, 7, 8, 9]]),
            "position_ids": torch.tensor([[0, 1, 2, 0], [0, 1, 0, 1], [0, 1, 2, 3]]),
            "seq_idx": torch.tensor([[0, 0, 0, 1], [2, 2, 3, 3], [4, 4, 4, 4]], dtype=I32),
            "cu_seq_lens_q": torch.tensor([0, 3, 4, 6, 8, 12], dtype=I32),
            "cu_seq_lens_k": torch.tensor([0, 3, 4, 6, 8, 12], dtype=I32),
            "max_length_q": 4,
            "max_length_k": 4,
        },
    )


def test_whole_examples_keep_the_first_max_length_tokens_of_a_long_example():
    batch = BlockDiagonalCollator(max_length=3, pad_token_id=0, split_examples=False)(
        [{"input_ids": [1, 2, 3, 4, 5]}, {"input_ids": [6]}]
    )
    assert batch["input_ids"].tolist() == [[1, 2, 3], [6, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 2, 3], [-100, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 1]]


def test_labels_from_trl_dataset_preparation_are_kept():
    examples = [{"input_ids": [1, 2, 3, 4], "labels": [-100, -100, 3, 4]}, {"input_ids": [5, 6], "labels": [5, 6]}]
    batch = BlockDiagonalCollator(max_length=6, pad_token_id=0)(examples)
    assert batch["labels"].tolist() == [[-100, -100, 3, 4, -100, 6]]


def test_only_tokens_inside_every_supervision_mask_get_labels():
    examples = [
        {"input_ids": [1, 2, 3, 4], "assistant_masks": [0, 1, 1, 1], "completion_mask": [1, 1, 1, 0]},
        {"input_ids": [5, 6, 7], "assistant_masks": [0, 0, 1]},
    ]
    batch = BlockDiagonalCollator(max_length=7, pad_token_id=0)(examples)
    assert batch["labels"].tolist() == [[-100, 2, 3, -100, -100, -100, 7]]


def test_one_full_row_is_exactly_trl_padding_free_output():
    examples = [{"input_ids": [1, 2, 3], "labels": [-100, 2, 3]}, {"input_ids": [4, 5]}]
    trl_batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)(examples)
    assert_batch_equal(BlockDiagonalCollator(max_length=5, pad_token_id=0)(examples), trl_batch)


def test_rows_packed_by_trl_bfd_keep_their_segments_and_are_padded_to_max_length():
    dataset = Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]})
    rows = list(pack_dataset(dataset, seq_length=4, strategy="bfd"))
    assert [row["seq_lengths"] for row in rows] == [[4], [3, 1], [2]]

    batch = BlockDiagonalCollator(max_length=4, pad_token_id=0, split_examples=False)(rows)
    assert batch["input_ids"].tolist() == [[7, 8, 9, 10], [1, 2, 3, 6], [4, 5, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 0, 1]]
    assert batch["labels"].tolist() == [[-100, 8, 9, 10], [-100, 2, 3, -100], [-100, 5, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 4, 7, 8, 10, 12]


def test_prepacked_row_longer_than_max_length_is_refused():
    row = {"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 2]}
    with pytest.raises(ValueError, match=r"pack it with trl.pack_dataset\(\.\.\., seq_length=4\)"):
        BlockDiagonalCollator(max_length=4, pad_token_id=0, split_examples=False)([row])


def test_seq_lengths_must_cover_input_ids():
    with pytest.raises(ValueError, match="must be positive and add up to the 5 tokens"):
        BlockDiagonalCollator(max_length=8, pad_token_id=0)([{"input_ids": [1, 2, 3, 4, 5], "seq_lengths": [3, 3]}])


def test_mask_of_another_length_is_refused():
    with pytest.raises(ValueError, match="assistant_masks has 2 entries but input_ids has 3 tokens"):
        BlockDiagonalCollator(max_length=4, pad_token_id=0)([{"input_ids": [1, 2, 3], "assistant_masks": [0, 1]}])
    with pytest.raises(ValueError, match="labels has 4 entries but input_ids has 3 tokens"):
        BlockDiagonalCollator(max_length=4, pad_token_id=0)([{"input_ids": [1, 2, 3], "labels": [1, 2, 3, 4]}])


def test_empty_examples_are_skipped_and_an_empty_batch_is_refused():
    batch = BlockDiagonalCollator(max_length=2, pad_token_id=0)([{"input_ids": []}, {"input_ids": [1, 2]}])
    assert batch["input_ids"].tolist() == [[1, 2]]
    with pytest.raises(ValueError, match="no tokens"):
        BlockDiagonalCollator(max_length=2, pad_token_id=0)([{"input_ids": []}])

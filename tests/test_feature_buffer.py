import pytest
import torch

from tlt.drafter.buffer import BufferError, FeatureBuffer, pack_pairs
from tlt.rl.actor import PackedSamples


def entry(length, step, hidden=4, offset=0):
    tokens = torch.arange(offset, offset + length)
    features = torch.arange(offset, offset + length, dtype=torch.float32)[:, None].repeat(1, hidden)
    return tokens, features, step


def test_budget_evicts_oldest_first():
    buffer = FeatureBuffer(max_tokens=25)
    for step in range(4):
        buffer.add(*entry(10, step))
    assert buffer.tokens <= 25 and buffer.steps() == [2, 3]


def test_persists_across_steps_and_samples_recent_more():
    buffer = FeatureBuffer(max_tokens=10_000, recency=0.5, seed=1)
    for step in range(3):
        for _ in range(10):
            buffer.add(*entry(5, step))
    drawn = [e.step for e in buffer.sample(3000)]
    assert buffer.steps() == [0, 1, 2]
    assert drawn.count(2) > drawn.count(1) > drawn.count(0) > 0
    # weights 1 : 0.5 : 0.25 → shares 4/7, 2/7, 1/7
    assert abs(drawn.count(2) / 3000 - 4 / 7) < 0.04


def test_pairs_are_aligned_x_next_with_f_t_to_f_next():
    buffer = FeatureBuffer(max_tokens=100)
    buffer.add(*entry(6, 0, offset=10))
    packed = pack_pairs(list(buffer.entries), row_length=8)
    valid = packed.valid[0]
    assert valid.sum() == 5
    assert packed.input_tokens[0, valid].tolist() == [11, 12, 13, 14, 15]        # x_{t+1}
    assert packed.input_features[0, valid, 0].tolist() == [10, 11, 12, 13, 14]  # f_t
    assert packed.target_features[0, valid, 0].tolist() == [11, 12, 13, 14, 15]  # f_{t+1}


def test_left_padded_and_right_padded_actor_rows_give_the_same_pairs():
    """Whatever the padding side of the pass that produced the features, only real positions are stored."""
    prompt, response = [7, 8, 9], [20, 21, 22, 23]
    hidden = torch.arange(20, dtype=torch.float32)[:, None].repeat(1, 2)
    right = PackedSamples.build([prompt, [5]], [response, [6]], pad_id=0)
    buffer = FeatureBuffer(max_tokens=100)
    length = len(prompt) + len(response)
    buffer.add_samples(right.input_ids, hidden[None, :right.input_ids.shape[1]].repeat(2, 1, 1),
                       starts=[len(prompt) - 1], ends=[length], step=0)
    left_ids = torch.tensor([[0, 0] + prompt + response])
    left_hidden = torch.cat([torch.full((2, 2), -1.0), hidden[:length]])[None]
    buffer.add_samples(left_ids, left_hidden, starts=[2 + len(prompt) - 1], ends=[2 + length], step=0)
    first, second = buffer.entries
    assert first.tokens.tolist() == second.tokens.tolist() == [9, 20, 21, 22, 23]
    assert torch.equal(first.features, second.features)


def test_packing_keeps_documents_apart():
    buffer = FeatureBuffer(max_tokens=100)
    buffer.add(*entry(4, 0))            # 3 pairs
    buffer.add(*entry(5, 0, offset=50))  # 4 pairs
    packed = pack_pairs(list(buffer.entries), row_length=8)
    assert packed.input_tokens.shape[0] == 1 and packed.valid.sum() == 7
    mask = packed.attention_mask[0]
    assert not mask[5, 1] and not mask[1, 5]   # across documents
    assert mask[2, 0] and not mask[0, 2]       # causal within a document
    assert packed.positions[0, :7].tolist() == [0, 1, 2, 3, 0, 1, 2]


def test_long_entries_split_and_bad_shapes_error():
    buffer = FeatureBuffer(max_tokens=100)
    buffer.add(*entry(20, 0))
    packed = pack_pairs(list(buffer.entries), row_length=8)
    assert packed.valid.sum() == 19 and packed.input_tokens.shape[0] == 3
    with pytest.raises(BufferError, match="hidden size"):
        buffer.add(torch.arange(3), torch.zeros(3, 7), 0)
    with pytest.raises(BufferError, match="exceeds the buffer budget"):
        FeatureBuffer(max_tokens=5).add(*entry(6, 0))
    with pytest.raises(BufferError, match="empty"):
        FeatureBuffer(max_tokens=5).sample(1)


def test_entries_are_copies_not_views_of_the_callers_tensors():
    """An entry kept a view of its row of a micro-batch's [B, L, H] hidden states: 48 buffered tokens pinned the
    whole tensor (the token budget bounded nothing), and a later in-place write changed stored features (found
    by review)."""
    buffer = FeatureBuffer(1_000)
    hidden, tokens = torch.randn(8, 100, 16), torch.randint(0, 50, (8, 100))
    buffer.add_samples(tokens, hidden, [3, 10], [19, 42], step=0)
    stored = [entry.features.clone() for entry in buffer.entries]
    hidden.zero_()
    tokens.zero_()
    assert all(torch.equal(entry.features, kept) for entry, kept in zip(buffer.entries, stored))
    assert all(entry.tokens.abs().sum() > 0 for entry in buffer.entries)
    pinned = sum(entry.features.untyped_storage().nbytes() for entry in buffer.entries)
    assert pinned == (16 + 32) * 16 * 4  # the stored tokens' features, nothing more

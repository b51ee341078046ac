"""Unrolled drafter training (drafter/unroll.py): each level computes what the serving drafter computes at that
depth of a chain, documents stay apart in packed rows, and the loss is teacher forcing's at one level."""

import pytest
import torch

from conftest import random_prompts, tiny_model
from tlt.drafter import unroll
from tlt.drafter.buffer import FeatureBuffer, FeatureEntry, pack_pairs
from tlt.drafter.chain import _draft_pass, _layout
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
from tlt.models import LeanForward
from tlt.models.eagle import EagleDrafter

LEVELS = 3


def target_and_drafter(arch: str):
    model = tiny_model(arch, seed=4)
    lean = LeanForward(model)
    torch.manual_seed(5)
    drafter = EagleDrafter(model.config).attach(lean)
    with torch.no_grad():  # a random drafter whose output differs visibly with its input
        for param in drafter.parameters():
            param.normal_(0, 0.2)
    return model, drafter.eval()


def entries(model, lengths):
    out = []
    for sequence in random_prompts(lengths, seed=6):
        ids = torch.tensor([sequence])
        with torch.no_grad():
            features = model.model(ids).last_hidden_state[0]
        out.append(FeatureEntry(ids[0], features, step=0))
    return out


def serving_chains(drafter, entry, levels):
    """{level: [chains, H]}: the serving drafter's output at each depth of the chain that starts at every pair c
    (catch-up over pairs 0 .. c on the target's features, then depth l fed the depth l - 1 output and the true
    token): what level l computes at pair c + l - 1."""
    tokens, features = entry.tokens[1:], entry.features[:-1]
    pairs = tokens.shape[0]
    starts = torch.arange(pairs - levels + 1)
    hidden = _draft_pass(drafter, tokens, features, *_layout(pairs, starts, 0))[starts]
    out = {1: hidden}
    chain_tokens, chain_features = [], []
    for level in range(1, levels):
        chain_tokens.append(tokens[starts + level])
        chain_features.append(hidden)
        drafted = _draft_pass(drafter, torch.cat([tokens, *chain_tokens]), torch.cat([features, *chain_features]),
                              *_layout(pairs, starts, level))
        hidden = drafted[-starts.shape[0]:]
        out[level + 1] = hidden
    return out


def document_offsets(batch) -> list[int]:
    """Each packed document's first index in row 0 (positions restart at 0 with each)."""
    starts = (batch.positions[0] == 0) & batch.valid[0]
    return starts.nonzero()[:, 0].tolist()


def unrolled(drafter, batch) -> dict:
    with torch.no_grad():
        return dict(unroll.unrolled_levels(drafter, batch, batch.input_features, LEVELS))


def mismatch(levels: dict, batch, docs: list, drafter) -> float:
    """The largest gap between each level's output in the packed row and the serving chains', relative to the
    level's largest value (a random drafter fed its own output grows it level by level)."""
    by_length = sorted(docs, key=lambda e: e.num_pairs, reverse=True)  # pack_pairs puts the longest first
    worst = 0.0
    for offset, entry in zip(document_offsets(batch), by_length):
        reference = serving_chains(drafter, entry, LEVELS)
        for level, expected in reference.items():
            chains = expected.shape[0]
            got = levels[level][0, offset + level - 1:offset + level - 1 + chains]
            worst = max(worst, float((got - expected).abs().max() / expected.abs().max()))
    return worst


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_each_level_computes_what_the_serving_chain_computes_at_that_depth(arch):
    model, drafter = target_and_drafter(arch)
    docs = entries(model, [9, 13])
    batch = pack_pairs(docs, 32)  # both documents in one row, padding after them
    assert batch.valid.shape[0] == 1 and len(document_offsets(batch)) == 2
    assert mismatch(unrolled(drafter, batch), batch, docs, drafter) < 2e-5


def test_a_level_that_sees_the_target_features_of_its_own_pair_is_caught(monkeypatch):
    """Negative control: deeper levels allowed the level-1 key of their own pair (the target's true feature of
    the position they draft from, which a serving drafter does not have yet) no longer match serving."""
    model, drafter = target_and_drafter("llama")
    docs = entries(model, [9, 13])
    batch = pack_pairs(docs, 32)

    def leaky_mask(attention, levels):
        mask = unroll_level_mask(attention, levels)
        length = attention.shape[1]
        for level in range(2, levels + 1):
            mask[:, (level - 1) * length:level * length, :length] |= attention
        return mask
    unroll_level_mask = unroll.level_mask
    monkeypatch.setattr(unroll, "level_mask", leaky_mask)
    assert mismatch(unrolled(drafter, batch), batch, docs, drafter) > 1e-2


def test_a_chain_is_scored_only_inside_its_document():
    model, _ = target_and_drafter("llama")
    docs = entries(model, [5, 8, 3])
    batch = pack_pairs(docs, 12)
    for level in (1, 2, 3):
        scored = unroll.level_valid(batch.attention_mask, batch.valid, level)
        assert int(scored.sum()) == sum(max(0, e.num_pairs - level + 1) for e in docs)
        # a scored pair's chain starts in its own document: level - 1 pairs back, at the same row
        assert (batch.positions[scored] >= level - 1).all()


def test_one_level_is_teacher_forcing_and_the_levels_average():
    model, drafter = target_and_drafter("llama")
    buffer = FeatureBuffer(10_000)
    for entry in entries(model, [9, 13, 7]):
        buffer.add(entry.tokens, entry.features, entry.step)
    batch = pack_pairs(list(buffer.entries), 16)
    weights = batch.valid.float() / batch.valid.sum()

    def loss(**settings):
        trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(**settings))
        return trainer.loss(batch, weights, noise=False)
    one, parts = loss(unroll=1)
    only_first, _ = loss(unroll=3, unroll_decay=0.0)  # deeper levels weigh 0: the same loss
    assert only_first.item() == pytest.approx(one.item(), rel=1e-6)
    three, deep_parts = loss(unroll=3)
    assert three.item() != pytest.approx(one.item(), rel=1e-3)
    assert float(deep_parts["accept_q"]) == pytest.approx(float(parts["accept_q"]), rel=1e-6)  # level 1's
    assert "accept_q_deepest" in deep_parts and "accept_q_deepest" not in parts


def test_unrolled_training_lowers_the_deepest_levels_loss():
    """A few optimizer steps with three levels: the trainer runs (backward through the fed-back features) and
    its deepest level's acceptance is reported as a mean."""
    model, drafter = target_and_drafter("llama")
    buffer = FeatureBuffer(10_000)
    for entry in entries(model, [12, 15, 9, 11]):
        buffer.add(entry.tokens, entry.features, entry.step)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(unroll=3, entries_per_step=4, row_length=32,
                                                                 lr=5e-3))
    before = trainer.evaluate(list(buffer.entries))
    history = trainer.train_steps(12)
    after = trainer.evaluate(list(buffer.entries))
    assert 0.0 <= history[-1]["accept_q_deepest"] <= 1.0
    assert after["loss"] < before["loss"]
    assert after["accept_q_deepest"] > before["accept_q_deepest"]

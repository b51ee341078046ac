"""BatchRows: each sample consumes exactly its own stream of uniforms, in order, whatever batches it ran in."""

import random

import pytest
import torch

from tlt.rollout.batch_rows import BatchRows
from tlt.rollout.graph_runner import _Buffers, GraphRunner
from tlt.rollout.request import Request
from tlt.rollout.sequence import Sequence
from tlt.sampling import RowSampling, SamplingParams


def sequence(index: int, temperature: float = 1.0) -> Sequence:
    request = Request([5, 6], params=SamplingParams(temperature=temperature, max_new_tokens=8))
    return Sequence(index, 0, request, frozenset(), torch.Generator().manual_seed(1000 + index))


def stream(index: int, count: int) -> torch.Tensor:
    return torch.rand(count, generator=torch.Generator().manual_seed(1000 + index))


@pytest.mark.parametrize("seed", range(3))
def test_the_cpu_generator_fills_a_tensor_serially(seed):
    """What BatchRows relies on: a stream drawn in chunks of any size is the stream drawn at once."""
    chunks = random.Random(seed).choices([1, 3, 16, 17, 255, 256, 1000, 5000], k=12)
    generator = torch.Generator().manual_seed(seed)
    chunked = torch.cat([torch.rand(n, generator=generator) for n in chunks])
    assert torch.equal(chunked, torch.rand(sum(chunks), generator=torch.Generator().manual_seed(seed)))


def churn(bank: BatchRows, seed: int, steps: int = 300):
    """Rows retired, moved, admitted, a prefill's new rows alone, counts from 1 to past the block: returns what
    each sequence consumed, in order."""
    rng = random.Random(seed)
    seqs = [sequence(i) for i in range(40)]
    running, waiting = seqs[:6], seqs[6:]
    consumed = {id(s): [] for s in seqs}
    for _ in range(steps):
        event = rng.random()
        if event < 0.1 and len(running) > 1:       # a row retires: the last row moves into its hole
            hole = rng.randrange(len(running))
            running[hole] = running[-1]
            running.pop()
        elif event < 0.2 and waiting:              # admission: the new rows' first token, then they run
            new = [waiting.pop(0) for _ in range(min(rng.randint(1, 3), len(waiting)))]
            draw = bank.uniforms_apart if rng.random() < 0.7 else bank.uniforms  # as a prefill does, or not
            for seq, row in zip(new, draw(new, 1)):
                consumed[id(seq)].append(row)
            running += new
        elif event < 0.25:                          # another order of the same rows
            rng.shuffle(running)
        count = rng.choice([1, 1, 1, 7, 29, 300])
        for seq, row in zip(running, bank.uniforms(running, count)):
            consumed[id(seq)].append(row.clone())
    return seqs, consumed


@pytest.mark.parametrize("seed", range(4))
def test_every_sample_consumes_its_own_stream_in_order(seed):
    seqs, consumed = churn(BatchRows(block=64), seed)
    used = 0
    for seq in seqs:
        if consumed[id(seq)]:
            got = torch.cat(consumed[id(seq)])
            assert torch.equal(got, stream(seq.request_index, got.shape[0])), f"sequence {seq.request_index}"
            used += 1
    assert used > 10


class Forgetful(BatchRows):
    """A bank that drops a row's unused uniforms instead of giving them back."""

    def _keep_subset(self, seqs):
        return False

    def _release_uniforms(self):
        self._uniforms, self._offset = None, 0


def test_the_stream_check_fails_when_unused_uniforms_are_dropped():
    """Negative control: the check above sees a bank that skips part of a stream."""
    seqs, consumed = churn(Forgetful(block=64), 0)
    mismatched = [seq for seq in seqs if consumed[id(seq)] and not torch.equal(
        torch.cat(consumed[id(seq)]), stream(seq.request_index, int(sum(t.shape[0] for t in consumed[id(seq)]))))]
    assert mismatched


def test_settings_are_one_object_while_the_rows_stay():
    bank = BatchRows()
    rows = [sequence(0, 0.7), sequence(1, 0.0), sequence(2, 1.3)]
    first = bank.settings(rows)
    assert bank.settings(list(rows)) is first
    expected = RowSampling.from_params([s.request.params for s in rows], "cpu")
    for name in ("temperature", "top_k", "top_p", "greedy"):
        assert torch.equal(getattr(first, name), getattr(expected, name))
    moved = bank.settings([rows[2], rows[0]])  # the last row moved into a retired one's hole
    assert moved is not first and moved.temperature.tolist() == pytest.approx([1.3, 0.7])
    assert moved.greedy.tolist() == [False, False] and moved.all_greedy is False


def test_fill_copies_settings_again_only_when_they_change():
    """The graph runner skips a settings input filled from the same host tensor before; another object (other
    rows, same batch size) is copied, and a batch-size change rewrites the padding."""
    buffers = _Buffers({"temperature": torch.zeros(4), "lengths": torch.zeros(4, dtype=torch.long)})
    first, lengths = torch.tensor([0.5, 0.7]), torch.tensor([3, 4])
    GraphRunner._fill(buffers, {"temperature": first, "lengths": lengths}, 2)
    assert buffers.inputs["temperature"].tolist() == pytest.approx([0.5, 0.7, 0.5, 0.5])
    buffers.inputs["temperature"][0] = 9.0   # stands for a value the skipped copy would have rewritten
    lengths += 1                             # host lengths are written in place: always copied
    GraphRunner._fill(buffers, {"temperature": first, "lengths": lengths}, 2)
    assert buffers.inputs["temperature"][0] == 9.0 and buffers.inputs["lengths"][:2].tolist() == [4, 5]
    GraphRunner._fill(buffers, {"temperature": torch.tensor([1.1, 1.2]), "lengths": lengths}, 2)
    assert buffers.inputs["temperature"][:2].tolist() == pytest.approx([1.1, 1.2])
    GraphRunner._fill(buffers, {"temperature": torch.tensor([0.9]), "lengths": lengths[:1]}, 1)
    assert buffers.inputs["temperature"].tolist() == pytest.approx([0.9, 0.5, 0.5, 0.5])


class PerStepRows(BatchRows):
    """The engine's inputs before BatchRows: new settings and one generator call per row at every step."""

    def settings(self, seqs):
        return RowSampling.from_params([s.request.params for s in seqs], "cpu")

    def uniforms(self, seqs, count):
        return torch.stack([torch.rand(count, generator=seq.generator) for seq in seqs])


@pytest.mark.parametrize("graphs,bank", [(False, BatchRows), (True, BatchRows), (False, Forgetful)],
                         ids=["eager", "graph-bodies", "control-dropped-uniforms"])
def test_a_rollout_samples_what_one_draw_per_step_samples(graphs, bank):
    """Rows admitted mid-rollout and retired at different steps, mixed settings, plain and speculative steps
    (of different uniform counts) alternating: every sample equals the one drawn with per-step draws. Negative
    control: a bank that drops unused uniforms samples other tokens."""
    from conftest import random_prompts, tiny_model
    from tlt.models.eagle import EagleDrafter
    from tlt.rollout.engine import RolloutEngine
    from tlt.speculative.strategy import SpecStrategy
    from test_speculative_graphs import Alternating

    model = tiny_model()
    settings = [SamplingParams(temperature=1.0, max_new_tokens=17, seed=1),
                SamplingParams(temperature=0.0, max_new_tokens=9),
                SamplingParams(temperature=0.8, top_p=0.8, max_new_tokens=23, seed=2),
                SamplingParams(temperature=1.3, top_k=5, max_new_tokens=14, seed=3)]
    prompts = random_prompts([4, 7, 2, 9, 5], seed=3)
    requests = [Request(p, n=2, params=settings[i % len(settings)]) for i, p in enumerate(prompts)]
    drafter = EagleDrafter(model.config)  # one drafter: which tokens a sample draws depends on its drafts
    outputs = []
    for rows in (PerStepRows(), bank(block=64)):  # several speculative steps from one block
        policy = Alternating([SpecStrategy(3, 2, 6), "off", SpecStrategy.chain(4, "q")], gate=8)
        engine = RolloutEngine(model, max_batch_size=3, drafter=drafter, speculation=policy,
                               max_tree_size=16)
        if graphs:
            engine.runner = GraphRunner(engine.forward, capture=False)
        engine.model_runner.batch_rows = rows
        outputs.append(engine.generate(requests))
    per_step, blocks = outputs
    same = [s.token_ids for s in blocks.samples] == [s.token_ids for s in per_step.samples]
    assert same == (bank is BatchRows)
    if same:
        assert [s.logprobs for s in blocks.samples] == [s.logprobs for s in per_step.samples]
    assert sum(s.kind == "prefill" for s in blocks.steps) > 1  # rows admitted mid-rollout
    assert {s.mode for s in blocks.steps if s.kind == "decode"} == {"plain", "sd"}


def test_an_admission_leaves_the_running_rows_blocks_in_place():
    """A prefill draws for its new rows apart; at the next step the running rows keep their blocks (nothing goes
    back to their sequences) and the new row draws as many: the docs' "one gather" for rows that join."""
    bank = BatchRows(block=64)
    running = [sequence(0), sequence(1)]
    first = bank.uniforms(running, 1)
    new = sequence(2)
    assert torch.equal(bank.uniforms_apart([new], 1)[0], stream(2, 1))
    step = bank.uniforms(running + [new], 1)
    assert all(seq.spare_uniforms is None for seq in running)
    assert torch.equal(torch.stack([first[:, 0], step[:2, 0]], 1), torch.stack([stream(0, 2), stream(1, 2)]))
    assert step[2, 0] == stream(2, 2)[1]

"""Scheduler: admission (free rows, prefill token budget), dense rows after retiring, features before reuse.

No model: the scheduler never runs a forward, so its rows' state is a stand-in that records what it is asked.
"""

from tlt.rollout.request import Request
from tlt.rollout.scheduler import PREFILL_TOKEN_BUDGET, Scheduler
from tlt.sampling import SamplingParams


class Rows:
    """The model runner's side of retiring, recording what it is asked."""

    def __init__(self):
        self.log = []

    def move_row(self, src, dst):
        self.log.append(("move", src, dst))

    def committed_features(self, row, start, end):
        self.log.append(("features", row, start, end))
        return row, (start, end)


def finish(seq, tokens):
    for token in tokens:
        seq.append(token, 0.0)


def test_admission_fills_free_rows_and_splits_a_prompts_samples():
    requests = [Request([5, 6], n=3), Request([7], n=4)]
    scheduler = Scheduler(requests, max_batch_size=5, eos_token_ids=(3,))
    groups = scheduler.admit()
    assert [[(s.request_index, s.sample_index) for s in g] for g in groups] == [[(0, 0), (0, 1), (0, 2)],
                                                                               [(1, 0), (1, 1)]]
    scheduler.start([s for g in groups for s in g])
    assert (scheduler.running_rows, scheduler.waiting_samples) == (5, 2)
    assert scheduler.admit() == []  # no free row
    assert scheduler.max_rows == 5 and scheduler.max_len == 2 + SamplingParams().max_new_tokens


def test_one_prefill_stays_within_the_token_budget():
    long = PREFILL_TOKEN_BUDGET // 3 + 1  # padded to the longest prompt, three rows exceed the budget
    requests = [Request([5]), Request([6]), Request([7] * long)]
    scheduler = Scheduler(requests, max_batch_size=8, eos_token_ids=(3,))
    assert [g[0].request_index for g in scheduler.admit()] == [0, 1]
    assert [g[0].request_index for g in scheduler.admit()] == [2]  # the next prefill
    assert scheduler.waiting_samples == 0


def test_retiring_keeps_the_running_rows_dense_and_hands_features_first():
    params = SamplingParams(max_new_tokens=3)
    requests = [Request([5, 6, 7], n=5, params=params)]
    scheduler = Scheduler(requests, max_batch_size=5, eos_token_ids=(3,))
    scheduler.start(scheduler.admit()[0])
    running = list(scheduler.running)
    finish(running[1], [9, 3])      # stop token
    finish(running[4], [9, 9, 9])   # length
    rows, handed = Rows(), []
    assert scheduler.retire(rows, lambda tokens, features: handed.append((tokens, features))) == 2
    # features of both finished rows come before any move: the slots past the prompt's last token
    assert rows.log == [("features", 1, 2, 4), ("features", 4, 2, 5), ("move", 3, 1)]
    assert handed == [(1, (2, 4)), (4, (2, 5))]
    assert scheduler.running == [running[0], running[3], running[2]]  # row 3 filled the hole at row 1
    assert {s.finish_reason for s in scheduler.finished} == {"stop", "length"}
    for seq in scheduler.running:
        finish(seq, [9, 9, 9])
    scheduler.retire(rows)
    assert scheduler.done
    assert [o.sample_index for o in scheduler.outputs()] == [0, 1, 2, 3, 4]

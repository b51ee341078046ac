"""The lean forward must match the transformers forward (fp32, 1e-4) and share the module's parameters."""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from conftest import random_prompts, tiny_model

from tlt.models import KVCache, LeanForward
from tlt.models.onednn_linear import PackedOneDNNLinear, padded_rows, pick_linear

TOL = 1e-4


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("lengths", [[7], [5, 9, 2], [3, 11, 6, 1, 8]])
def test_prefill_and_decode_match_transformers(arch, lengths):
    model = tiny_model(arch)
    forward = LeanForward(model)
    prompts = random_prompts(lengths)
    batch, width = len(lengths), max(lengths)
    cache = KVCache(forward.spec, batch, 64)
    rows = cache.rows(0, batch)
    ids = torch.zeros(batch, width, dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, :len(prompt)] = torch.tensor(prompt)
    out = forward(ids, rows, logits_at="all")
    for b, prompt in enumerate(prompts):
        assert (out.logits[b, :len(prompt)] - reference_logits(model, prompt)).abs().max() < TOL
    rows.advance(torch.tensor(lengths))
    continuations = random_prompts([12] * batch, seed=1)
    for step in range(12):
        out = forward(torch.tensor([[c[step]] for c in continuations]), rows)
        rows.advance(1)
        for b in range(batch):
            sequence = prompts[b] + continuations[b][:step + 1]
            assert (out.logits[b, 0] - reference_logits(model, sequence)[-1]).abs().max() < TOL


def test_hidden_states_are_final_normed_states(arch):
    model = tiny_model(arch)
    forward = LeanForward(model)
    prompt = random_prompts([9])[0]
    rows = KVCache(forward.spec, 1, 16).rows(0, 1)
    out = forward(torch.tensor([prompt]), rows, logits_at=None)
    with torch.no_grad():
        expected = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0]
    assert out.logits is None
    assert (out.hidden[0] - expected).abs().max() < TOL


def test_multi_token_step_on_a_ragged_cache_with_explicit_mask(arch):
    """T new tokens on rows of different lengths, causal given as an explicit mask == default causal."""
    model = tiny_model(arch)
    forward = LeanForward(model)
    prompts = random_prompts([4, 8])
    extra = random_prompts([5, 5], seed=2)
    for mask in (None, torch.tril(torch.ones(2, 5, 5, dtype=torch.bool))):
        cache = KVCache(forward.spec, 2, 32)
        rows = cache.rows(0, 2)
        ids = torch.zeros(2, 8, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, :len(p)] = torch.tensor(p)
        forward(ids, rows, logits_at=None)
        rows.advance(torch.tensor([4, 8]))
        out = forward(torch.tensor(extra), rows, new_token_mask=mask)
        for b in range(2):
            ref = reference_logits(model, prompts[b] + extra[b])[-5:]
            assert (out.logits[b] - ref).abs().max() < TOL


def test_tree_mask_and_positions_equal_separate_branches():
    """Two sibling branches verified in one pass see only their own ancestors (what tree verification needs)."""
    model = tiny_model("llama")
    forward = LeanForward(model)
    prompt = random_prompts([6])[0]
    a, b = 11, 12
    rows = KVCache(forward.spec, 1, 32).rows(0, 1)
    forward(torch.tensor([prompt]), rows, logits_at=None)
    rows.advance(6)
    # nodes: 0 = a (depth 0), 1 = b (depth 0, sibling of a)
    mask = torch.tensor([[[True, False], [False, True]]])
    positions = torch.tensor([[6, 6]])
    out = forward(torch.tensor([[a, b]]), rows, positions=positions, new_token_mask=mask)
    assert (out.logits[0, 0] - reference_logits(model, prompt + [a])[-1]).abs().max() < TOL
    assert (out.logits[0, 1] - reference_logits(model, prompt + [b])[-1]).abs().max() < TOL


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_from_the_position_table_is_the_rotary_embeddings_own(arch, dtype):
    """`LeanForward.rope` looks positions up in a table made once per (device, dtype): the cos and signed sin
    the model's rotary embedding gives for the same positions, bit for bit, positions past the context clamped.
    Control: the table read one position on is another rope. A RoPE whose frequencies follow the batch's
    longest position (dynamic) is computed per forward; a longrope one within its short span takes the table."""
    from tlt.models.lean_forward import signed_sin

    model = tiny_model(arch).to(dtype)
    forward = LeanForward(model)
    positions = torch.randint(0, 300, (3, 37), generator=torch.Generator().manual_seed(0))  # context: 256
    x = torch.empty(0, dtype=dtype)
    cos, sin = forward.rope(x, positions)
    expected_cos, expected_sin = model.model.rotary_emb(x, positions.clamp(max=255))
    assert torch.equal(cos, expected_cos[:, None]) and torch.equal(sin, signed_sin(expected_sin[:, None]))
    assert len(forward._rope_tables) == 1
    shifted, _ = forward.rope(x, positions + 1)
    assert not torch.equal(shifted, cos)
    model.model.rotary_emb.rope_type = "dynamic"
    assert LeanForward(model)._rope_table(torch.device("cpu"), dtype) is None


def test_in_place_parameter_updates_are_seen_without_rebuilding():
    model = tiny_model("llama")
    forward = LeanForward(model)
    prompt = random_prompts([5])[0]

    def lean_logits():
        rows = KVCache(forward.spec, 1, 8).rows(0, 1)
        return forward(torch.tensor([prompt]), rows, logits_at="last").logits[0, 0]

    before = lean_logits()
    with torch.no_grad():  # what an optimizer step does: in-place updates of the module's own tensors
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    after = lean_logits()
    assert (after - before).abs().max() > 1e-3
    assert (after - reference_logits(model, prompt)[-1]).abs().max() < TOL


def test_logits_at_index_picks_positions():
    model = tiny_model("qwen3")
    forward = LeanForward(model)
    prompts = random_prompts([6, 6])
    rows = KVCache(forward.spec, 2, 8).rows(0, 2)
    full = forward(torch.tensor(prompts), rows, logits_at="all").logits
    picked = forward(torch.tensor(prompts), rows, logits_at=torch.tensor([2, 5])).logits
    assert torch.allclose(picked[0, 0], full[0, 2]) and torch.allclose(picked[1, 0], full[1, 5])


def test_attention_spans_rounded_to_16_within_the_capacity_change_nothing_but_the_last_bits():
    """On CUDA the span is rounded up to a multiple of 16 (SDPA's efficient kernel pads a copy of an unaligned
    mask every call), never past the cache; the extra slots are masked, so the logits are the same."""
    from tlt.models.attention import aligned_span, attention_mask

    assert [aligned_span(n, 64) for n in (1, 16, 17, 50, 63, 64)] == [16, 16, 32, 64, 64, 64]
    assert aligned_span(50, 56) == 56 and aligned_span(70, 64) == 70 and aligned_span(17, None) == 17
    assert attention_mask(torch.tensor([3, 9]), 2, None, "cpu", capacity=40).shape[-1] == 16
    model = tiny_model("qwen2")
    forward = LeanForward(model)
    cache = KVCache(forward.spec, 2, 40)
    rows = cache.rows(0, 2)
    ids = torch.tensor(random_prompts([9, 9]))
    exact = forward.run(ids, rows, torch.zeros(2, dtype=torch.long), logits_at="all")
    padded = forward.run(ids, rows, torch.zeros(2, dtype=torch.long), logits_at="all", kv_len=aligned_span(9, 40))
    assert torch.allclose(exact.logits, padded.logits, atol=1e-5)


def test_rollout_cache_capacity_is_on_the_span_grid():
    """Graphs clamp their 256-slot spans to the cache: a capacity of whole blocks keeps them on the grid."""
    from tlt.rollout.graph_runner import GraphRunner, cache_capacity
    from tlt.rollout.model_runner import ModelRunner

    assert cache_capacity(300, graphs=True) == 512 and cache_capacity(300, graphs=False) == 304
    runner = ModelRunner(LeanForward(tiny_model("llama")))
    assert runner.allocate(3, 100).max_len == 112
    runner.graphs = GraphRunner(runner.forward, capture=False)
    assert runner.allocate(3, 100).max_len == 256


packed_only = pytest.mark.skipif(not isinstance(pick_linear(torch.device("cpu"), torch.float32), PackedOneDNNLinear),
                                 reason="oneDNN is not available in this torch build")


@packed_only
@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 4, 5)])
def test_packed_linear_equals_f_linear_and_sees_weight_changes(shape):
    linear = PackedOneDNNLinear()
    weight, bias, x = torch.randn(7, 5), torch.randn(7), torch.randn(*shape)
    with torch.no_grad():
        assert torch.allclose(linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-5)
        weight.mul_(-2)  # in place: the version counter moves, the pack is rebuilt
        assert torch.allclose(linear(x, weight, None), F.linear(x, weight), atol=1e-5)
        replaced = torch.randn(7, 5)  # a new tensor (maybe at a freed one's address) is packed afresh
        assert torch.allclose(linear(x, replaced, None), F.linear(x, replaced), atol=1e-5)


@packed_only
def test_packed_linear_drops_the_packs_of_freed_weights_and_copies_empty():
    linear = PackedOneDNNLinear()
    with torch.no_grad():
        weights = [torch.randn(4, 3) for _ in range(3)]
        for weight in weights:
            linear(torch.randn(2, 3), weight, None)
        assert len(linear._packs) == 3
        copied = copy.deepcopy(linear)
        del weights[:2]
        gc.collect()
        assert len(linear._packs) == 1 and len(copied._packs) == 0


@packed_only
@pytest.mark.parametrize("shape", [(65, 5), (3, 100, 5), (1078, 5)])
def test_packed_linear_pads_many_rows_and_returns_only_theirs(shape):
    """Inputs past ROUNDED_ABOVE rows run at a rounded row count (oneDNN makes a primitive per shape, ~0.65 MB
    each, kept: a CPU run's memory grew for hundreds of steps, found by a soak trial); the output is the input's."""
    linear = PackedOneDNNLinear()
    weight, bias, x = torch.randn(7, 5), torch.randn(7), torch.randn(*shape)
    with torch.no_grad():
        out = linear(x, weight, bias)
    assert out.shape == (*shape[:-1], 7) and torch.allclose(out, F.linear(x, weight, bias), atol=1e-5)


def test_row_counts_past_64_take_a_few_shapes_per_octave():
    padded = [padded_rows(rows) for rows in range(1, 4097)]
    assert padded[:64] == list(range(1, 65))  # decode batches and verify trees: exact
    assert all(rows <= p <= rows * 1.125 for rows, p in enumerate(padded, start=1))
    assert len(set(padded[64:])) == 8 * 6  # 65-4096: six octaves of 8 shapes each, instead of 4,032


@packed_only
def test_packed_linear_leaves_autograd_to_the_plain_weight():
    linear = PackedOneDNNLinear()
    weight = torch.randn(4, 3, requires_grad=True)
    linear(torch.randn(2, 3), weight, None).sum().backward()  # grad enabled: no packed (autograd-free) weight
    assert weight.grad is not None and not linear._packs


@pytest.mark.parametrize("duck_sizing", [False, True], ids=["ours", "control-duck-sizing"])
def test_compiled_decode_forward_traces_once_past_the_batch_of_one(monkeypatch, duck_sizing):
    """rollout.compile traces the decode forward without duck sizing: rows that finish one by one (4 -> 3 -> 2 -> 1)
    cost one trace for the dynamic batch and one for the batch of 1 (which Dynamo always specializes). With
    duck sizing (the control: torch.compile as it comes) the batch is tied to the cache's rows while both are 4,
    and the first smaller batch traces again. Dynamo's eager backend: this counts traces, not Inductor's code."""
    from torch._dynamo.utils import counters

    import tlt.models.lean_forward as lean_forward
    from tlt.rollout.engine import RolloutEngine
    from tlt.rollout.graph_runner import GraphRunner
    from tlt.rollout.request import Request
    from tlt.sampling import SamplingParams

    compile_as_given = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode, dynamic: compile_as_given(fn, backend="eager",
                                                                                       dynamic=dynamic))
    if duck_sizing:
        monkeypatch.setattr(lean_forward, "compile_static", lambda fn, mode: torch.compile(fn, mode=mode,
                                                                                            dynamic=True))
    engine = RolloutEngine(tiny_model(layers=1), max_batch_size=4)
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.model_runner.overlap_steps = False  # each step waits for its tokens: rows leave at known steps
    engine.forward.compile("inductor")
    torch._dynamo.reset()  # no code cached by earlier tests: their guards would decide what traces here
    counters.clear()
    requests = [Request(p, params=SamplingParams(temperature=0, max_new_tokens=4 + 3 * i))
                for i, p in enumerate(random_prompts([3, 5, 4, 6]))]
    engine.generate(requests)
    assert counters["stats"]["unique_graphs"] == (3 if duck_sizing else 2)

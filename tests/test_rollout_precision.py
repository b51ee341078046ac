"""The rollout's own precision and layout: the fused inference copy of the policy, the graph-safe forward over
device lengths, host-side sampling flags, and `rollout.dtype` (CPU-side; CUDA graphs are in test_gpu.py)."""

import pytest
import torch

from conftest import random_prompts, tiny_model
from tlt.errors import RequestError
from tlt.models.eagle import EagleDrafter
from tlt.models.kv_cache import KVCache
from tlt.models.lean_forward import LeanForward
from tlt.models.rollout_copy import RolloutCopy
from tlt.rl.config import ConfigError, load_config
from tlt.rollout.engine import RolloutEngine, resolve_rollout_dtype
from tlt.rollout.graph_runner import KV_BLOCK, batch_bucket, kv_bucket
from tlt.rollout.request import Request
from tlt.sampling import RowSampling, SamplingParams, processed_logprobs, sample_next


def forward_logits(lean, ids):
    cache = KVCache(lean.spec, ids.shape[0], 64, dtype=lean.dtype)
    return lean(ids, cache.rows(0, ids.shape[0])).logits


@pytest.mark.parametrize("tied", [False, True])
def test_fp32_copy_equals_the_master_and_follows_in_place_updates(arch, tied):
    model = tiny_model(arch, tie_word_embeddings=tied)
    copy = RolloutCopy(model, torch.float32)
    ids = torch.tensor(random_prompts([9, 9], seed=2))
    master, fused = LeanForward(model), LeanForward(copy.model, copy.fused)
    torch.testing.assert_close(forward_logits(fused, ids), forward_logits(master, ids), atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # an optimizer step, in place
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    stale = forward_logits(fused, ids)
    copy.refresh()
    fresh = forward_logits(fused, ids)
    torch.testing.assert_close(fresh, forward_logits(master, ids), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(stale, fresh)


def test_copy_fuses_projections_into_one_tensor_and_keeps_an_fp32_lm_head():
    model = tiny_model("qwen2", tie_word_embeddings=True)
    copy = RolloutCopy(model, torch.bfloat16)
    attn = copy.model.model.layers[0].self_attn
    fused = copy.fused[0]
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert proj.weight.untyped_storage().data_ptr() == fused.qkv_weight.untyped_storage().data_ptr()
        assert proj.bias.untyped_storage().data_ptr() == fused.qkv_bias.untyped_storage().data_ptr()
    assert copy.model.lm_head.weight.dtype == torch.float32
    assert copy.model.model.embed_tokens.weight.dtype == torch.bfloat16
    torch.testing.assert_close(copy.model.lm_head.weight, model.model.embed_tokens.weight)  # tied master
    assert not any(p.requires_grad for p in copy.model.parameters())


def test_an_mlp_with_biases_is_not_fused_and_still_exact():
    model = tiny_model("llama", mlp_bias=True)
    with torch.no_grad():
        model.model.layers[0].mlp.gate_proj.bias.normal_()
    copy = RolloutCopy(model, torch.float32)
    assert copy.fused[0].gate_up_weight is None
    ids = torch.tensor(random_prompts([7], seed=3))
    torch.testing.assert_close(forward_logits(LeanForward(copy.model, copy.fused), ids),
                               forward_logits(LeanForward(model), ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tree", [False, True])
def test_forward_over_device_lengths_and_a_fixed_kv_block_equals_the_host_forward(tree):
    """What a CUDA graph replays: same kernels, a padded KV length and lengths read from a tensor."""
    lean = LeanForward(tiny_model("llama"))
    prompts = random_prompts([5, 11, 2], seed=4)
    cache = KVCache(lean.spec, 3, 300)
    rows = cache.rows(0, 3)
    width = max(map(len, prompts))
    ids = torch.tensor([p + [4] * (width - len(p)) for p in prompts])
    lean(ids, rows)
    rows.advance(torch.tensor([len(p) for p in prompts]))
    new = torch.randint(4, 97, (3, 4))
    mask = torch.tril(torch.ones(4, 4, dtype=torch.bool)).expand(3, 4, 4).clone() if tree else None
    if tree:
        mask[:, 2, 1] = False  # a branch: node 2 hangs off node 0
    positions = rows.lengths[:, None] + torch.tensor([0, 1, 1, 2]) if tree else None
    expected = lean(new, rows, positions=positions, new_token_mask=mask)
    got = lean.run(new, rows, rows.lengths.clone(), positions=positions, new_token_mask=mask, kv_len=KV_BLOCK)
    torch.testing.assert_close(got.logits, expected.logits, atol=1e-5, rtol=1e-5)


def test_the_residual_gemm_path_cuda_takes_decodes_and_drafts_as_the_plain_one(arch):
    """On CUDA, o_proj and down_proj add into the residual inside their GEMM (addmm_ in place: two kernels a layer
    fewer). Forced on the CPU here: the fused copy's prefill, its decode steps, a drafter pass over the same
    layers and a tree verify equal the plain path, and the caller's tensors are left as they were."""
    model = tiny_model(arch)
    copy = RolloutCopy(model, torch.float32)
    plain, gemm = LeanForward(copy.model, copy.fused), LeanForward(copy.model, copy.fused)
    plain.linear = gemm.linear = torch.nn.functional.linear
    gemm.residual_gemm = True
    prompts = random_prompts([6, 3], seed=5)
    ids = torch.tensor([p + [4] * (6 - len(p)) for p in prompts])
    outputs = []
    for lean in (plain, gemm):
        rows = KVCache(lean.spec, 2, 64).rows(0, 2)
        first = lean(ids, rows)
        rows.advance(torch.tensor([len(p) for p in prompts]))
        new = torch.tensor([[5, 6, 7], [8, 9, 10]])
        mask = torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3).clone()
        mask[:, 2, 1] = False
        verify = lean(new, rows, positions=rows.lengths[:, None] + torch.tensor([0, 1, 1]), new_token_mask=mask)
        torch.manual_seed(0)  # the same random drafter for both paths
        drafter = EagleDrafter(model.config).attach(model).inference_copy(lean)
        drafted = drafter.step(new, verify.hidden, drafter.new_cache(2, 64).rows(0, 2), torch.arange(3).expand(2, -1))
        outputs.append((first.logits, verify.logits, verify.hidden, drafted))
    for got, want in zip(outputs[1], outputs[0]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    weight = copy.model.model.layers[0].mlp.down_proj.weight
    hidden = torch.randn(1, 2, weight.shape[1])

    def added(residual, *, bias=None, grad=False, hidden=hidden):
        before = residual.clone()
        with torch.set_grad_enabled(grad):
            out = gemm.add_projection(residual, hidden, weight, bias)
        torch.testing.assert_close(out, before + torch.nn.functional.linear(hidden, weight, bias), atol=1e-5,
                                   rtol=1e-5)
        return out is residual, torch.equal(residual, before)

    fresh = lambda: torch.randn(1, 2, weight.shape[0])
    assert added(fresh()) == (True, False)  # the fast path: in place, one GEMM
    assert added(fresh(), grad=True) == (False, True)  # autograd: never in place
    assert added(fresh(), bias=torch.randn(weight.shape[0])) == (False, True)
    assert added(torch.randn(1, weight.shape[0], 2).transpose(1, 2)) == (False, True)  # a strided residual


def test_buckets():
    assert [batch_bucket(b, 64) for b in (1, 3, 5, 17, 33, 64)] == [1, 4, 8, 24, 48, 64]
    assert batch_bucket(65, 64) is None and batch_bucket(3, 3) is None  # no cache rows for the padding
    assert kv_bucket(10, 1, 4096) == KV_BLOCK and kv_bucket(KV_BLOCK, 1, 4096) == 2 * KV_BLOCK
    assert kv_bucket(1000, 20, 1030) == 1024 and kv_bucket(1010, 20, 1030) == 1030  # never past the cache


def test_sampling_flags_come_from_the_host_and_agree_with_the_tensors():
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=3), SamplingParams()]
    built = RowSampling.from_params(params, "cpu")
    derived = RowSampling(built.temperature, built.top_k, built.top_p, built.greedy)
    flags = lambda s: (s.any_tempered, s.any_filtered, s.any_greedy, s.all_greedy)  # noqa: E731
    assert flags(built) == flags(derived) == (True, True, True, False)
    plain = RowSampling.from_params([SamplingParams()] * 2, "cpu")
    assert flags(plain) == (False, False, False, False)
    logits = torch.randn(3, 50)
    uniforms = torch.rand(3)
    torch.testing.assert_close(processed_logprobs(logits, built), processed_logprobs(logits, derived))
    assert torch.equal(sample_next(logits, built, uniforms)[0], sample_next(logits, derived, uniforms)[0])
    subset = built.select(torch.tensor([1, 2]))  # flags over-approximate: still the same samples
    assert torch.equal(sample_next(logits[1:], subset, uniforms[1:])[0],
                       sample_next(logits[1:], RowSampling.from_params(params[1:], "cpu"), uniforms[1:])[0])


def test_rollout_dtype_resolution_and_validation(tmp_path):
    assert resolve_rollout_dtype("auto", torch.device("cpu"), torch.float32) == torch.float32
    assert resolve_rollout_dtype("auto", torch.device("cuda"), torch.float32) == torch.bfloat16
    assert resolve_rollout_dtype("bfloat16", torch.device("cpu"), torch.float32) == torch.bfloat16
    with pytest.raises(RequestError, match="rollout dtype"):
        resolve_rollout_dtype("int8", torch.device("cpu"), torch.float32)
    with pytest.raises(ConfigError, match="rollout.dtype"):
        load_config(None, ["rollout.dtype=fp8"])
    with pytest.raises(RequestError, match="cuda_graphs"):
        RolloutEngine(tiny_model("llama"), cuda_graphs=True)
    with pytest.raises(ConfigError, match="rollout.compile"):
        load_config(None, ["rollout.compile=fastest"])
    with pytest.raises(ConfigError, match="rollout.compile .*needs rollout.cuda_graphs=true"):
        load_config(None, ["rollout.compile=inductor", "rollout.cuda_graphs=false"])
    assert load_config(None, ["rollout.compile=max-autotune"]).rollout.compile == "max-autotune"


def test_bf16_engine_keeps_the_callers_drafter_in_fp32_and_decodes():
    model = tiny_model("llama")
    drafter = EagleDrafter(model.config).attach(model)
    requests = [Request(p, n=2, params=SamplingParams(temperature=0, max_new_tokens=10))
                for p in random_prompts([3, 8], seed=7)]
    from tlt.speculative.strategy import SpecStrategy

    engine = RolloutEngine(model, max_batch_size=4, dtype="bfloat16", drafter=drafter,
                           speculation=SpecStrategy(3, 2, 6))
    result = engine.generate(requests)
    assert drafter.fc.weight.dtype == torch.float32  # a spot trainer may be training this very module
    assert engine.spec_decoder.drafter.fc.weight.dtype == torch.bfloat16
    assert all(len(s.token_ids) == 10 for s in result.samples)
    assert engine.forward.dtype == torch.bfloat16 and engine.policy_forward.dtype == torch.float32


@pytest.mark.parametrize("arch,layer", [("llama", None), ("qwen2", None), ("qwen3", None), ("qwen3", "qwen3")])
def test_a_drafter_inference_copy_runs_fused_projections_and_follows_a_hot_swap(arch, layer):
    """The serving copy of a drafter (CUDA graphs, a bf16 rollout) runs q/k/v and gate/up as one GEMM each, as
    the target's rollout copy does; same output as the drafter it copies, and a hot-swap's in-place weight load
    reaches the fused tensors (the copy's parameters are views of them). For a Qwen3 target, both a new
    drafter's Llama layer and the Qwen3 layer of one saved before 2026-12-02."""
    model = tiny_model(arch)
    lean = LeanForward(model)
    drafter, swapped = (EagleDrafter(model.config, layer=layer).attach(lean) for _ in range(2))
    with torch.no_grad():  # unlike an initialization: every projection and bias matters
        for param in [*drafter.parameters(), *swapped.parameters()]:
            param.add_(torch.randn_like(param) * 0.1)
    serving = drafter.inference_copy(lean)
    fused = serving._fused_projections
    for proj in (serving.layer.self_attn.q_proj, serving.layer.self_attn.v_proj, serving.layer.mlp.up_proj):
        assert proj.weight.untyped_storage().data_ptr() in (fused.qkv_weight.untyped_storage().data_ptr(),
                                                              fused.gate_up_weight.untyped_storage().data_ptr())
    tokens = torch.tensor(random_prompts([6, 6], seed=4))
    features = torch.randn(2, 6, model.config.hidden_size)

    def draft(d):
        cache = d.new_cache(2, 32)
        return d.step(tokens, features, cache.rows(0, 2), torch.arange(6).expand(2, 6))

    torch.testing.assert_close(draft(serving), draft(drafter), atol=1e-5, rtol=1e-5)
    serving.load_state_dict(swapped.state_dict())  # what ModelRunner.set_drafter does under CUDA graphs
    torch.testing.assert_close(draft(serving), draft(swapped), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(draft(serving), draft(drafter))

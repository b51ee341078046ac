"""Tiny random models built from configs: no network, no model hub, a few hundred KB each."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # the Triton kernels run under Triton's interpreter (before tlt imports them)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
EOS = 3


def _speed_up_the_triton_interpreter() -> None:
    """Triton's interpreter (3.x) re-lists every member of triton.language (`inspect.getmembers`) at each launch
    and at each call of a jit helper inside a kernel: ~15-20% of an interpreted test's time. The members that
    are builtins never change, so list them once; the patching itself is the interpreter's own. Tests only
    (nothing under src/ runs interpreted): if a later Triton moves these internals, the tests run as before."""
    try:
        from triton.language.core import is_builtin
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_attr = getattr(interpreter, "_patch_attr", None)
    if patch_attr is None or not hasattr(interpreter, "_patch_builtin"):
        return
    builtin_names: dict[int, list[str]] = {}  # id of a module or class of triton.language: they live as long

    def patch_builtin(pkg, builder, scope):
        import inspect

        names = builtin_names.get(id(pkg))
        if names is None:  # the first listing is the launch's, before anything is patched
            names = builtin_names[id(pkg)] = [name for name, member in inspect.getmembers(pkg) if is_builtin(member)]
        for name in names:
            member = getattr(pkg, name)
            if is_builtin(member):  # what the interpreter's own loop patches: a builtin not patched already
                patch_attr(pkg, name, member, builder, scope)

    interpreter._patch_builtin = patch_builtin


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    _speed_up_the_triton_interpreter()


def tiny_model(arch: str = "llama", *, vocab_size: int = 97, seed: int = 0, layers: int = 2, **overrides):
    """A random fp32 causal LM of the given family; token 3 is EOS."""
    config_cls, model_cls = ARCHITECTURES[arch]
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    if arch == "qwen2":  # Qwen2 has q/k/v biases: make them non-zero so they are exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    return model


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


def random_prompts(lengths, vocab_size=97, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # ids >= 4 keep prompts free of the special tokens (0 pad, 1 bos, 3 eos)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def markov_model(vocab_size: int = 8, *, sharpness: float = 2.0, context: float = 0.0, seed: int = 0):
    """A Llama whose next-token distribution depends only on the current token (exactly, when context=0):
    every layer's attention and MLP output projections are zero, so the final hidden state is the token's
    embedding, chosen with RMS 1 so the final norm leaves it unchanged. context > 0 adds small random attention
    outputs, so the prefix matters a little (tree masks and positions then change the logits).

    Returns (model, transition): transition[a, b] = logit of b after a (before temperature).
    """
    hidden = vocab_size
    model = tiny_model("llama", vocab_size=vocab_size, seed=seed, hidden_size=hidden, intermediate_size=2 * hidden,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=hidden // 2)
    generator = torch.Generator().manual_seed(seed)
    transition = torch.randn(vocab_size, vocab_size, generator=generator) * sharpness
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size) * hidden ** 0.5)  # RMS 1 rows
        # logits = lm_head @ e_a = sqrt(H) * lm_head[:, a]  ->  choose lm_head[:, a] = transition[a] / sqrt(H)
        model.lm_head.weight.copy_(transition.t() / hidden ** 0.5)
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.normal_(0, context, generator=generator) if context else \
                layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return model, transition


def oracle_drafter(model):
    """An EagleDrafter that is exact for a context-free `markov_model`: fc keeps the token embedding, its layer
    adds nothing, so ĥ_{t+1} = e_{x_{t+1}} = f_{t+1} and its draft distribution is the target's."""
    from tlt.models.eagle import EagleDrafter

    drafter = EagleDrafter(model.config)
    hidden = model.config.hidden_size
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, :hidden] = torch.eye(hidden)
        drafter.layer.self_attn.o_proj.weight.zero_()
        drafter.layer.mlp.down_proj.weight.zero_()
    return drafter


def assert_logprobs_match_target(model, samples, params) -> None:
    """Each returned log-prob equals the target's processed log-prob of that token, recomputed from scratch."""
    from tlt.sampling import RowSampling, processed_logprobs

    settings = RowSampling.from_params([params], "cpu")
    for sample in samples:
        sequence = list(sample.prompt_ids) + sample.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([sequence])).logits[0, len(sample.prompt_ids) - 1:-1]
        expected = processed_logprobs(logits[None], settings)[0]
        picked = expected.gather(-1, torch.tensor(sample.token_ids)[:, None])[:, 0]
        assert torch.isfinite(picked).all()
        assert torch.allclose(torch.tensor(sample.logprobs), picked, atol=1e-4)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """CLI entry points set torch's thread count for their process; a test calling them must not leak it."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _private_cost_curve_cache(tmp_path_factory):
    """run.gate=auto measures and caches a cost curve per device and model: keep the tests' out of ~/.cache."""
    import os

    previous = os.environ.get("TLT_CACHE_DIR")
    os.environ["TLT_CACHE_DIR"] = str(tmp_path_factory.mktemp("tlt-cache"))
    yield
    if previous is None:
        os.environ.pop("TLT_CACHE_DIR", None)
    else:
        os.environ["TLT_CACHE_DIR"] = previous


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_parted_only_at_near_ties(model, requests, tokens, others) -> None:
    """Where two greedy decodings (token-id lists) of the same request part, both tokens' logits (fp32 reference
    forward on the shared prefix) are within bf16 rounding (2^-7 relative) of the top logit; and most rows do not
    part. The tie-aware identity of bf16 decodings (docs/architecture.md)."""
    device = model.lm_head.weight.device
    parted = 0
    for request, a, b in zip(requests, tokens, others):
        index = first_divergence(a, b)
        if index is None:
            continue
        prefix = torch.tensor([list(request.prompt_ids) + a[:index]], device=device)
        with torch.no_grad():
            logits = model(prefix).logits[0, -1].float()
        top = logits.max()
        for token in (a[index], b[index]):
            assert top - logits[token] <= 2 ** -7 * top.abs() + 1e-2, (index, float(top - logits[token]))
        parted += 1
    assert parted <= len(requests) // 2  # ties are rare: most rows must match exactly

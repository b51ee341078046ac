"""`tlt verify`: the losslessness check passes on the exact rule, fails on a biased one (it has power), and its
Kolmogorov–Smirnov p-value matches known values of the Kolmogorov distribution."""

import json
import math

import pytest
import torch

from conftest import markov_model, oracle_drafter, random_prompts, tiny_model
from tlt.cli import main
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy
from tlt.verify import kolmogorov_sf, ks_pvalue, ks_statistic, over_accepting_rule, randomized_pit, verify

PARAMS = [SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=()),
          SamplingParams(temperature=0.8, top_k=5, top_p=0.9, max_new_tokens=24, stop_token_ids=(7,))]


def run_verify(params, accept_rule=None, seed=0):
    """A context-sensitive target with a near-exact drafter: drafts are accepted often (deep paths, rollback)."""
    model, _ = markov_model(16, sharpness=1.5, context=0.05, seed=1)
    return verify(model, oracle_drafter(model), strategy=SpecStrategy(3, 2, 6),
                  prompts=random_prompts([3, 5, 4, 6], vocab_size=16), params=params, samples_per_prompt=16,
                  seed=seed, accept_rule=accept_rule)


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.8-topk5-topp0.9"])
def test_the_exact_rule_passes_both_checks(params):
    report = run_verify(params)
    assert report.greedy_samples == 4 and report.greedy_mismatches == 0 and report.first_mismatch is None
    assert report.tokens > 600 and report.tau > 1.5  # enough tokens, and acceptance really was exercised
    assert report.passed, report.to_dict()
    assert json.loads(json.dumps(report.to_dict()))["passed"] is True


@pytest.mark.parametrize("rule", [over_accepting_rule, lambda u, cumulative, probs: u[:, None] <= cumulative + 0.3],
                         ids=["times-1.2", "plus-0.3"])
def test_negative_control_an_over_accepting_rule_fails(rule):
    report = run_verify(PARAMS[0], accept_rule=rule)
    assert report.greedy_passed  # greedy rows follow the argmax: the accept rule never touches them
    assert not report.sampled_passed and report.alignment_z > 4, report.to_dict()  # drafted tokens too often
    assert not report.passed


def q_verify(seed: int, **hooks):
    """q-sampling (S3K2q) with a noisy drafter, the CLI's default sizes (8 prompts x 8 samples x 64 tokens)."""
    from test_q_sampling import noisy_drafter
    import tlt.verify as verify_module

    model, _ = markov_model(8, sharpness=1.5, seed=1)
    engine = verify_module._sd_engine

    def with_hooks(*args):
        built = engine(*args)
        for name, hook in hooks.items():
            setattr(built.spec_decoder, name, hook)
        return built
    verify_module._sd_engine = with_hooks
    try:
        return verify(model, noisy_drafter(model, 0.6), strategy=SpecStrategy(3, 2, rule="q"),
                      prompts=random_prompts([3, 5, 4, 6, 2, 7, 5, 3], vocab_size=8, seed=1),
                      params=SamplingParams(temperature=1.0, max_new_tokens=64, stop_token_ids=()),
                      samples_per_prompt=8, seed=seed, check_greedy=False)
    finally:
        verify_module._sd_engine = engine


@pytest.mark.parametrize("bug", ["accept-1.2", "residual-from-p"])
def test_q_rule_bugs_the_pit_test_alone_missed_fail(bug):
    """Found by a QA pass: the PIT/KS test alone passed min(1, 1.2 r/q) at 12,288 tokens (p = 0.31) and the
    residual drawn from p at 1,536, both caught by the suite's exact-distribution tests. The drafter-alignment
    z-test sees both at the CLI's default sizes; the exact rule passes on the same settings."""
    hooks = ({"q_accept_rule": lambda u, r_c, q_c: u * q_c <= 1.2 * r_c} if bug == "accept-1.2"
             else {"q_residual_rule": lambda residual, q: residual})
    report = q_verify(0, **hooks)
    assert report.alignment_z > 4 and not report.sampled_passed, report.to_dict()
    exact = q_verify(0)
    assert exact.sampled_passed and abs(exact.alignment_z) < 3, exact.to_dict()


def test_the_alignment_z_is_standard_normal_for_exact_draws_and_not_for_biased_ones():
    """Tokens drawn from p: z over many positions is N(0, 1) whatever g is (here a random g per position);
    tokens drawn from a mixture leaning toward g's favourites: z is large."""
    from tlt.verify import Alignment

    generator = torch.Generator().manual_seed(3)
    zs = []
    for trial in range(200):
        logits = torch.randn(300, 6, generator=generator) * 1.5
        p = torch.softmax(logits, -1)
        g = torch.rand(300, 6, generator=generator)
        tokens = torch.multinomial(p, 1, generator=generator)[:, 0]
        alignment = Alignment()
        alignment.add(p.log(), tokens, g)
        zs.append(alignment.z)
    zs = torch.tensor(zs)
    assert abs(float(zs.mean())) < 0.2 and 0.8 < float(zs.std()) < 1.2
    logits = torch.randn(3000, 6, generator=generator) * 1.5
    p, g = torch.softmax(logits, -1), torch.rand(3000, 6, generator=generator)
    biased = torch.multinomial(0.8 * p + 0.2 * g / g.sum(-1, keepdim=True), 1, generator=generator)[:, 0]
    control = Alignment()
    control.add(p.log(), biased, g)
    assert control.z > 3 and control.p_value < 1e-3


def test_pit_is_uniform_for_exact_samples_with_ties():
    """Ties (here: all 4 kept tokens of a row equally likely) are ordered by token id: u stays exactly uniform."""
    generator = torch.Generator().manual_seed(0)
    logprobs = torch.log(torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.0], [0.5, 0.2, 0.2, 0.05, 0.05]]))
    rows = torch.randint(0, 2, (4000,), generator=generator)
    tokens = torch.multinomial(logprobs.exp()[rows], 1, generator=generator)[:, 0]
    u = randomized_pit(logprobs[rows], tokens, generator)
    assert ks_pvalue(ks_statistic(u), u.numel()) > 1e-3
    # token 2 of row 1 (p = 0.2, tied with token 1, which has the smaller id) owns [0.7, 0.9)
    assert ((u[(rows == 1) & (tokens == 2)] >= 0.7) & (u[(rows == 1) & (tokens == 2)] < 0.9)).all()


def test_kolmogorov_distribution_known_values():
    assert kolmogorov_sf(0.0) == 1.0 and ks_pvalue(0.0, 1000) == 1.0
    # classical critical values: P(K > 1.36) = 0.05, P(K > 1.63) = 0.01, P(K <= 1) = 0.7300, P(K <= 0.5) = 0.0361
    assert kolmogorov_sf(1.36) == pytest.approx(0.0495, abs=2e-4)
    assert kolmogorov_sf(1.63) == pytest.approx(0.0098, abs=2e-4)
    assert kolmogorov_sf(1.0) == pytest.approx(0.2700, abs=2e-4)
    assert kolmogorov_sf(0.5) == pytest.approx(0.9639, abs=2e-4)
    # the two series meet where the implementation switches between them
    assert kolmogorov_sf(1.18 - 1e-9) == pytest.approx(kolmogorov_sf(1.18), abs=1e-9)
    assert ks_pvalue(0.2, 1000) < 1e-6
    assert ks_pvalue(1.36 / math.sqrt(400), 400) == pytest.approx(0.0495, abs=2e-4)


def test_ks_statistic_against_hand_computed_values():
    assert ks_statistic(torch.tensor([0.5])) == pytest.approx(0.5)
    assert ks_statistic(torch.tensor([0.1, 0.2, 0.3, 0.4])) == pytest.approx(0.6)  # F_n(0.4) = 1 vs 0.4
    even_grid = (torch.arange(100, dtype=torch.float64) + 0.5) / 100
    assert ks_statistic(even_grid) == pytest.approx(0.005)


def byte_tokenizer():
    """A byte-level tokenizer with a plain chat template: 256 byte tokens, then <eos> = 256."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"] = 256
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>",
                                   chat_template="{% for m in messages %}{{ m['content'] }}\n{% endfor %}")


def test_cli_verify_on_a_model_directory(tmp_path, capsys):
    from tlt.models.model_files import save_model_dir

    model = tiny_model("llama", vocab_size=257, eos_token_id=256, max_position_embeddings=512)
    save_model_dir(model, byte_tokenizer(), tmp_path / "model")
    out = tmp_path / "verify.json"
    code = main(["verify", "--model", str(tmp_path / "model"), "--strategy", "S3K2N6", "--prompts", "2",
                 "--samples-per-prompt", "8", "--max-new-tokens", "16", "--no-negative-control", "--json", str(out)])
    assert code == 0, capsys.readouterr().out
    assert "PASS" in capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["check"]["passed"] and result["check"]["greedy_samples"] == 2
    assert result["check"]["tokens"] > 100 and result["negative_control"] is None


def test_cli_verify_json_gives_the_verdict_of_the_exit_code(tmp_path, capsys, monkeypatch):
    """A control that passes makes the verdict INCONCLUSIVE (exit 3; it was FAIL, exit 1, though nothing was
    found: a trial), but the JSON held only the check's "passed": true and the control's (QA): a top-level
    "passed" and "verdict" now give it, and the control, whose greedy check does not run, reports greedy_passed
    null."""
    from tlt import verify as verify_module
    from tlt.models.model_files import save_model_dir

    model = tiny_model("llama", vocab_size=257, eos_token_id=256, max_position_embeddings=512)
    save_model_dir(model, byte_tokenizer(), tmp_path / "model")
    monkeypatch.setitem(verify_module.OVER_ACCEPTING, "target", None)  # the control: the exact rule, which passes
    out = tmp_path / "verify.json"
    code = main(["verify", "--model", str(tmp_path / "model"), "--strategy", "S2K1N2", "--prompts", "1",
                 "--samples-per-prompt", "2", "--max-new-tokens", "6", "--negative-control", "--json", str(out)])
    assert code == 3, capsys.readouterr().out
    result = json.loads(out.read_text())
    assert result["passed"] is False and result["verdict"] == "inconclusive" and result["check"]["passed"] is True
    assert result["negative_control"]["sampled_passed"] is True
    assert result["negative_control"]["greedy_passed"] is None and result["check"]["greedy_passed"] is True


def test_verify_says_when_the_distribution_left_no_choice(tmp_path, capsys):
    """top-k 1, a temperature near 0 (or a top-p below the top token's mass): every token has probability 1, the
    check cannot fail; it said PASS with no word (QA), then PASS with a note and exit 0 (a trial): INCONCLUSIVE,
    exit 3. Control: at top-k 0 tokens had a choice."""
    from tlt.models.model_files import save_model_dir

    model = tiny_model("llama", vocab_size=257, eos_token_id=256, max_position_embeddings=512)
    save_model_dir(model, byte_tokenizer(), tmp_path / "model")
    args = ["verify", "--model", str(tmp_path / "model"), "--strategy", "S2K1N2", "--prompts", "1",
            "--samples-per-prompt", "2", "--max-new-tokens", "6", "--no-negative-control"]
    for narrow in (["--top-k", "1"], ["--temperature", "1e-5"]):
        assert main([*args, *narrow]) == 3
        out = " ".join(capsys.readouterr().out.split())
        assert "INCONCLUSIVE: every emitted token had probability 1" in out and "a temperature near 0" in out
    assert main(args) == 0
    assert "every emitted token had probability 1" not in capsys.readouterr().out
    main([*args[:-3], "--max-new-tokens", "2", "--no-negative-control"])  # τ 1 from the budget, not the drafter
    assert "because each response is 2 tokens" in " ".join(capsys.readouterr().out.split())


def test_cli_verify_rejects_a_bad_strategy(tmp_path):
    assert main(["verify", "--model", str(tmp_path), "--strategy", "deep"]) == 2


def test_verify_covers_q_sampling_and_its_negative_control():
    """The q rule passes both checks; an over-accepting control (min(1, r/q + 0.3)) fails the sampled check.
    (The CLI's control, min(1, 1.2 r/q), moves so little with a near-exact drafter that 1,500 tokens are not
    enough: test_q_rule_bugs_the_pit_test_alone_missed_fail has it with a noisier drafter.)"""
    def over_accepting_q_rule(u, residual_prob, draft_prob):
        return u * draft_prob <= residual_prob + 0.3 * draft_prob

    model, _ = markov_model(16, sharpness=1.5, context=0.05, seed=1)
    drafter = oracle_drafter(model)
    with torch.no_grad():  # q close to p but not equal: rejections and residuals happen
        drafter.fc.weight.add_(torch.randn(drafter.fc.weight.shape, generator=torch.Generator().manual_seed(0)) * 0.3)
    settings = dict(strategy=SpecStrategy.parse("S3K2q"), prompts=random_prompts([3, 5, 4, 6], vocab_size=16),
                    params=PARAMS[0], samples_per_prompt=16, seed=0)
    report = verify(model, drafter, **settings)
    assert report.passed and report.tau > 1.3, report.to_dict()
    control = verify(model, drafter, **settings, accept_rule=over_accepting_q_rule, check_greedy=False)
    assert not control.sampled_passed, control.to_dict()


def test_verify_that_ran_no_speculative_step_is_an_error_not_a_pass():
    """max_new_tokens 1, or responses that all stop at their first token: SD never ran, and verify printed PASS
    (found by review). Negative control: the same check with one more token allowed and no stop token runs SD."""
    from tlt.errors import TltError

    model, _ = markov_model(16, sharpness=1.5, context=0.05, seed=1)
    settings = dict(strategy=SpecStrategy.chain(2), prompts=random_prompts([3, 4], vocab_size=16),
                    samples_per_prompt=4, check_greedy=False)
    with pytest.raises(TltError, match="no speculative step ran"):
        verify(model, oracle_drafter(model), params=SamplingParams(temperature=1.0, max_new_tokens=8,
                                                                   stop_token_ids=tuple(range(16))), **settings)
    report = verify(model, oracle_drafter(model), params=SamplingParams(temperature=1.0, max_new_tokens=8,
                                                                         stop_token_ids=()), **settings)
    assert report.tau is not None and report.tau > 1


def test_the_json_check_leaves_the_path_alone(tmp_path):
    """It opened the path to see whether it could: a dangling symlink there was replaced by an empty file."""
    from tlt.files import check_writable

    link = tmp_path / "out.json"
    link.symlink_to(tmp_path / "elsewhere" / "out.json")
    check_writable(link, "--json")
    assert link.is_symlink() and not (tmp_path / "elsewhere").exists()
    (tmp_path / "kept.json").write_text("mine")
    check_writable(tmp_path / "kept.json", "--json")
    assert (tmp_path / "kept.json").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "kept.json", "out.json"]


@pytest.mark.parametrize("args,message", [
    (["--alpha", "2"], "alpha (the sampled check's significance level: it fails when any of its 3 tests' p-values "
     "is below alpha / 3) must be in (0, 1), got 2.0"),
    (["--json", "{tmp}"], "is a directory; give a file name"),
    (["--json", "{tmp}/file/out.json"], "is a file, not a directory"),
    (["--json", "/proc/tlt-verify.json"], "--json /proc/tlt-verify.json: cannot write in /proc"),  # read-only
    (["--max-new-tokens", "1"], "verify needs max_new_tokens >= 2, got 1"),
    # the flag, not SamplingParams' field; and not SamplingParams' advice ("use 0 for greedy"), which verify refuses
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--temperature", "1e-9"], "--temperature must be at least 1e-05, got 1e-09"),
    (["--temperature", "0"], "--temperature must be at least 1e-05, got 0.0")])
def test_cli_verify_refuses_a_bad_alpha_or_json_path_before_loading(tmp_path, capsys, args, message):
    """--alpha 2 printed 'FAIL: speculative decoding is NOT lossless' (every p-value is below 2); a --json path
    that cannot be written raised a traceback after the whole check, its results lost. Both fail before the
    model loads (model points nowhere: a later check would complain about it instead)."""
    (tmp_path / "file").write_text("x")
    args = [arg.replace("{tmp}", str(tmp_path)) for arg in args]
    assert main(["verify", "--model", str(tmp_path / "nope"), *args]) == 2
    assert message in capsys.readouterr().err

"""`tlt verify`: the statistical check that speculative decoding is lossless on a user's model and drafter
(tlt/verify.py), as a command: its flags, its table, its exit code."""

from __future__ import annotations

import argparse
from pathlib import Path

from tlt.errors import TltError
from tlt.files import check_writable
from tlt.threads import add_threads


def add_verify(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="HF directory, .gguf file, or 'smollm2' (default)")
    parser.add_argument("--drafter", default=None, help="a tlt drafter directory (default: an untrained drafter; "
                        "losslessness must hold for ANY drafter, a well-trained one is accepted more often and "
                        "exercises the acceptance rule harder)")
    parser.add_argument("--strategy", default="S4K2N8", help="depth S, branching K, tree size N (target-only "
                        "acceptance), or S4K2q: q-sampling with the drafter's probabilities")
    parser.add_argument("--prompts", type=int, default=8, help="arithmetic-task chat prompts")
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="of the sampled check (> 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1e-3, help="significance: fail when any test's p-value "
                        "(PIT uniformity; drafter alignment with q and with q/(p+q)) is below alpha/3")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, metavar="OUT", help="also write the results as JSON to OUT")
    add_threads(parser)
    parser.add_argument("--negative-control", action=argparse.BooleanOptionalAction, default=True,
                        help="also run with a deliberately over-accepting rule (drafts accepted 1.2x too often), "
                        "which must FAIL: shows the test can see a real bug at these settings; when it passes too "
                        "the verdict is INCONCLUSIVE (on by default: with an untrained drafter, or few tokens, a "
                        "PASS said little; found by a trial)")


EXIT_CODES = {"pass": 0, "fail": 1, "inconclusive": 3}  # (2: argparse's, a bad command line)


def verdict(report, control) -> str:
    """fail: SD's samples differ from the target's; inconclusive: nothing could show it at these settings (every
    token had probability 1, or the negative control passed too); pass: otherwise."""
    if not report.passed:
        return "fail"
    if report.choice_tokens == 0 or (control is not None and control.sampled_passed):
        return "inconclusive"
    return "pass"


def run_verify(args) -> int:
    """Exit 0 (PASS), 1 (FAIL: not lossless) or 3 (INCONCLUSIVE: the check could not have seen a bug here)."""
    import dataclasses
    import json

    from rich.console import Console

    from tlt.models import load_model
    from tlt.models.eagle import EagleDrafter, check_drafter_dir
    from tlt.generate_cli import sampling_from_flags
    from tlt.sampling import MIN_TEMPERATURE
    from tlt.speculative.strategy import SpecStrategy
    from tlt.tasks import ArithmeticTask, ChatTask
    from tlt.threads import pick_threads
    from tlt.verify import OVER_ACCEPTING, check_settings, verify

    strategy = SpecStrategy.parse(args.strategy)
    if not args.temperature >= MIN_TEMPERATURE:  # SamplingParams' advice, "0 for greedy", is no use here (QA)
        raise TltError(f"--temperature must be at least {MIN_TEMPERATURE}, got {args.temperature} (the sampled "
                       f"check samples; greedy identity is checked at temperature 0 anyway)")
    params = sampling_from_flags(args)
    check_settings(params, args.prompts, args.samples_per_prompt, args.alpha)  # before the model loads
    if args.drafter:
        check_drafter_dir(args.drafter)
    if args.json:  # before the check, whose results would be lost at the end
        check_writable(args.json, "--json")
    pick_threads(args.threads)
    console = Console()
    with console.status("loading model"):
        loaded = load_model(args.model)
    drafter = (EagleDrafter.load(args.drafter, loaded.model) if args.drafter
               else EagleDrafter(loaded.model.config).attach(loaded.model))
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    prompts = [task.prompt_ids(example) for example in task.sample(args.prompts, args.seed)]
    settings = dict(strategy=strategy, prompts=prompts, params=params, samples_per_prompt=args.samples_per_prompt,
                    alpha=args.alpha, seed=args.seed)
    with console.status("checking greedy identity and the sampled distribution"):
        report = verify(loaded, drafter, **settings)
    control = None
    if args.negative_control:
        with console.status("negative control: an over-accepting rule"):
            control = verify(loaded, drafter, **settings, accept_rule=OVER_ACCEPTING[strategy.rule],
                             check_greedy=False)
    said = verdict(report, control)
    _print_verify(console, report, control, args.drafter or "untrained", said, args.max_new_tokens)
    if args.json:  # "passed": the verdict the exit code gives (the check's own passing is not it: QA)
        Path(args.json).write_text(json.dumps({
            "model": loaded.source, "drafter": args.drafter, "params": dataclasses.asdict(params),
            "passed": said == "pass", "verdict": said,
            "check": report.to_dict(), "negative_control": control.to_dict() if control else None}, indent=1))
    return EXIT_CODES[said]


def _print_verify(console, report, control, drafter: str, said: str, max_new_tokens: int) -> None:
    from rich.table import Table

    mark = {True: "[green]PASS[/]", False: "[red]FAIL[/]"}
    table = Table(title=f"tlt verify: {report.strategy}, drafter {drafter}, τ = {report.tau:.2f} tokens/step")
    for column in ("check", "result", "detail"):
        table.add_column(column)
    where = "" if report.first_mismatch is None else \
        f"; first at prompt {report.first_mismatch[0]}, token {report.first_mismatch[1]}"
    table.add_row("greedy identity", mark[report.greedy_passed],
                  f"{report.greedy_samples - report.greedy_mismatches}/{report.greedy_samples} responses "
                  f"identical to plain decoding{where}")
    table.add_row("sampled distribution", mark[report.sampled_passed], _ks_detail(report))
    if control is not None:
        table.add_row("negative control (accepts 1.2x)",
                      "[green]FAILS, as it must[/]" if not control.sampled_passed else "[red]passes: no power[/]",
                      _ks_detail(control))
    console.print(table)
    if said == "fail":
        console.print("[bold red]FAIL[/]: speculative decoding is NOT lossless at these settings")
    elif report.choice_tokens == 0:
        console.print("[bold yellow]INCONCLUSIVE[/]: every emitted token had probability 1 at these settings (a "
                      "temperature near 0, top-k 1, or a top-p below the top token's mass): nothing to test")
    elif said == "inconclusive":
        console.print("[bold yellow]INCONCLUSIVE[/]: the check passed, but so did the negative control: at these "
                      "settings the test cannot see a real bug (a trained --drafter, or more --prompts, "
                      "--samples-per-prompt or --max-new-tokens)")
    else:
        console.print("[bold green]PASS[/]: no difference from the target found at these settings")
    if report.choice_tokens and report.tau < 1.1:
        if max_new_tokens <= 2:  # a step can emit no more than the tokens left (found by a trial: blamed the drafter)
            console.print(f"note: τ ≈ 1 because each response is {max_new_tokens} tokens: raise --max-new-tokens")
        else:
            better = "a better-trained drafter" if drafter != "untrained" else "a trained drafter (--drafter)"
            console.print("note: drafts were rarely accepted (τ ≈ 1), so the acceptance rule was seldom "
                          f"exercised; {better} makes the check sharper")


def _ks_detail(report) -> str:
    return (f"{report.tokens} token{'s' * (report.tokens != 1)} of {report.sampled_responses} "
            f"response{'s' * (report.sampled_responses != 1)}: PIT KS D = {report.ks_statistic:.4f}, "
            f"p = {report.p_value:.3g}; drafter alignment z = {report.alignment_z:+.2f} (q), "
            f"{report.ratio_z:+.2f} (q/(p+q)), p = {report.alignment_p_value:.3g}, {report.ratio_p_value:.3g} "
            f"(each at alpha/3 = {report.alpha / 3:.2g})")

"""`tlt generate` / `tlt demo`: sample with the rollout engine and show the long tail it drains."""

from __future__ import annotations

import torch
from rich.console import Console
from rich.table import Table

from tlt.errors import RequestError, TltError
from tlt.files import check_writable, is_utf8_text
from tlt.models.eagle import EagleDrafter, check_drafter_dir
from tlt.rollout.policy import FixedSpeculation
from tlt.rollout.request import tail_rows
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy
from tlt.tasks.chat import NO_TOKENIZER

DEFAULT_STRATEGY = "S5K1q"  # with --drafter: the fastest arm at batch 1 on 2 CPU cores (docs/benchmarks.md §2)
DEFAULT_GATE = 4            # with --drafter: speculate in the tail only, where it pays

DEMO_PROMPTS = [
    "What is 7 times 8? Answer with the number only.",
    "Explain step by step how to add the fractions 1/3 and 1/4.",
    "Name the largest planet in the solar system.",
    "Write a short story about a robot learning to paint.",
]


def run_generate(args, *, demo: bool) -> int:
    from tlt.models import load_model
    from tlt.rollout.engine import RolloutEngine
    from tlt.rollout.request import Request
    from tlt.threads import pick_threads

    console = Console()
    prompts = args.prompts or DEMO_PROMPTS
    for number, prompt in enumerate(prompts, 1):
        if not is_utf8_text(prompt):  # else the tokenizer's TypeError
            raise TltError(f"prompt {number} is not valid UTF-8 text (check the terminal's or script's encoding)")
    speculation = _speculation(args)  # checked before the model loads, as are the sampling settings
    params = sampling_from_flags(args)
    if args.n < 1:
        raise TltError(f"-n (samples per prompt) must be >= 1, got {args.n}")
    if args.max_batch_size < 1:  # checked before the model loads (the engine would say so after)
        raise TltError(f"--max-batch-size must be >= 1, got {args.max_batch_size}")
    if args.compile != "off" and not torch.cuda.is_available():
        raise TltError(f"--compile {args.compile} compiles the steps CUDA graphs replay: it needs a CUDA device")
    if args.kernels == "triton" and not torch.cuda.is_available():
        raise TltError(f"--kernels {args.kernels}: the Triton kernels run on CUDA, and this machine has none")
    if args.kernels == "triton" and args.compile != "off":
        raise TltError("--kernels triton and --compile are alternatives (Inductor fuses its own kernels): pick one")
    if args.json:  # before the work, whose results would be lost at its end
        check_writable(args.json, "--json")
    pick_threads(args.threads)  # a negative count is refused here, before the model loads
    with console.status("loading model (first run: fetches and converts SmolLM2-135M-Instruct, ~1 min)"):
        loaded = load_model(args.model)
    if loaded.tokenizer is None:
        raise TltError(f"{loaded.source}: {NO_TOKENIZER}")
    if not getattr(loaded.tokenizer, "chat_template", None):
        raise TltError(f"{loaded.source} has no tokenizer with a chat template: cannot format the prompts")
    requests = [Request(_chat_ids(loaded.tokenizer, p), n=args.n, params=params, label=f"prompt {i + 1}")
                for i, p in enumerate(prompts)]
    if speculation is None:
        engine = RolloutEngine(loaded, max_batch_size=args.max_batch_size, compile=args.compile,
                               kernels=args.kernels)
    else:
        drafter = EagleDrafter.load(args.drafter, loaded.model)
        engine = RolloutEngine(loaded, max_batch_size=args.max_batch_size, drafter=drafter, speculation=speculation,
                               max_tree_size=speculation.strategy.cache_slots, compile=args.compile,
                               kernels=args.kernels)
    result = engine.generate(requests, progress=True)
    _print_samples(console, loaded.tokenizer, prompts, result)
    _print_trace(console, result)
    if speculation is not None:
        _print_speculation(console, speculation, result)
    if args.json:
        _write_json(args.json, loaded, params, prompts, result)
        console.print(f"wrote {args.json}")
    return 0


def _write_json(path: str, loaded, params: SamplingParams, prompts: list[str], result) -> None:
    """Every response in full, with what produced it (a trial: long responses could only be seen cut)."""
    import dataclasses
    import json
    from pathlib import Path

    tokenizer = loaded.tokenizer
    samples = [{"prompt": prompts[s.request_index], "prompt_index": s.request_index, "sample_index": s.sample_index,
                "text": tokenizer.decode(s.token_ids, skip_special_tokens=True), "token_ids": s.token_ids,
                "logprobs": s.logprobs, "finish_reason": s.finish_reason} for s in result.samples]
    Path(path).write_text(json.dumps({
        "model": loaded.source, "params": dataclasses.asdict(params), "samples": samples,
        "generated_tokens": result.generated_tokens, "wall_s": result.wall_s, "tokens_per_s": result.tokens_per_s,
        "speculation": result.speculation_summary()}, indent=1, ensure_ascii=False))


# SamplingParams' fields as the command line spells them: its errors name the field (QA: "max_new_tokens must be
# an integer >= 1" for --max-new-tokens 0)
FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "max_new_tokens": "--max-new-tokens",
         "seed": "--seed"}


def sampling_from_flags(args) -> SamplingParams:
    """SamplingParams from the command's flags; an error names the flag."""
    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_new_tokens=args.max_new_tokens, seed=args.seed)
    except RequestError as error:
        field = str(error).split(" ", 1)[0]
        raise TltError(str(error).replace(field, FLAGS[field], 1) if field in FLAGS else str(error)) from None


def _speculation(args) -> FixedSpeculation | None:
    """--drafter's strategy and gate as a policy (None without --drafter); one clear error for bad values."""
    if args.drafter is None:
        if args.strategy is not None or args.gate is not None:
            raise TltError("--strategy and --gate set speculative decoding, which needs --drafter DIR")
        return None
    gate = DEFAULT_GATE if args.gate is None else args.gate
    if gate < 1:
        raise TltError(f"--gate must be at least 1 (rows running), got {gate}")
    strategy = SpecStrategy.parse(DEFAULT_STRATEGY if args.strategy is None else args.strategy)  # "": refused
    check_drafter_dir(args.drafter)
    return FixedSpeculation(strategy, gate)


def _print_speculation(console, speculation: FixedSpeculation, result) -> None:
    summary = result.speculation_summary()
    if not summary.get("sd_step_share"):
        decoded = any(step.kind == "decode" for step in result.steps)
        why = (f"the running batch stayed above --gate {speculation.gate}" if decoded else
               "no decode step ran (every response ended at its first token)")  # (the gate was blamed: QA)
        console.print(f"speculative decoding ({speculation.strategy}) never ran: {why}")
        return
    console.print(f"speculative decoding ({speculation.strategy}, while ≤ {speculation.gate} rows ran): "
                  f"{100 * summary['sd_step_share']:.0f}% of decode steps, τ {summary['tau']:.2f} tokens per row "
                  f"per verify step; every token is still a sample of the model")


def _chat_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _print_samples(console, tokenizer, prompts, result) -> None:
    table = Table(title="samples", show_lines=True)
    for column in ("prompt", "#", "tokens", "finish", "response"):
        table.add_column(column, overflow="fold")
    for sample in result.samples:
        text = tokenizer.decode(sample.token_ids, skip_special_tokens=True).strip()
        table.add_row(_shown(prompts[sample.request_index], 40), str(sample.sample_index),
                      str(len(sample.token_ids)), sample.finish_reason, _shown(text, 300))
    console.print(table)


def _shown(text: str, limit: int) -> str:
    """At most `limit` characters, a cut one marked (a prompt cut at 40 read as if it were whole: a trial)."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def _print_trace(console, result) -> None:
    decode = [s for s in result.steps if s.kind == "decode"]
    batches = [s.batch_size for s in decode]
    console.print(f"[bold]{result.generated_tokens}[/] token{'s' * (result.generated_tokens != 1)} in "
                  f"{result.wall_s:.1f}s "
                  f"= [bold]{result.tokens_per_s:.1f} tok/s[/] over {len(decode)} decode steps")
    if batches and max(batches) == 1:
        console.print("one row ran at a time: no batch to drain, so no long tail (sample more with -n or prompts)")
    elif batches:
        limit = tail_rows(max(batches))
        tail = sum(1 for b in batches if b <= limit)
        # rows admitted after the first ones finished (more samples than --max-batch-size) also run small batches
        # at the end: that is a queue's last wave, not responses of uneven length
        cause = ("the long tail that speculative decoding targets" if len(result.samples) <= max(batches) else
                 f"the queue's last wave ({len(result.samples)} samples, at most {max(batches)} at a time) and "
                 f"the long tail")
        # "1/4 of the peak" was false below a peak of 4 (the tail is at least one row) and a tail of 0 steps was
        # still called the long tail (found by a trial): the bound is said as rows
        where = (f"ran at ≤ {limit} row{'s' * (limit != 1)} (the long tail: a quarter of the peak batch of "
                 f"{max(batches)}, at least one row)")
        said = (f"{tail} of {len(batches)} steps ({100 * tail / len(batches):.0f}%) {where} — {cause}" if tail else
                f"no step {where}: the responses ended close together")
        console.print(f"running batch: {batches[0]} at the start → {batches[-1]} at the end; {said}")

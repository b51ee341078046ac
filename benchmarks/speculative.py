"""Speculative decoding vs plain decoding on SmolLM2-135M-Instruct, by batch size and strategy.

Prompts are the built-in task's (chat template, as in RL); temperature 1 (the RL setting); no stop tokens, so
every sample emits exactly max_new_tokens and both modes do the same amount of output. Tokens/s, τ (tokens per
row per verify step) and the speedup of the best strategy at each batch size, overall and per acceptance rule
(target-only `S4K2N8` vs q-sampling `S4K2q`), measured side by side in one run. The best arm is picked after
the fact, so its `speedup` leans up by the noise of the arms it beat (the adaptive policy picks the same way, online);
each arm's own medians are in `by_strategy`.

    python benchmarks/speculative.py --json benchmarks/results/speculative.json [--drafter DIR] [--quick]

A greedy run's file given to a T=1 run (`--greedy-json`) puts its results beside the T=1 ones (`speedup_greedy`,
`tau_greedy`, `by_strategy_greedy`): one file with both, as issue #13 asks.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.models.kernel_choice import resolve_kernels  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402

STRATEGIES = [SpecStrategy.chain(3), SpecStrategy(4, 2, 8), SpecStrategy(5, 3, 16), SpecStrategy(6, 4, 32),
              SpecStrategy.chain(3, "q"), SpecStrategy.chain(5, "q"), SpecStrategy(4, 2, rule="q"),
              SpecStrategy(3, 3, rule="q")]
QUICK = ["S3K1N3", "S4K2N8", "S3K1N3q", "S4K2N14q"]


PLAIN_ARMS = ("plain", "plain-waiting")  # --profile's plain runs: overlapped steps (the default), or not
COMPILED_ENGINES: dict[int, RolloutEngine] = {}  # --compile: one engine per batch size serves every arm and plain
ENGINE_SETUP: dict = {}  # the rollout dtype and whether CUDA graphs ran, as the engines had them (into the JSON)


def engine_for(loaded, drafter, batch, strategy, compile_mode, kernels="auto"):
    tree = max([s.cache_slots for s in STRATEGIES] + [strategy.cache_slots if strategy else 0])
    if compile_mode == "off":
        return RolloutEngine(loaded, max_batch_size=batch, drafter=drafter, speculation=strategy, max_tree_size=tree,
                             kernels=kernels)
    # Compiling costs ~25 s per engine: reuse one, with the drafter attached (plain runs then also keep the
    # features a drafter reads, as an RL engine with a drafter does above its gate).
    engine = COMPILED_ENGINES.get(batch)
    if engine is None:
        engine = COMPILED_ENGINES[batch] = RolloutEngine(loaded, max_batch_size=batch, drafter=drafter,
                                                         max_tree_size=max(tree, 32), compile=compile_mode)
    engine.speculation = strategy
    return engine


def run(loaded, drafter, prompts, batch, strategy, max_new_tokens, seed, sampling: dict, compile_mode="off",
        kernels="auto", profile: dict | None = None, overlap: bool = True):
    """tok/s, the speculation summary and the step statistics of one timed generate(); sampling: SamplingParams'
    temperature, top_k, top_p. profile: a dict that gets the profiler's table of that timed generate.
    overlap=False: plain steps wait for their tokens (ModelRunner.overlap_steps off: the engine before 0647eef)."""
    # An engine's graph runner holds itself through its captured bodies: only the cyclic collector frees the
    # last engine's KV cache, graph pools and rollout copy (on CUDA up to ~1 GB each, ~10 engines per batch)
    gc.collect()
    engine = engine_for(loaded, drafter, batch, strategy, compile_mode, kernels)
    engine.model_runner.overlap_steps = overlap
    params = SamplingParams(**sampling, max_new_tokens=max_new_tokens, stop_token_ids=(), seed=seed)
    requests = [Request(p, params=params) for p in prompts]
    if engine.runner is not None:  # CUDA: capture this run's graphs before timing it
        engine.generate(requests)
    else:
        engine.generate([Request(prompts[0], params=SamplingParams(max_new_tokens=4, seed=seed))])  # warm-up
    before = (engine.model_runner.warmups, engine.model_runner.eager_speculative_steps)
    if profile is None:
        result = engine.generate(requests)
    else:
        result = profiled(lambda: engine.generate(requests), profile)
    ENGINE_SETUP.update(dtype=str(engine.forward.dtype).removeprefix("torch."), cuda_graphs=engine.runner is not None)
    summary = {**result.speculation_summary(), "tau_ci90": tau_interval(result) if batch == 1 else None}
    return result.tokens_per_s, summary, step_stats(result, engine.model_runner, before)


def tau_interval(result, level: float = 0.9, resamples: int = 2000, seed: int = 0) -> list[float] | None:
    """At batch 1 a run's speculative steps fall to its requests in turn (a prefill starts each): the `level`
    bootstrap interval of τ over its prompts (emitted tokens over row steps, prompts resampled). τ at T=1 moved
    ±20% between 8-prompt runs of one arm (docs/benchmarks.md §9, eighteenth session): this says how far one
    run's τ, and so its speed-up, can be trusted. None: under 2 prompts speculated."""
    groups = []  # [emitted tokens, row steps] per prompt
    for step in result.steps:
        if step.kind == "prefill":
            groups.append([0, 0])
        elif step.kind == "decode" and step.mode == "sd" and groups:
            groups[-1][0] += step.new_tokens
            groups[-1][1] += step.batch_size
    groups = [group for group in groups if group[1]]
    if len(groups) < 2:
        return None
    rng = random.Random(seed)
    taus = []
    for _ in range(resamples):
        picked = [groups[rng.randrange(len(groups))] for _ in groups]
        taus.append(sum(g[0] for g in picked) / sum(g[1] for g in picked))
    taus.sort()
    return [taus[int((1 - level) / 2 * resamples)], taus[int((1 + level) / 2 * resamples) - 1]]


def step_stats(result, model_runner, before: tuple[int, int]) -> dict:
    """Where a timed generate's wall time went: decode steps (median and p90 ms: a speculative step's cost
    against a plain one's), the slow ones (over 3x the median: eager fallbacks, drafter rebuilds, captures),
    prefills, and the one-off work counted by the model runner during the timed run (it should be none: the
    untimed run before it met the same shapes)."""
    # a step's cycle, to the next step's start (an overlapped plain step's call returns before its tokens do);
    # the last step, with no next, its own call
    steps = result.steps
    decode = sorted((after.start_s - step.start_s) if after is not None else step.wall_s
                    for step, after in zip(steps, [*steps[1:], None]) if step.kind == "decode")
    prefill = [s.wall_s for s in result.steps if s.kind == "prefill"]
    median = statistics.median(decode) if decode else 0.0
    slow = [w for w in decode if w > 3 * median]
    return {"wall_s": result.wall_s, "decode_steps": len(decode), "step_ms_median": median * 1e3,
            "step_ms_p90": decode[int(0.9 * (len(decode) - 1))] * 1e3 if decode else 0.0,
            "decode_s": sum(decode), "slow_steps": len(slow), "slow_s": sum(slow),
            "prefills": len(prefill), "prefill_s": sum(prefill),
            "warmups": model_runner.warmups - before[0],
            "eager_speculative_steps": model_runner.eager_speculative_steps - before[1]}


def profiled(generate, into: dict):
    """generate() under torch.profiler: the ops with the most device and host time, and how busy the device
    was over the run's wall time (a speculative step the host cannot feed fast enough leaves it idle)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        result = generate()
    events = prof.key_averages()
    # Device time from the kernels' own events only: an eager op's self device time repeats its kernels'
    # (counted twice in a sum), where a replayed graph's kernels have no launching op (counted once)
    kernels = [e for e in events if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)]
    device_us = lambda e: getattr(e, "self_device_time_total", 0)
    rows = lambda found, key: [{"name": e.key[:80], "calls": e.count, "self_device_ms": device_us(e) / 1e3,
                                "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in sorted(found, key=key)[:25]]
    into.update(wall_s=result.wall_s, device_busy_s=sum(device_us(e) for e in kernels) / 1e6,
                top_device=rows(kernels, lambda e: -device_us(e)),
                top_cpu=rows(events, lambda e: -e.self_cpu_time_total))
    return result


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--drafter", help="a drafter directory (tlt drafter warmup); default: untrained")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--png", help="speedup plot (default: next to --json)")
    parser.add_argument("--batches", help="comma-separated batch sizes (default: 1,2,4,8,16,32)")
    parser.add_argument("--strategies", help="comma-separated strategies, e.g. S4K2N8,S4K2q (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="every row's top-k (0 = off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="every row's top-p (1 = off); on CUDA filtered "
                        "rows sort the vocabulary inside the graphs")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (bf16 and CUDA graphs there)")
    parser.add_argument("--compile", default="off", choices=["off", "inductor", "max-autotune"],
                        help="CUDA: Inductor-compile the captured forward (rollout.compile), plain and SD alike")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                        help="as rollout.kernels, plain and SD alike (auto: the fused Triton kernels on CUDA, "
                        "torch's on the CPU)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of every arm, each followed "
                        "by a plain run; medians over rounds (the machines are noisy)")
    parser.add_argument("--greedy-json", help="a --temperature 0 run's file: its results go beside these")
    parser.add_argument("--rounds", type=int, default=1, help="prompts per batch slot: batch x rounds distinct "
                        "prompts decoded at that batch size (more tokens behind τ at small batch)")
    parser.add_argument("--min-prompts", type=int, default=0, help="at least this many distinct prompts at "
                        "every batch size (more rounds where batch x rounds is fewer): τ at batch 1 from one "
                        "prompt is that prompt's (greedy on the H100, 2026-11-27: τ 1.53 on one prompt, 2.42 "
                        "on four)")
    parser.add_argument("--profile", metavar="BATCH:ARM", action="append", default=[], help="after the runs, one "
                        "more timed run of ARM (or plain, or plain-waiting: plain steps that each wait for their "
                        "tokens, as before overlapped steps) at BATCH under torch.profiler: its top ops by device "
                        "and host time and the device's busy seconds, into the JSON's `profiles` (repeatable)")
    parser.add_argument("--add-greedy-to", metavar="FILE", help="only put --greedy-json's results into FILE, a "
                        "T=1 run's (a GPU session runs T=1 first, so that a short call still gets the T=1 file)")
    args = parser.parse_args(argv)
    if args.compile != "off" and args.kernels == "triton":
        parser.error("--compile and --kernels triton are alternatives (as rollout.compile and rollout.kernels)")
    for wanted in args.profile:
        batch, _, arm = wanted.partition(":")
        if not (batch.isdigit() and int(batch) > 0 and arm):
            parser.error(f"--profile takes BATCH:ARM (e.g. 4:S4K2N14q, 4:plain or 4:plain-waiting), got {wanted!r}")
        try:
            arm in PLAIN_ARMS or SpecStrategy.parse(arm)  # a bad arm fails here, before the model loads
        except ValueError as error:
            parser.error(f"--profile {wanted}: {error}")
    if args.add_greedy_to:
        results = json.loads(Path(args.add_greedy_to).read_text())
        add_greedy(results, args.greedy_json)
        write_json(args.add_greedy_to, results, echo=False)
        return results
    batches = [1, 4, 16] if args.quick else [1, 2, 4, 8, 16, 32]
    strategies = [s for s in STRATEGIES if s.name in QUICK] if args.quick else STRATEGIES
    if args.batches:
        batches = [int(b) for b in args.batches.split(",")]
    if args.strategies:
        strategies = [SpecStrategy.parse(name) for name in args.strategies.split(",")]
    max_new = args.max_new_tokens or (48 if args.quick else 128)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    SamplingParams(**sampling)  # a bad value fails here, before the model loads

    loaded = load_model(device=args.device)
    drafter = EagleDrafter.load(args.drafter, loaded.model) if args.drafter else EagleDrafter(loaded.model.config)
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    results = {"plain_tok_s": {}, "sd_tok_s": {}, "speedup": {}, "tau": {}, "strategy": {}, "by_strategy": {},
               "best_by_rule": {"target": {}, "q": {}},
               "drafter": args.drafter or "untrained (random init)", "max_new_tokens": max_new,
               "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "rounds": args.rounds, "min_prompts": args.min_prompts,
               "repeats": args.repeats,
               "compile": args.compile,
               # as the engines ran (auto resolved on this device: rollout.kernels' default)
               "kernels": resolve_kernels(args.kernels, torch.device(args.device), compiled=args.compile != "off"),
               # with --compile one engine, built with the drafter, runs plain and SD alike (a compile per
               # engine costs minutes): its plain runs also store the drafter's features (slightly slower)
               "plain_engine_has_drafter": args.compile != "off",
               "environment": environment(),
               "complete": False}  # until the last write: a run killed at its time limit keeps its finished runs
    def save() -> None:  # as the run goes: a phase cut at its limit keeps its dtype and every finished run
        results.update(ENGINE_SETUP)
        write_json(args.json, results, echo=False)

    prompts_for = lambda batch: [task.prompt_ids(e) for e in task.sample(
        batch * max(args.rounds, -(-args.min_prompts // batch)), seed=100 + batch)]
    # Plain runs get no drafter, except with --compile, where one engine (built with the drafter) runs all.
    measure_on = lambda prompts, batch, arm, profile=None, overlap=True: run(
        loaded, drafter if arm or args.compile != "off" else None, prompts, batch, arm, max_new, batch, sampling,
        args.compile, args.kernels, profile=profile, overlap=overlap)
    for batch in batches:
        prompts = prompts_for(batch)
        key = str(batch)
        # Rounds of plain, then every arm; plain once more at the end. Each arm's speedup is the median of its
        # ratios to the plain runs either side of it (paired: load that drifts on the machine cancels), and its
        # tok/s and τ the medians over rounds.
        measure = lambda arm: measure_on(prompts, batch, arm)
        plain_runs = results.setdefault("plain_runs_tok_s", {}).setdefault(key, [])  # kept as they come
        stats = results.setdefault("step_stats", {}).setdefault(key, {})  # each arm's last run's
        first_plain = measure(None)
        plain_runs.append(first_plain[0])
        stats["plain"] = first_plain[2]
        runs = {strategy: [] for strategy in strategies}
        for _ in range(args.repeats):
            for strategy in strategies:
                tok_s, summary, stats[strategy.name] = measure(strategy)
                runs[strategy].append((tok_s, summary))
                # each arm as it finishes: a compiled arm costs minutes, and a phase may hit its time limit
                results.setdefault("arm_runs_tok_s", {}).setdefault(key, {})[strategy.name] = [
                    t for t, _ in runs[strategy]]
                save()
            plain_runs.append(measure(None)[0])
            save()
        plain = statistics.median(plain_runs)
        results["plain_tok_s"][key] = plain
        for strategy, outcomes in runs.items():
            ratios = [tok_s / plain_runs[i] for i, (tok_s, _) in enumerate(outcomes)]
            ratios += [tok_s / plain_runs[i + 1] for i, (tok_s, _) in enumerate(outcomes)]
            results["by_strategy"].setdefault(strategy.name, {})[key] = {
                "tok_s": statistics.median(t for t, _ in outcomes),
                "tau": statistics.median(summary["tau"] for _, summary in outcomes),
                "tau_ci90_runs": [summary["tau_ci90"] for _, summary in outcomes],  # batch 1: per prompt
                "speedup": statistics.median(ratios), "runs_tok_s": [t for t, _ in outcomes]}
        save()
        best = None
        for strategy in strategies:
            arm = results["by_strategy"][strategy.name][key]
            if best is None or arm["speedup"] > best[3]:
                best = (arm["tok_s"], arm["tau"], strategy.name, arm["speedup"])
            by_rule = results["best_by_rule"][strategy.rule]
            if key not in by_rule or arm["speedup"] > by_rule[key]["speedup"]:
                by_rule[key] = {"strategy": strategy.name, "tok_s": arm["tok_s"], "tau": arm["tau"],
                                "speedup": arm["speedup"]}
        results["sd_tok_s"][key], results["tau"][key], results["strategy"][key], results["speedup"][key] = best
        print(f"batch {batch:2d}: plain {plain:6.1f} tok/s  best SD {best[0]:6.1f} tok/s ({best[2]}, "
              f"tau {best[1]:.2f})  x{results['speedup'][key]:.2f}", file=sys.stderr)
        save()
    for wanted in args.profile:
        batch, _, arm = wanted.partition(":")
        profile = {"batch": int(batch), "arm": arm}
        results.setdefault("profiles", []).append(profile)
        strategy = None if arm in PLAIN_ARMS else SpecStrategy.parse(arm)
        # the table's prompts and engines at that batch size
        tok_s, _, profile["step_stats"] = measure_on(prompts_for(int(batch)), int(batch), strategy, profile,
                                                     overlap=arm != "plain-waiting")
        profile["tok_s"] = tok_s
        save()
    add_greedy(results, args.greedy_json)
    results.update(ENGINE_SETUP)
    results["complete"] = True
    write_json(args.json, results)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    if png:
        plot(results, png)
    return results


def add_greedy(results: dict, greedy_json: str | None) -> None:
    """A greedy run's results beside these (a greedy run that never started left no file: nothing)."""
    if greedy_json and Path(greedy_json).exists():
        greedy = json.loads(Path(greedy_json).read_text())
        results.update({f"{key}_greedy": greedy.get(key) for key in ("speedup", "tau", "strategy", "by_strategy",
                                                                      "complete", "temperature")})


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_batch in results["by_strategy"].items():
        sizes = sorted(by_batch, key=int)
        ax.plot([int(b) for b in sizes], [by_batch[b]["speedup"] for b in sizes], marker="o", label=name)
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("running batch size")
    ax.set_ylabel("speedup vs plain decoding")
    ax.set_title(f"SmolLM2-135M, drafter: {Path(results['drafter']).name}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()

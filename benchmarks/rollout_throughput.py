"""Rollout throughput: tlt's RolloutEngine vs transformers `generate` on SmolLM2-135M-Instruct.

Same prompts (chat template, a mix whose answers range from one word to many paragraphs), same
max_new_tokens, same sampling (greedy by default, so both produce the same tokens), batch 1, 8, 32, 64.
Throughput counts useful tokens only (up to and including EOS): padding that `generate` keeps decoding
for finished rows is work, not output. Also measures the batch-1 decode step against the memory floor
(fp32 weight bytes / measured memory bandwidth).

On CUDA the engine decodes in bf16 from CUDA graphs (its defaults there); it is also run eagerly in bf16, and the
baseline is `transformers.generate` with a static cache (compiled by transformers) on a bf16 copy of the model:
the best transformers offers in the same dtype. The floor uses the device's own measured bandwidth.

    python benchmarks/rollout_throughput.py --json benchmarks/results/rollout_throughput.json [--quick]
    python benchmarks/rollout_throughput.py --device cuda --json benchmarks/results/rollout_throughput_h100.json
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import (MIXED_PROMPTS, environment, median_time, memory_bandwidth, sync,  # noqa: E402
                    unique_parameter_bytes, write_json)

from tlt.models import load_model  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    texts = [MIXED_PROMPTS[i % len(MIXED_PROMPTS)] for i in range(count)]
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for t in texts]


def useful_tokens(row: list[int], eos: set[int]) -> int:
    for index, token in enumerate(row):
        if token in eos:
            return index + 1
    return len(row)


def left_padded(prompts, pad_id: int, device) -> dict:
    """input_ids and attention_mask, left-padded by hand: the tokenizer may have no pad token."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def run_hf_generate(model, tokenizer, prompts, max_new_tokens, temperature, eos, **extra) -> tuple[float, int]:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else sorted(eos)[0]
    batch = left_padded(prompts, pad_id, model.device)
    kwargs = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                  eos_token_id=sorted(eos), **extra)
    if temperature > 0:
        kwargs.update(temperature=temperature, top_p=1.0, top_k=0)
    sync(model.device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(**batch, **kwargs)
    sync(model.device)
    wall = time.perf_counter() - start
    width = batch["input_ids"].shape[1]
    return wall, sum(useful_tokens(row[width:].tolist(), eos) for row in out)


def run_engine(engine, prompts, max_new_tokens, temperature) -> tuple[float, int, list[float]]:
    """Seconds, tokens and each decode step's cycle in ms: from its start to the next decode step's start (the
    host's work between steps included; with overlapped plain steps a step's own call returns before its tokens
    do, so its call time alone would understate the step)."""
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=0)
    result = engine.generate([Request(p, n=1, params=params) for p in prompts])
    steps = result.steps
    decode_ms = [(after.start_s - step.start_s) * 1000 for step, after in zip(steps, steps[1:])
                 if step.kind == "decode" and after.kind == "decode"]
    if not decode_ms:  # a single decode step: its call
        decode_ms = [s.wall_s * 1000 for s in steps if s.kind == "decode"]
    return result.wall_s, result.generated_tokens, decode_ms


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--quick", action="store_true", help="shorter responses (finishes in < 3 minutes)")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--compile", default="off", choices=["off", "inductor", "max-autotune"],
                        help="CUDA: also time an engine whose captured forward is Inductor-compiled (rollout.compile)")
    parser.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"],
                        help="CUDA: the engine's kernels (rollout.kernels; auto: the fused Triton kernels there)")
    parser.add_argument("--also-kernels", default=None, choices=["torch", "triton"],
                        help="CUDA: also time the graphed engine on these kernels, side by side (e.g. torch: what "
                        "the engine ran before rollout.kernels=auto)")
    parser.add_argument("--skip-eager", action="store_true", help="CUDA: do not time the eager (uncaptured) engine")
    parser.add_argument("--also-waiting", action="store_true", help="CUDA: also time the graphed engine with plain "
                        "steps that each wait for their tokens (ModelRunner.overlap_steps off), side by side")
    args = parser.parse_args(argv)
    max_new = args.max_new_tokens or (96 if args.quick else 256)
    if args.device != "cpu":
        return main_cuda(args, max_new)

    loaded = load_model(device="cpu")  # (a machine with CUDA would otherwise put it there)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = set(loaded.eos_token_ids)
    results = {"engine_tok_s": {}, "hf_generate_tok_s": {}, "speedup_vs_hf": {}, "tokens": {},
               "max_new_tokens": max_new, "temperature": args.temperature, "environment": environment(),
               "complete": False}  # until the last write: a run killed at its time limit keeps its finished batches
    batch1_steps: list[float] = []
    for batch in [int(b) for b in args.batches.split(",")]:
        # batch 1 uses a long-answer prompt: the steady-state decode step is what is being measured
        prompts = chat_prompts(tokenizer, batch) if batch > 1 else chat_prompts(tokenizer, 2)[1:]
        engine = RolloutEngine(loaded, max_batch_size=batch)
        run_engine(engine, prompts[:1], 4, args.temperature)  # warm-up: allocator, oneDNN primitives
        # generate's too: the first batch's timed call paid its one-off start (found by review)
        run_hf_generate(model, tokenizer, prompts[:1], 4, args.temperature, eos)
        engine_s, engine_tokens, decode_ms = run_engine(engine, prompts, max_new, args.temperature)
        hf_s, hf_tokens = run_hf_generate(model, tokenizer, prompts, max_new, args.temperature, eos)
        key = str(batch)
        results["engine_tok_s"][key] = engine_tokens / engine_s
        results["hf_generate_tok_s"][key] = hf_tokens / hf_s
        results["speedup_vs_hf"][key] = results["engine_tok_s"][key] / results["hf_generate_tok_s"][key]
        results["tokens"][key] = {"engine": engine_tokens, "hf_generate": hf_tokens}
        if batch == 1:
            batch1_steps = decode_ms
        print(f"batch {batch:3d}: engine {results['engine_tok_s'][key]:8.1f} tok/s  generate "
              f"{results['hf_generate_tok_s'][key]:8.1f} tok/s  x{results['speedup_vs_hf'][key]:.2f}",
              file=sys.stderr)
        write_json(args.json, results, echo=False)

    bandwidth = memory_bandwidth()
    weight_bytes = unique_parameter_bytes(model)
    results.update({
        "batch1_step_ms": statistics.median(batch1_steps) if batch1_steps else None,
        "batch1_floor_ms": weight_bytes / (bandwidth["copy_gbs"] * 1e9) * 1000,
        "batch1_read_floor_ms": weight_bytes / (bandwidth["read_gbs"] * 1e9) * 1000,
        "weight_bytes": weight_bytes,
        "bandwidth": bandwidth,
        "complete": True,
    })
    write_json(args.json, results)
    return results


def time_compiled(results: dict, key: str, engine, prompts, max_new, temperature) -> None:
    """The engine with rollout.compile: its first run compiles and captures (timed as compile_warmup_s)."""
    for name in ("engine_compiled_tok_s", "step_ms_compiled", "compile_warmup_s", "speedup_compiled_vs_hf_static",
                 "tokens_compiled"):
        results.setdefault(name, {})
    started = time.perf_counter()
    run_engine(engine, prompts, max_new, temperature)
    results["compile_warmup_s"][key] = time.perf_counter() - started
    seconds, tokens, decode_ms = run_engine(engine, prompts, max_new, temperature)
    results["engine_compiled_tok_s"][key] = tokens / seconds
    results["step_ms_compiled"][key] = statistics.median(decode_ms)
    results["tokens_compiled"][key] = tokens
    results["compile_mode"] = engine.forward.compile_mode


def batch1_steps(results: dict) -> dict:
    steps = {"batch1_step_ms": results["step_ms"].get("1"),
             "batch1_step_ms_compiled": results.get("step_ms_compiled", {}).get("1")}
    if "step_ms_waiting" in results:
        steps["batch1_step_ms_waiting"] = results["step_ms_waiting"].get("1")
    for choice in ("torch", "triton"):
        if f"step_ms_{choice}" in results:
            steps[f"batch1_step_ms_{choice}"] = results[f"step_ms_{choice}"].get("1")
    return steps


def time_other_kernels(results: dict, key: str, loaded, batch: int, prompts, max_new: int, temperature: float,
                       choice: str) -> str:
    """The graphed engine on `choice`'s kernels, beside the headline one (same prompts, same run)."""
    names = {"tok_s": f"engine_{choice}_tok_s", "step": f"step_ms_{choice}",
             "speedup": f"speedup_{choice}_vs_hf_static", "tokens": f"tokens_{choice}"}
    for name in names.values():
        results.setdefault(name, {})
    try:
        engine = RolloutEngine(loaded, max_batch_size=batch, kernels=choice)
        run_engine(engine, prompts, max_new, temperature)  # warm-up: Triton's compiles and the captures
        seconds, tokens, decode_ms = run_engine(engine, prompts, max_new, temperature)
    except Exception as error:  # a kernel that does not build on this device: the headline rows stand
        results[f"{choice}_error"] = f"{type(error).__name__}: {error}"[:2000]
        return f"  {choice} failed: {results[f'{choice}_error'][:200]}"
    results[names["tok_s"]][key] = tokens / seconds
    results[names["step"]][key] = statistics.median(decode_ms)
    results[names["tokens"]][key] = tokens
    results[names["speedup"]][key] = results[names["tok_s"]][key] / results["hf_static_tok_s"][key]
    return f"  {choice} {results[names['tok_s']][key]:9.1f} tok/s step {results[names['step']][key]:.3f} ms"


def time_waiting(results: dict, key: str, loaded, batch: int, prompts, max_new: int, temperature: float,
                 kernels: str) -> str:
    """The graphed engine with plain steps that wait for their tokens (no overlap), beside the headline one."""
    for name in ("engine_waiting_tok_s", "step_ms_waiting", "overlap_speedup"):
        results.setdefault(name, {})
    engine = RolloutEngine(loaded, max_batch_size=batch, kernels=kernels)
    engine.model_runner.overlap_steps = False
    run_engine(engine, prompts, max_new, temperature)  # warm-up: the captures
    seconds, tokens, decode_ms = run_engine(engine, prompts, max_new, temperature)
    results["engine_waiting_tok_s"][key] = tokens / seconds
    results["step_ms_waiting"][key] = statistics.median(decode_ms)
    results["overlap_speedup"][key] = results["engine_tok_s"][key] / results["engine_waiting_tok_s"][key]
    return (f"  waiting {results['engine_waiting_tok_s'][key]:9.1f} tok/s (overlap "
            f"x{results['overlap_speedup'][key]:.2f})")


def main_cuda(args, max_new: int) -> dict:
    """The engine (bf16, CUDA graphs; and eager bf16) vs transformers generate with a static cache in bf16."""
    loaded = load_model(device=args.device)
    model, tokenizer = loaded.model, loaded.tokenizer
    eos = set(loaded.eos_token_ids)
    hf_model = copy.deepcopy(model).to(torch.bfloat16)
    results = {"engine_tok_s": {}, "engine_eager_tok_s": {}, "hf_static_tok_s": {}, "speedup_vs_hf_static": {},
               "speedup_vs_eager": {}, "tokens": {}, "step_ms": {}, "graphs_captured": {}, "dtype": "bfloat16",
               "max_new_tokens": max_new, "temperature": args.temperature, "environment": environment(),
               "complete": False}  # until the last write: a run killed at its time limit keeps its finished batches
    from transformers import CompileConfig

    # static shapes for transformers' compiled decode step: under its default (dynamic=None) the second batch size
    # recompiles with symbolic shapes, slower than the static graph a fresh process would compile
    hf_static = dict(cache_implementation="static", compile_config=CompileConfig(dynamic=False))
    batches = [int(b) for b in args.batches.split(",")]
    prompts_of = {batch: chat_prompts(tokenizer, batch) if batch > 1 else chat_prompts(tokenizer, 2)[1:]
                  for batch in batches}
    # First the numbers (graphs engine vs HF static), written per batch; the compiled engines (minutes of
    # Inductor per shape) after all of them: a phase cut at its limit loses only what it measured last
    for batch in batches:
        prompts, key = prompts_of[batch], str(batch)
        graphed = RolloutEngine(loaded, max_batch_size=batch, kernels=args.kernels)
        results["kernels"] = graphed.kernels  # what auto chose here
        # as the baseline runs: the engine turns cuDNN attention off for the process (recorded before it, the
        # file said cudnn_sdp true for a generate that ran without it; found by review)
        results["environment"]["cudnn_sdp"] = torch.backends.cuda.cudnn_sdp_enabled()
        run_engine(graphed, prompts, max_new, args.temperature)  # warm-up: captures this run's graphs
        engine_s, engine_tokens, decode_ms = run_engine(graphed, prompts, max_new, args.temperature)
        run_hf_generate(hf_model, tokenizer, prompts, max_new, args.temperature, eos,
                        **hf_static)  # warm-up: transformers compiles its static decode step
        hf_s, hf_tokens = run_hf_generate(hf_model, tokenizer, prompts, max_new, args.temperature, eos, **hf_static)
        results["engine_tok_s"][key] = engine_tokens / engine_s
        results["hf_static_tok_s"][key] = hf_tokens / hf_s
        results["speedup_vs_hf_static"][key] = results["engine_tok_s"][key] / results["hf_static_tok_s"][key]
        results["tokens"][key] = {"engine": engine_tokens, "hf_static": hf_tokens}
        results["step_ms"][key] = statistics.median(decode_ms)
        results["graphs_captured"][key] = graphed.runner.captures
        # as the engine ran, not as asked: the rollout copy is bf16 but keeps its lm_head in fp32 (the sampling
        # distribution), so the all-bf16 transformers baseline does less work there
        results["dtype"] = results["environment"]["dtype"] = str(graphed.forward.dtype).removeprefix("torch.")
        results["lm_head_dtype"] = str(graphed.forward.lm_head.weight.dtype).removeprefix("torch.")
        line = (f"batch {batch:3d}: engine {results['engine_tok_s'][key]:9.1f} tok/s  step "
                f"{results['step_ms'][key]:.3f} ms")
        results.update(batch1_steps(results))  # now: a run its time limit cuts keeps #13's key
        write_json(args.json, results, echo=False)
        if args.also_kernels not in (None, graphed.kernels):
            line += time_other_kernels(results, key, loaded, batch, prompts, max_new, args.temperature,
                                       args.also_kernels)
            results.update(batch1_steps(results))
            write_json(args.json, results, echo=False)
        if args.also_waiting:
            line += time_waiting(results, key, loaded, batch, prompts, max_new, args.temperature, args.kernels)
            results.update(batch1_steps(results))
            write_json(args.json, results, echo=False)
        if not args.skip_eager:
            eager = RolloutEngine(loaded, max_batch_size=batch, cuda_graphs=False, kernels=args.kernels)
            run_engine(eager, prompts[:1], 8, args.temperature)
            eager_s, eager_tokens, _ = run_engine(eager, prompts, max_new, args.temperature)
            results["engine_eager_tok_s"][key] = eager_tokens / eager_s
            results["speedup_vs_eager"][key] = results["engine_tok_s"][key] / results["engine_eager_tok_s"][key]
            results["tokens"][key]["engine_eager"] = eager_tokens
            line += f"  eager {results['engine_eager_tok_s'][key]:8.1f}"
            write_json(args.json, results, echo=False)
        print(f"{line}  hf static bf16 {results['hf_static_tok_s'][key]:8.1f}  "
              f"x{results['speedup_vs_hf_static'][key]:.2f}", file=sys.stderr, flush=True)
    for batch in batches if args.compile != "off" else []:
        key = str(batch)
        try:
            time_compiled(results, key, RolloutEngine(loaded, max_batch_size=batch, compile=args.compile),
                          prompts_of[batch], max_new, args.temperature)
        except Exception as error:  # e.g. no C compiler for Triton's launcher: keep the uncompiled numbers
            results["compile_error"] = f"{type(error).__name__}: {error}"[:2000]
            print(f"compiled engine failed: {results['compile_error']}", file=sys.stderr, flush=True)
            break
        results["speedup_compiled_vs_hf_static"][key] = (results["engine_compiled_tok_s"][key]
                                                         / results["hf_static_tok_s"][key])
        print(f"batch {batch:3d}: compiled {results['engine_compiled_tok_s'][key]:9.1f} tok/s  step "
              f"{results['step_ms_compiled'][key]:.3f} ms (x{results['speedup_compiled_vs_hf_static'][key]:.2f} "
              f"hf static)", file=sys.stderr, flush=True)
        results.update(batch1_steps(results))
        write_json(args.json, results, echo=False)
    bandwidth = memory_bandwidth(device=args.device)
    rollout_copy = RolloutEngine(loaded, max_batch_size=1).rollout_copy
    # bytes a decode step must stream: every weight but the embedding table (one row is gathered per token)
    weight_bytes = sum(t.numel() * t.element_size() for name, t in rollout_copy.model.named_parameters(
        remove_duplicate=False) if "embed_tokens" not in name)
    refresh_ms = median_time(rollout_copy.refresh, 20, args.device) * 1000
    results.update({
        **batch1_steps(results),
        "batch1_read_floor_ms": weight_bytes / (bandwidth["read_gbs"] * 1e9) * 1000,
        "weight_bytes": weight_bytes, "bandwidth": bandwidth, "refresh_ms": refresh_ms, "complete": True,
    })
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()

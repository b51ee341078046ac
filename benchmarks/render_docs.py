"""Render the measured tables of docs/benchmarks.md from the JSON files in benchmarks/results/.

    python benchmarks/render_docs.py   # prints markdown tables to paste or diff against the doc
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def rollout_table(data: dict) -> str:
    rows = ["| batch | engine tok/s | `generate` tok/s | speedup |", "|---:|---:|---:|---:|"]
    for batch in data["engine_tok_s"]:
        rows.append(f"| {batch} | {data['engine_tok_s'][batch]:.1f} | {data['hf_generate_tok_s'][batch]:.1f} | "
                    f"**{data['speedup_vs_hf'][batch]:.2f}x** |")
    bw = data["bandwidth"]
    rows.append("")
    rows.append(f"Batch-1 decode step {data['batch1_step_ms']:.1f} ms; floor {data['batch1_floor_ms']:.1f} ms "
                f"(weights {data['weight_bytes'] / 1e6:.0f} MB / copy bandwidth {bw['copy_gbs']:.1f} GB/s) → "
                f"**{data['batch1_step_ms'] / data['batch1_floor_ms']:.2f}x the floor**; against the stricter "
                f"read-only floor ({bw['read_gbs']:.1f} GB/s → {data['batch1_read_floor_ms']:.1f} ms) "
                f"{data['batch1_step_ms'] / data['batch1_read_floor_ms']:.2f}x.")
    return "\n".join(rows)


def speculative_table(data: dict) -> str:
    names = list(data["by_strategy"])
    rows = ["| batch | plain tok/s | " + " | ".join(f"{n} tok/s (τ, speedup)" for n in names) + " | best speedup |",
            "|---:|---:|" + "---:|" * len(names) + "---:|"]
    for batch in data["plain_tok_s"]:
        cells = [f"{arm['tok_s']:.1f} ({arm['tau']:.2f}, {arm['speedup']:.2f}x)"
                 for arm in (data["by_strategy"][n][batch] for n in names)]
        rows.append(f"| {batch} | {data['plain_tok_s'][batch]:.1f} | " + " | ".join(cells)
                    + f" | {data['speedup'][batch]:.2f}x |")
    return "\n".join(rows)


def adaptive_table(data: dict) -> str:
    rows = ["| mode | wall s | vs no SD |", "|---|---:|---:|", f"| no SD | {data['no_sd_s']:.1f} | 1.00x |"]
    for name, seconds in data["static_s"].items():
        rows.append(f"| static {name} (τ {data['static_tau'][name]:.2f}) | {seconds:.1f} | "
                    f"{data['no_sd_s'] / seconds:.2f}x |")
    rows.append(f"| adaptive (gate + bandit) | {data['adaptive_s']:.1f} | {data['adaptive_speedup_vs_no_sd']:.2f}x |")
    rows.append("")
    rows.append(f"`adaptive_vs_best_static` = {data['adaptive_vs_best_static']:.3f}, "
                f"`adaptive_speedup_vs_no_sd` = {data['adaptive_speedup_vs_no_sd']:.3f}; "
                f"{data['tail_steps_at_batch_le_gate']} of {data['decode_steps_no_sd']} decode steps run at batch ≤ gate.")
    return "\n".join(rows)


def spot_table(data: dict) -> str:
    rows = ["| phase | step | spot step s | frozen step s | ratio | τ spot | τ frozen | drafter steps | idle spot / frozen |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for phase in ("overhead", "tau"):
        part = data.get(phase)
        if part is None:
            continue
        for i, ratio in enumerate(part["step_ratio_per_step"]):
            rows.append(f"| {phase} | {i + 1} | {part['step_s']['spot'][i]:.1f} | {part['step_s']['frozen'][i]:.1f} | "
                        f"{ratio:.3f} | {part['tau']['spot'][i]:.2f} | {part['tau']['frozen'][i]:.2f} | "
                        f"{part['spot_train_steps'][i]} | {part['idle_fraction']['spot'][i]:.1%} / "
                        f"{part['idle_fraction']['frozen'][i]:.1%} |")
    rows.append("")
    rows.append(f"`spot_overhead_ratio` (median spot/frozen step time, greedy phase: identical tokens in both modes) "
                f"= **{data.get('spot_overhead_ratio')}**")
    return "\n".join(rows)


def e2e_table(data: dict) -> str:
    """Natural runs (different samples per mode: compare tokens/s too) or an equal-work replay (same tokens)."""
    modes = data.get("by_mode", {})

    def tok_s(mode: str) -> str:
        value = modes.get(mode, {}).get("step_tok_s")
        return f"{value:.1f}" if value is not None else "–"

    kind = "equal work (replayed lengths)" if data.get("equal_work") else "natural (different samples per mode)"
    rows = [f"{kind}; medians over steps and seeds", "",
            "| | step s | rollout s | response tok/s of the step | vs baseline (step s) |", "|---|---:|---:|---:|---:|"]
    if "trl_step_s" in data:
        rows.append(f"| TRL `GRPOTrainer` (transformers generate) | {data['trl_step_s']:.1f} | – | {tok_s('trl')} | "
                    f"{data['baseline_step_s'] / data['trl_step_s']:.2f}x |")
    rows.append(f"| tlt, no SD (baseline) | {data['baseline_step_s']:.1f} | {data['baseline_rollout_s']:.1f} | "
                f"{tok_s('baseline')} | 1.00x |")
    rows.append(f"| tlt, TLT mode (adaptive SD + spot training) | {data['tlt_step_s']:.1f} | {data['tlt_rollout_s']:.1f} | "
                f"{tok_s('tlt')} | {data['speedup_vs_baseline']:.2f}x |")
    rows.append("")
    rows.append(f"`speedup_vs_baseline` = **{data['speedup_vs_baseline']}**, `tok_s_ratio_vs_baseline` = "
                f"{data.get('tok_s_ratio_vs_baseline', 'not recorded')}, `speedup_vs_trl` = "
                f"**{data.get('speedup_vs_trl', 'not run')}**, `rollout_share_baseline` = {data['rollout_share_baseline']}, "
                f"long-tail share of the rollout (time with ≤ 25% of rows left) = {data['rollout_tail_share_baseline']}")
    return "\n".join(rows)


def update_phase_table(data: dict) -> str:
    rows = ["| | update phase s (wall) | CPU s | log-prob pass s | update s | peak RSS MB | peak over start MB |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for name in ("before", "after"):
        rows.append(f"| {name} | {data['update_phase_s'][name]:.1f} | {data['update_phase_cpu_s'][name]:.1f} | "
                    f"{data['score_s'][name]:.1f} | {data['update_s'][name]:.1f} | {data['peak_rss_mb'][name]} | "
                    f"{data['peak_over_start_mb'][name]} |")
    rows.append("")
    rows.append(f"`speedup` = **{data['speedup']}** (CPU time {data['speedup_cpu_time']}); loss "
                f"{data['loss']['before']:.3g} vs {data['loss']['after']:.3g} (|diff| {data['loss_abs_diff']:.1g}); grad norm "
                f"{data['grad_norm']['before']:.7f} vs {data['grad_norm']['after']:.7f}")
    return "\n".join(rows)


RENDERERS = (("rollout_throughput", rollout_table), ("speculative", speculative_table),
             ("adaptive", adaptive_table), ("spot_training", spot_table), ("e2e", e2e_table),
             ("e2e_replay", e2e_table), ("update_phase", update_phase_table))

if __name__ == "__main__":
    for name, render in RENDERERS:
        data = load(name)
        print(f"## {name}\n\n{render(data) if data else '(not run)'}\n")

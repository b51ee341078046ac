"""`tlt train` settings: small frozen sections, every field documented, YAML files plus `key=value` overrides.

Unknown keys are an error that lists the valid keys closest to the typo; values are type-checked, then every
choice and range (rl/config_checks.py).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tlt.rl.config_checks import validate
from tlt.rl.config_text import (ConfigError, FlowListDumper, UniqueKeyLoader, check_key, coerce, parse_text,
                                 yaml_problem)


@dataclass(frozen=True)
class ModelConfig:
    path: str | None = None        # HF directory, .gguf file, or None/'smollm2' for SmolLM2-135M-Instruct
    device: str | None = None      # None: CUDA when available, else CPU


@dataclass(frozen=True)
class TaskConfig:
    name: str = "arithmetic"       # "arithmetic" (built-in, graded difficulty), "jsonl" / "parquet" (a file) or
                                   # "hf" (a Hugging Face `datasets` dataset: needs the data extra)
    path: str | None = None        # jsonl/parquet: the file; hf: a save_to_disk directory, a .json/.jsonl/.parquet/
                                   # .csv file, or a local dataset directory that datasets.load_dataset reads
    split: str = "train"           # hf: the split, slices allowed ("train[:500]", "test")
    prompt_field: str = "question"  # the record field holding the prompt
    answer_field: str = "answer"   # ... and the reference answer (GSM8K's "... #### N" is reduced to N)
    system_prompt: str | None = None
    reward: str = "auto"           # "auto" (exact integer for arithmetic, math-verify otherwise) or "pkg.mod:fn"
    format_reward: float = 0.1     # extra reward when a final answer can be extracted (0 = off); the default
                                   # gives a 135M model a learning signal before it gets answers right
    min_operations: int = 1        # built-in task: easiest problems use this many operations
    max_operations: int = 4        # built-in task: hardest problems (the long tail of response lengths)
    eval_size: int = 0             # held-out problems (never trained on) scored with greedy decoding (0 = none);
                                   # a dataset's last eval_size rows (shuffle a file sorted by topic or difficulty)
    eval_every: int = 1            # evaluate every K steps and after the last one (with eval_size > 0)


@dataclass(frozen=True)
class RolloutConfig:
    prompts_per_step: int = 4      # distinct prompts per RL step
    samples_per_prompt: int = 4    # GRPO group size n
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_batch_size: int = 64       # rows decoded together by the engine
    dtype: str = "auto"            # decode precision: auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16, float16
    cuda_graphs: bool = True       # on CUDA, replay plain decode steps and whole speculative steps as CUDA graphs
    compile: str = "off"           # on CUDA: "inductor" / "max-autotune" compile what the graphs capture (fused
                                   # kernels: the decode forward and the speculative step's device part)
    kernels: str = "auto"          # "triton" (CUDA) fuses RoPE + KV write, attention, SiLU-and-multiply and the
                                   # sampler into one Triton kernel each, norms folded into the projections
                                   # (models/kernels.py); an alternative to compile. "auto": triton on CUDA
                                   # (compute capability 8.0+, compile off), torch's kernels elsewhere


@dataclass(frozen=True)
class GRPOConfig:
    loss: str = "grpo"             # "grpo" (sequence mean), "dapo" (token mean), "dr_grpo" (constant normalizer)
    clip_low: float = 0.2          # PPO ratio clip below 1
    clip_high: float = 0.2         # above 1 (DAPO uses 0.28)
    scale_rewards: bool = True     # divide advantages by the group std (False = Dr. GRPO)
    kl_coef: float = 0.0           # KL to the frozen initial policy (k3 estimator); 0 = no reference model
    updates_per_step: int = 1      # optimizer passes over each rollout (PPO epochs)
    # The PPO ratio's level: "token" (PPO/GRPO), or "sequence" (GSPO: a response's length-normalised ratio,
    # clipped as a whole; the GSPO paper clips it at 3e-4 / 4e-4: grpo.clip_low / clip_high). With one update a
    # step every ratio is 1 and both give the same gradient; they differ from a step's second pass on.
    importance_level: str = "token"
    # The rollout may sample from another numerical policy than the one trained (bf16 inference copy on CUDA vs
    # the fp32 master under autocast): per token, the policy-gradient term is weighted by
    # min(pi_train / pi_rollout, rollout_is_cap) ("truncate": truncated importance sampling, TRL's default with
    # vLLM and verl's TIS), or not ("off"). "auto": truncate when the rollout's numerics differ from the training
    # forward's (a rollout.dtype copy other than the weights', or optim.autocast bf16: the CUDA defaults), off when
    # both run the same weights at the same precision (the CPU's fp32 defaults: weights 1 to ~1e-6).
    # Needs rollout.top_k=0 and top_p=1 (the rollout's log-probs are then of the distribution trained).
    rollout_is: str = "auto"
    rollout_is_cap: float = 2.0    # the largest importance weight (>= 1)
    mask_truncated: bool = False   # responses cut at rollout.max_new_tokens add nothing to the loss (TRL's
                                   # mask_truncated_completions; grpo and dr_grpo still count them as sequences)
    overlong_buffer: int = 0       # DAPO's soft overlong punishment: a response within this many tokens of
                                   # rollout.max_new_tokens loses overlong_penalty * (its way into the buffer),
                                   # the whole penalty at the budget (0 = off)
    overlong_penalty: float = 1.0  # ... the most it loses


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0      # AdamW decay of the weight matrices (norm weights and biases never decay)
    betas: tuple[float, float] = (0.9, 0.99)
    micro_batch_size: int = 4      # sequences per forward/backward; gradients accumulate over the step
    micro_batch_tokens: int | str = "auto"  # or group sequences by padded tokens (rows x the longest row) up to
                                   # this budget, a longer row alone: 0 = off (micro_batch_size rows). "auto":
                                   # on CUDA, micro_batch_size rows at the longest possible length (the batch's
                                   # longest prompt + rollout.max_new_tokens: the memory the worst case already
                                   # takes), so short rows share a micro-batch; off on the CPU
    grad_clip: float = 1.0         # max global grad norm (0 = off)
    schedule: str = "constant"     # lr per RL step: "constant" or "cosine" (to lr * min_lr_ratio), both after a
                                   # linear warm-up of warmup_steps
    warmup_steps: int = 0          # RL steps of linear warm-up (step k of it uses lr * (k + 1) / warmup_steps)
    min_lr_ratio: float = 0.0      # cosine: the final lr as a fraction of lr
    decay_steps: int = 0           # cosine: RL steps from the start to the end of the decay (0 = run.steps); set
                                   # it to extend a finished run's run.steps on --resume without changing its lrs
    grad_checkpointing: bool = False  # recompute activations in the backward (less memory, ~30% more compute)
    autocast: str = "auto"         # training and log-prob forwards: "bf16" (torch.autocast), "off" (the weights'
                                   # dtype), "auto" (bf16 on CUDA, off on CPU)


@dataclass(frozen=True)
class RunConfig:
    steps: int = 3
    seed: int = 0
    out_dir: str = "runs/default"
    checkpoint_every: int = 1      # save policy + optimizer + RNG every K steps (0 = only at the end)
    keep_checkpoints: int = 2      # keep the newest N checkpoints, delete older ones (0 = keep all)
    save_optimizer: bool = True    # include the optimizer state (2x the policy's size); without it a resumed
                                   # run starts a fresh optimizer (with a warning)
    logger: tuple[str, ...] = ("jsonl", "tensorboard")  # step metrics go to: "jsonl" (RUN_DIR/metrics.jsonl,
                                   # always written: tlt report and --resume read it), "tensorboard" (when installed),
                                   # "wandb" (the wandb extra; WANDB_MODE=offline works without a network);
                                   # a list or a comma string ("jsonl,wandb")
    tensorboard: bool = True       # false drops tensorboard from run.logger (an older switch, kept)
    wandb_project: str = "tlt-rl"  # wandb: the project
    wandb_run_name: str | None = None  # wandb: the run's name (default: the name of run.out_dir)
    speculative: str = "adaptive"  # "adaptive" (TLT: batch-size gate + bandit over strategies), "static" (SD
                                   # with `strategy` at batch <= gate) or "off" (the baseline: no SD)
    drafter: str | None = None     # drafter directory (tlt drafter warmup); none: spot training (workers >= 2)
                                   # trains one from scratch
    draft_vocab: int = 8192        # tokens a drafter trained from scratch can propose: the task prompts' most frequent
                                   # (topped up with the lowest ids); 0 = the whole vocabulary (a draft pass and a
                                   # training step cost several times more). A given run.drafter keeps its own
    strategy: str = "S4K2N8"       # static mode's strategy, and one of adaptive mode's arms: depth S, branching
                                   # K, tree size N (target-only, e.g. S4K2N8) or SxKy[Nz]q (q-sampling: S5K1q)
    gate: int | str = "auto"       # speculate only while the running batch is at most this: an integer, or
                                   # "auto" (derived from a cost curve measured once on this device and cached)
    workers: int | str = "auto"    # rollout workers (policy replicas); prompts are sharded across them. "auto":
                                   # one per device: per GPU on CUDA, 1 on the CPU (all its cores)
    gpus_per_worker: float = 1.0   # GPU share of each worker, in (0, 1]: 0.5 puts two workers on each GPU
    backend: str = "auto"          # "ray", "inprocess" (threads of this process) or "auto" (Ray if installed
                                   # and workers > 1)
    threads_per_worker: int = 0    # CPU threads per worker (0 = cores // workers)
    spot_training: bool = True     # train the drafter on workers idle in the long tail (speculative modes)
    tail_training: str = "auto"    # one worker: train the drafter beside the rollout's long tail on its own device
                                   # (a background thread, a second CUDA stream): "auto" (= on), "on", "off"
    tail_decode_priority: bool = True  # CUDA, with tail training: the rollout decodes on a high-priority stream, so
                                   # the trainer's kernels take what decoding leaves of the GPU (not yet measured)
    publish_every: int = 10        # drafter optimizer steps between published versions (hot-swapped mid-rollout)
    swap_poll_s: float = 0.2       # how often a rolling-out worker checks for a newer drafter
    drafter_lr: float = 1e-3       # for a drafter trained from scratch; one warmed without its optimizer state loses
                                   # acceptance at more than the lr its warm-up ended at (1e-4 for the committed
                                   # drafter: docs/benchmarks.md §7)
    drafter_lr_ramp: int = 20      # a warmed drafter's fresh optimizer ramps its lr up over this many steps (AdamW's
                                   # first steps move every weight by ~lr: a kick); 0: none
    publish_gate: bool = True      # publish a spot-trained drafter version only when it beats the serving one on
                                   # held-out features (every 8th sample kept out of training; drafter/gate.py)
    drafter_cuda_graph: bool = False  # on CUDA, capture the drafter's training micro-step as one CUDA graph: a few
                                   # launches beside the decode loop instead of ~170 (drafter/step_graph.py; not yet
                                   # measured on a GPU, hence off)
    drafter_buffer_tokens: int = 200_000  # feature budget of the drafter's training data (oldest evicted)
    drafter_unroll: int = 1        # levels of drafting the drafter trains on per pair: 1 = teacher forcing on the
                                   # target's features; more also feeds it its own, as its deeper drafts are
                                   # (drafter/unroll.py; each level costs about one more pass)


@dataclass(frozen=True)
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def _key_elsewhere(self, name: str) -> str | None:
        """The key a name not in its section most likely means: the same name in another section (`lr` under
        grpo), or what TRL and verl call it (`learning_rate`: difflib finds no `lr` in it; found by QA)."""
        for section in _section_names():
            if name in {f.name for f in dataclasses.fields(getattr(self, section))}:
                return f"{section}.{name}"
        if name in OTHER_LIBRARIES_NAMES:
            return f"{OTHER_LIBRARIES_NAMES[name]} (tlt's name for {name})"
        return None

    def override(self, key: str, value, *, text: bool = False) -> "TrainConfig":
        """Set `section.key`. text=True: `value` is command-line text, parsed as YAML except for string fields,
        which take it verbatim (YAML would turn `off`, `no` or `1e-3` into other types)."""
        section_name, _, name = key.partition(".")
        if not name:
            raise ConfigError(f"config key {key!r} needs a section: one of {', '.join(_section_names())}")
        section = getattr(self, check_key(section_name, _section_names(), "section"))
        fields = {f.name: f for f in dataclasses.fields(section)}
        if name not in fields and (elsewhere := self._key_elsewhere(name)):
            raise ConfigError(f"unknown config key in [{section_name}] {key!r}; did you mean {elsewhere}?")
        name = check_key(name, list(fields), f"key in [{section_name}]", prefix=f"{section_name}.")
        annotation = typing.get_type_hints(type(section))[name]
        if text:
            try:
                value = parse_text(value, annotation)
            except yaml.YAMLError as error:
                raise ConfigError(f"{key}={value}: not a value YAML can read ({yaml_problem(error)})") from None
        coerced = coerce(key, value, annotation)
        return dataclasses.replace(self, **{section_name: dataclasses.replace(section, **{name: coerced})})


# what TRL's GRPOConfig (and transformers' TrainingArguments) and verl call keys of tlt's, for the unknown-key error
OTHER_LIBRARIES_NAMES = {
    "learning_rate": "optim.lr", "num_generations": "rollout.samples_per_prompt", "n": "rollout.samples_per_prompt",
    "max_completion_length": "rollout.max_new_tokens", "max_response_length": "rollout.max_new_tokens",
    "response_length": "rollout.max_new_tokens", "beta": "grpo.kl_coef", "kl_loss_coef": "grpo.kl_coef",
    "epsilon": "grpo.clip_low", "clip_ratio": "grpo.clip_low", "clip_ratio_low": "grpo.clip_low",
    "epsilon_high": "grpo.clip_high", "clip_ratio_high": "grpo.clip_high", "num_iterations": "grpo.updates_per_step",
    "ppo_epochs": "grpo.updates_per_step", "loss_type": "grpo.loss", "max_grad_norm": "optim.grad_clip",
    "importance_sampling_level": "grpo.importance_level",
    "lr_scheduler_type": "optim.schedule", "gradient_checkpointing": "optim.grad_checkpointing",
    "per_device_train_batch_size": "optim.micro_batch_size", "ppo_micro_batch_size": "optim.micro_batch_size",
    "max_steps": "run.steps", "total_training_steps": "run.steps", "train_batch_size": "rollout.prompts_per_step",
    "output_dir": "run.out_dir", "report_to": "run.logger", "save_steps": "run.checkpoint_every",
    "save_total_limit": "run.keep_checkpoints", "model_name_or_path": "model.path", "dataset_name": "task.path",
}

def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Defaults, then the YAML file (nested sections), then `section.key=value` overrides."""
    config = TrainConfig()
    if path is not None:
        path = Path(path)
        if not path.exists():
            section = str(path).partition(".")[0]
            hint = f" (an override needs a value: {path}=VALUE)" if section in _section_names() else ""
            raise ConfigError(f"config file not found: {path}{hint}")
        if path.is_dir():
            raise ConfigError(f"{path} is a directory, not a YAML config file")
        try:
            data = yaml.load(path.read_text(encoding="utf-8"), Loader=UniqueKeyLoader) or {}
        except UnicodeDecodeError:
            raise ConfigError(f"{path}: not a YAML config file (not UTF-8 text)") from None
        except yaml.YAMLError as error:
            raise ConfigError(f"{path}: not valid YAML ({yaml_problem(error)})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of sections, got {type(data).__name__}")
        for section, values in data.items():
            if not isinstance(values, dict):
                elsewhere = config._key_elsewhere(str(section)) if section not in _section_names() else None
                hint = f" ({section!r} is no section: did you mean {elsewhere}, under its section?)" \
                    if elsewhere else ""
                raise ConfigError(f"{path}: section {section!r} must be a mapping of keys to values{hint}")
            for name, value in values.items():
                config = config.override(f"{section}.{name}", value)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        if key.strip() in PATHS_NEVER_EMPTY and not raw.strip():
            raise ConfigError(f"{key.strip()}= is empty (an unset shell variable?): give a path, or leave the "
                              f"override out for the default")
        config = config.override(key.strip(), raw.strip(), text=True)
    return validate(resolve_loggers(expand_home(config)))


# Paths whose empty override (`model.path=$MODEL`, the variable unset) would silently mean the default model or
# no file: refused on the command line (a YAML `path:` with no value is written on purpose)
PATHS_NEVER_EMPTY = ("model.path", "task.path", "run.drafter")


def resolve_loggers(config: TrainConfig) -> TrainConfig:
    """run.logger and run.tensorboard made to agree, so that --print-config shows what the run writes:
    run.tensorboard=false drops tensorboard from run.logger (leaving jsonl, always written, when nothing else is
    left), and run.tensorboard says whether run.logger names it."""
    run = config.run
    names = tuple(name for name in run.logger if run.tensorboard or name != "tensorboard")
    names = names or run.logger and ("jsonl",)  # only tensorboard, switched off; an empty list stays an error
    return dataclasses.replace(config, run=dataclasses.replace(run, logger=names,
                                                               tensorboard="tensorboard" in names))


PATH_KEYS = (("model", "path"), ("run", "out_dir"), ("run", "drafter"), ("task", "path"))


def expand_home(config: TrainConfig) -> TrainConfig:
    """`~` in a path key means the home directory, as in a shell (from a YAML file no shell expands it: runs went
    to a directory literally named `~`)."""
    for section, key in PATH_KEYS:
        value = getattr(getattr(config, section), key)
        if isinstance(value, str) and value.startswith("~"):
            expanded = str(Path(value).expanduser())
            config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section),
                                                                                  **{key: expanded})})
    return config


def config_yaml(config: TrainConfig) -> str:
    """The full config as YAML that `load_config` reads back to an equal config (`tlt train --print-config`)."""
    sections = {name: {key: list(value) if isinstance(value, tuple) else value for key, value in values.items()}
                for name, values in config.to_dict().items()}
    return yaml.dump(sections, Dumper=FlowListDumper, sort_keys=False, width=120)


def _section_names() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]

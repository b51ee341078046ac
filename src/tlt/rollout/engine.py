"""RolloutEngine: continuous batching over a preallocated KV cache, the public face of the rollout.

One loop, after nano-vllm: the scheduler (rollout/scheduler.py) admits queued samples while rows are free, the
model runner (rollout/model_runner.py) prefills their prompts (one prefill per prompt, shared by its n samples)
and decodes every running row, plain or speculative as the speculation policy decides, and the scheduler
retires finished rows (the last running row moves into the hole, so running rows stay a dense, zero-copy slice
of the cache). The per-step trace makes the long tail visible: the batch drains while a few long responses
keep decoding.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import torch

from tlt.errors import RequestError
from tlt.models.attention import keep_cudnn_attention_out
from tlt.models.kernel_choice import kernels_problem, resolve_kernels
from tlt.models.lean_forward import LeanForward
from tlt.models.loading import LoadedModel
from tlt.models.eagle import EagleDrafter
from tlt.models.loading import eos_token_ids as eos_token_ids_of
from tlt.models.rollout_copy import RolloutCopy
from tlt.rollout.graph_runner import GraphRunner
from tlt.rollout.in_flight import merge_hists
from tlt.rollout.model_runner import ModelRunner, check_branching
from tlt.rollout.policy import OFF, PolicyError, SpeculationPolicy, as_policy, policy_strategies
from tlt.rollout.request import Request, RolloutResult, StepTrace, check_fits
from tlt.rollout.scheduler import Scheduler
from tlt.rollout.sequence import Sequence
from tlt.sampling import is_integer, token_ids
from tlt.speculative.decoder import SpeculativeDecoder
from tlt.speculative.strategy import SpecStrategy

log = logging.getLogger(__name__)


class RolloutEngine:
    """Generates responses for many requests with continuous batching.

    model: a transformers Llama/Qwen2/Qwen3 causal LM (or a `LoadedModel`); its parameters are used in place.
    max_batch_size: rows decoded together; further samples wait in the queue and join as rows free up.
    eos_token_ids: default stop tokens for requests that give none (default: the model's EOS tokens).
    drafter: an `EagleDrafter` for speculative decoding (attached to this model on construction).
    speculation: when and how to speculate, decided before every decode step: None (never), a `SpecStrategy`
        or its name ("S5K1q": always) or a `SpeculationPolicy` (rollout/policy.py: `FixedSpeculation(strategy,
        gate=8)`, `AdaptiveSpeculation(strategies)`, both taking names too, or your own).
    dtype: the rollout precision: "auto" (bf16 on CUDA, the model's own dtype elsewhere), a torch dtype or its
        name. A dtype other than the model's decodes from a `RolloutCopy` refreshed at every `generate()`.
    cuda_graphs: replay decode and verification steps as CUDA graphs (default: on CUDA).
    compile: "off" (default), "inductor" or "max-autotune": Inductor-compile the forward the CUDA graphs capture
        (fused kernels, fewer launches; `LeanForward.compile`). Needs CUDA graphs.
    kernels: "auto" (default), "torch" or "triton": the fused Triton kernels of models/kernels.py for RoPE with
        the KV write, attention and SiLU-and-multiply in decode, verify and drafter forwards
        (`LeanForward.use_kernels`), norms folded into a rollout copy's projections, and the fused sampler for
        every draw. Needs CUDA; an alternative to compile. "auto": Triton's on CUDA (compute capability 8.0+,
        Triton installed, compile off), torch's elsewhere (`resolve_kernels`); `engine.kernels` says which.
    """

    def __init__(self, model, *, max_batch_size: int = 64, eos_token_ids=None, drafter=None, speculation=None,
                 max_tree_size: int = 64, dtype="auto", cuda_graphs: bool | None = None, compile: str = "off",
                 kernels: str = "auto"):
        tokenizer = None
        if isinstance(model, LoadedModel):
            model, tokenizer = model.model, model.tokenizer
        if not isinstance(model, torch.nn.Module):
            raise RequestError(f"model must be a transformers causal LM or a LoadedModel (a path or name loads with "
                               f"tlt.models.load_model), got {type(model).__name__}")
        if not (is_integer(max_batch_size) and max_batch_size >= 1):
            raise RequestError(f"max_batch_size must be an integer >= 1, got {max_batch_size!r}")
        self.policy_forward = LeanForward(model)  # the master weights: training features, drafter training
        keep_cudnn_attention_out(self.policy_forward.device)
        dtype = resolve_rollout_dtype(dtype, self.policy_forward.device, self.policy_forward.dtype)
        problem = kernels_problem(kernels, self.policy_forward.device, compiled=compile != "off")
        if problem is not None:  # refused before anything is built for it
            raise RequestError(problem)
        kernels = resolve_kernels(kernels, self.policy_forward.device, compiled=compile != "off", dtype=dtype)
        self.kernels = kernels
        # With kernels="triton" the copy folds its norms into the fused projections (no norm kernel in a layer;
        # models/rollout_copy.py); not in fp16, whose range the un-normalized residual could leave. An engine that
        # decodes in the weights' own dtype makes no copy for it (memory, rollout_is): the kernels run over the
        # master's separate projections.
        fold = kernels == "triton" and dtype != torch.float16
        self.rollout_copy = RolloutCopy(model, dtype, fold_norms=fold) if dtype != self.policy_forward.dtype else None
        forward = self.policy_forward if self.rollout_copy is None else \
            LeanForward(self.rollout_copy.model, self.rollout_copy.fused)
        forward.use_kernels(kernels)
        self.model_runner = ModelRunner(forward, cuda_graphs=cuda_graphs, max_tree_size=max_tree_size)
        if compile != "off":
            if self.model_runner.graphs is None:
                why = ("this model is on the CPU: rollout.compile=off there" if forward.device.type != "cuda" else
                       "cuda_graphs is off, or the graphs cannot capture this model's RoPE (said in a warning "
                       "above): rollout.compile=off for it")
                raise RequestError(f"compile={compile!r} compiles the steps CUDA graphs capture, which needs a model "
                                   f"on CUDA with cuda_graphs on; {why}")
            forward.compile(compile)
        self.spec = forward.spec
        self.max_batch_size = max_batch_size
        self.eos_token_ids = self._stop_tokens(eos_token_ids, model, tokenizer)
        self.drafter = None  # before the speculation: its setter checks the strategies against the drafter
        self.drafter_version = None
        self.drafter_trained = True  # False: a drafter that never trained serves no step (see set_drafter)
        self.speculation = speculation  # normalized to a SpeculationPolicy (or None) by the property
        self.cost_curve = None  # set by whoever derived the gate from the device's cost curve (metrics show it)
        self.scheduler: Scheduler | None = None  # the running generate()'s (the last one's once it returns)
        self._generate_start = time.perf_counter()
        self._generating = threading.Lock()  # held by the running generate()
        # the wall time of the last call when it launched a step and landed none (`_drain` times that step when
        # it drains it: launch plus wait, what a waiting step costs); None otherwise
        self._launch_s: float | None = None
        # an arm chosen for a speculative step that did not run: the plain step drained before it stopped rows,
        # which are retired first (`_decode`); the next decode step takes it without asking the policy again
        self._held_arm = None
        if drafter is not None:
            self.set_drafter(drafter)

    def set_drafter(self, drafter, version: int | None = None, *, trained: bool = True) -> None:
        """Use (or hot-swap to) this drafter; its state is rebuilt from the cached features at the next SD step.

        Safe between decode steps of a running generate() (see `between_steps`): the drafter's KV cache is
        rebuilt from the target features kept per slot, so no target forward is repeated. An engine built without a
        drafter keeps no such features: a drafter attached to it mid-rollout serves from the next generate().
        `version` is recorded in each sample's `drafter_versions` when this drafter serves it. trained=False: a
        drafter at its random initialization, whose drafts are accepted at chance (τ ≈ 1.0), so every speculative
        step would cost more than a plain one: the engine decodes plainly until a trained one is set."""
        if not isinstance(drafter, EagleDrafter):
            raise RequestError(f"drafter must be an EagleDrafter (a drafter directory loads with "
                               f"EagleDrafter.load(directory, model)), got {type(drafter).__name__}")
        for strategy in policy_strategies(self.speculation):  # refused here, not at the bandit's first wide arm
            check_branching(strategy, drafter)
        self.model_runner.set_drafter(drafter)  # first: a drafter it refuses leaves the engine as it was
        self.drafter_version = version
        self.drafter_trained = trained
        self.drafter = drafter  # the caller's, in its own dtype: what a worker reloads and publishes

    def _stop_tokens(self, eos_token_ids, model, tokenizer) -> tuple[int, ...]:
        """The default stop tokens: the model's EOS tokens, or ids given (each inside the vocabulary)."""
        if eos_token_ids is None:
            return tuple(eos_token_ids_of(model, tokenizer))
        if is_integer(eos_token_ids):  # one id
            eos_token_ids = (eos_token_ids,)
        ids = token_ids(eos_token_ids, "eos_token_ids")
        outside = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if outside:
            raise RequestError(f"eos_token_ids {outside} are outside the vocabulary (0..{self.spec.vocab_size - 1})")
        return ids

    @property
    def speculation(self) -> SpeculationPolicy | None:
        """The policy deciding each decode step (None: plain decoding only)."""
        return self._speculation

    @speculation.setter
    def speculation(self, value) -> None:
        policy = as_policy(value)
        for strategy in policy_strategies(policy):  # too large a tree fails here, not at its first step
            self.model_runner.check_tree_room(strategy)
            if self.drafter is not None:
                check_branching(strategy, self.drafter)
        self._speculation = policy

    # -- the model side, as the model runner holds it ----------------------------------------------------------

    @property
    def forward(self) -> LeanForward:
        """The rollout forward (the policy's own, or its rollout-precision copy)."""
        return self.model_runner.forward

    @property
    def runner(self) -> GraphRunner | None:
        """The CUDA-graph runner (None: eager steps); tests swap in a non-capturing one."""
        return self.model_runner.graphs

    @runner.setter
    def runner(self, value: GraphRunner | None) -> None:
        self.model_runner.graphs = value

    @property
    def spec_decoder(self) -> SpeculativeDecoder | None:
        return self.model_runner.spec_decoder

    @property
    def max_tree_size(self) -> int:
        return self.model_runner.max_tree_size

    @max_tree_size.setter
    def max_tree_size(self, value: int) -> None:
        previous, self.model_runner.max_tree_size = self.model_runner.max_tree_size, value
        try:
            for strategy in policy_strategies(self.speculation):
                self.model_runner.check_tree_room(strategy)
        except RequestError:
            self.model_runner.max_tree_size = previous
            raise

    @property
    def device(self) -> torch.device:
        return self.forward.device

    # -- where generate() stands (read in between_steps) -------------------------------------------------------

    @property
    def running_rows(self) -> int:
        return 0 if self.scheduler is None else self.scheduler.running_rows

    @property
    def waiting_samples(self) -> int:
        return 0 if self.scheduler is None else self.scheduler.waiting_samples

    # -- the loop ----------------------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, requests: list[Request], *, progress: bool = False, between_steps=None,
                 collect_features=None) -> RolloutResult:
        """Sample every request's n responses.

        between_steps(engine), if given, is called before every decode step: the place to hot-swap the drafter
        (`set_drafter`) mid-rollout (a plain step may still be in flight on a GPU, its tokens not yet appended:
        plain steps read no drafter weights); `engine.running_rows` and `engine.waiting_samples`
        say where the rollout stands (the long tail: nothing waits and few rows run).
        collect_features(tokens, features), if given (an engine with a drafter), receives each finished sample's
        target features as the rollout computed them, before its cache row is reused: tokens [T] (the last
        prompt token and the response but its last token, which was never fed) and the final normed hidden
        states [T, H] at those positions, on the device — drafter training data at no extra forward.

        One generate() at a time per engine: it owns the engine's cache and scheduler. A second call (from another
        thread, or from a between_steps hook) is refused; it corrupted the first one's rows, or never ended."""
        if isinstance(requests, Request):
            raise RequestError("generate takes a list of Request: pass [request]")
        if not isinstance(requests, list):  # a tuple, a generator: each request is read once, here
            try:
                requests = list(requests)
            except TypeError:
                raise RequestError(f"generate takes a list of Request, got {type(requests).__name__}") from None
        if not self._generating.acquire(blocking=False):
            raise RequestError("this engine is already generating (another thread, or a between_steps hook): one "
                               "generate() at a time per engine; give each thread its own engine")
        try:
            return self._generate(requests, progress, between_steps, collect_features)
        finally:
            self._generating.release()

    def _generate(self, requests, progress, between_steps, collect_features) -> RolloutResult:
        start = self._generate_start = time.perf_counter()
        self._held_arm = self._launch_s = None  # (a generate() that raised may have left them)
        self._validate(requests)
        if self.speculation is not None and self.spec_decoder is None and between_steps is None:
            # (with between_steps a drafter may be attached mid-rollout, for the next generate())
            log.warning("speculation is set but the engine has no drafter: decoding without speculation "
                        "(pass drafter= or call set_drafter first)")
        if collect_features is not None and self.spec_decoder is None:
            raise RequestError("collect_features needs an engine with a drafter (only then are features kept)")
        if self.rollout_copy is not None:  # the policy changed since the last rollout: one device-to-device copy
            self.rollout_copy.refresh()
        scheduler = self.scheduler = Scheduler(requests, self.max_batch_size, self.eos_token_ids)
        self.model_runner.allocate(scheduler.max_rows, scheduler.max_len)
        steps: list[StepTrace] = []
        bar = _progress_bar(sum(r.n for r in requests), progress)
        while not scheduler.done:
            groups = scheduler.admit()
            if groups:
                self._prefill(groups, steps)
                self._retire(bar, collect_features)  # a sample may end on its first token
            if scheduler.running:
                if between_steps is not None:
                    between_steps(self)
                self._decode(scheduler.running, steps)
                self._retire(bar, collect_features)
        self._drain(steps)  # (every sample finished, so nothing is in flight: a guard)
        if bar is not None:
            bar.close()
        return RolloutResult(scheduler.outputs(), steps, time.perf_counter() - start)

    def _validate(self, requests: list[Request]) -> None:
        if not requests:
            raise RequestError("no requests to generate")
        for index, request in enumerate(requests):
            if not isinstance(request, Request):
                raise RequestError(f"requests[{index}] is a {type(request).__name__}, expected tlt Request")
            check_fits(request, self.spec.vocab_size, self.spec.max_positions, request.label or f"requests[{index}]",
                       self.spec.context_note)

    def _prefill(self, groups: list[list[Sequence]], steps: list[StepTrace]) -> None:
        """The admitted groups take the rows after the running ones, each with its first token."""
        self._drain(steps)
        self._held_arm = None  # chosen for the batch before these rows joined
        started = time.perf_counter()
        new = self.model_runner.prefill(groups, first_row=self.scheduler.running_rows)
        self.scheduler.start(new)
        steps.append(StepTrace("prefill", len(groups), len(new), time.perf_counter() - started,
                               start_s=started - self._generate_start))

    def _decode(self, running: list[Sequence], steps: list[StepTrace]) -> None:
        """One decode step of every running row, speculative when the policy picks an arm."""
        arm, self._held_arm = self._held_arm, None
        if arm is None or self.model_runner.serving is None or not self.drafter_trained:
            arm = self._choose(len(running))
        strategy = None if arm in (None, "off") else arm
        if not self.model_runner.continues(running, strategy):
            self._drain(steps)  # the step in flight first: its time is its own
            if strategy is not None and any(seq.finish_reason is not None for seq in running):
                # rows it stopped would take a whole speculative row-step for nothing (and lower the arm's τ):
                # retired first, as a waiting engine does, then this arm serves the rows left (found by review)
                self._held_arm = arm
                return
        started = time.perf_counter()
        warmups = self.model_runner.warmups
        if strategy is not None:  # `_choose` picks one only when a drafter can serve this step
            served = [seq for seq in running if seq.finish_reason is None]
            trace = self.model_runner.speculative_step(running, strategy, overlap=True)
            if self.drafter_version is not None:
                for seq in served:
                    seq.drafter_versions.add(self.drafter_version)
        else:
            # the tokens that landed: an overlapped step's are the step before's (a stopped row's extra one dropped)
            landed = self.model_runner.decode(running)
            trace = StepTrace("decode", len(running), landed.tokens, 0.0, landed=landed.steps)
        trace = dataclasses.replace(trace, wall_s=time.perf_counter() - started, start_s=started - self._generate_start)
        steps.append(trace)
        timed = self.model_runner.warmups == warmups
        self._launch_s = trace.wall_s if trace.landed == 0 and timed else None
        if self.speculation is not None:
            # A step that captured a graph or rebuilt a drafter state timed one-off work, not its arm: its tokens
            # count, its wall time does not; nor does that of a call that landed no step (an overlapped step's
            # first: timed when drained, if it is) or two (the one that ends a lag).
            self.speculation.observe(trace.batch_size, arm if arm is not None else "off", trace.new_tokens,
                                     trace.wall_s, verify_steps=trace.batch_size * trace.landed,
                                     timed=timed and trace.landed == 1)

    def _drain(self, steps: list[StepTrace]) -> None:
        """Append the step in flight (if any), counted to the step that launched it, and observed for its arm
        (a speculative one's, or "off"): its tokens, and its time when the call before launched it alone (that
        call's time plus this wait: what a waiting step costs; an arm tried for one step, as ε-exploration
        does, is timed so)."""
        launch_s, self._launch_s = self._launch_s, None
        started = time.perf_counter()
        landed = self.model_runner.drain()
        drain_s = time.perf_counter() - started
        if landed.steps and steps and steps[-1].kind == "decode":
            last = steps[-1]
            steps[-1] = dataclasses.replace(last, new_tokens=last.new_tokens + landed.tokens,
                                            landed=last.landed + landed.steps,
                                            accepted_hist=merge_hists(last.accepted_hist, landed.accepted_hist))
        if landed.steps and self.speculation is not None and steps:
            timed = launch_s is not None and landed.steps == 1
            arm = landed.arm if landed.arm is not None else OFF
            self.speculation.observe(steps[-1].batch_size, arm, landed.tokens, (launch_s or 0.0) + drain_s,
                                     verify_steps=steps[-1].batch_size, timed=timed)

    def _choose(self, batch_size: int):
        if self.speculation is None or self.model_runner.serving is None or not self.drafter_trained:
            return None
        arm = self.speculation.choose(batch_size)
        if arm not in (None, OFF) and not isinstance(arm, SpecStrategy):  # would fail deep inside the step
            raise PolicyError(f"{type(self.speculation).__name__}.choose returned {arm!r}: a policy returns a "
                              f"SpecStrategy (SpecStrategy.parse for a name), None or {OFF!r}")
        return arm

    def _retire(self, bar, collect_features) -> None:
        retired = self.scheduler.retire(self.model_runner, collect_features)
        if bar is not None and retired:
            bar.update(retired)


def resolve_rollout_dtype(dtype, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" -> bf16 on CUDA (decode streams half the bytes), else the model's dtype (bf16 matmuls are slow on
    most CPUs); a name ("bfloat16", "float32", ...) or a torch dtype as given."""
    if dtype == "auto" or dtype is None:
        return torch.bfloat16 if device.type == "cuda" else model_dtype
    resolved = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise RequestError(f"rollout dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
    return resolved


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="sample")

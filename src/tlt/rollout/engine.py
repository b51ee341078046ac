"""RolloutEngine: continuous batching over a preallocated KV cache.

One loop: admit queued samples while rows are free (one prefill per prompt, shared by its n samples), decode
one token for every running row, retire finished rows (the last running row moves into the hole, so running
rows stay a dense, zero-copy slice of the cache). The per-step trace makes the long tail visible: the batch
drains while a few long responses keep decoding.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from tlt.errors import RequestError
from tlt.models.kv_cache import KVCache
from tlt.models.lean_forward import LeanForward
from tlt.models.loading import LoadedModel
from tlt.models.loading import eos_token_ids as eos_token_ids_of
from tlt.models.rollout_copy import RolloutCopy
from tlt.rollout.model_runner import GraphRunner, batch_bucket
from tlt.rollout.policy import SpeculationPolicy, as_policy
from tlt.rollout.request import Request, RolloutResult, SampleOutput, StepTrace
from tlt.sampling import RowSampling, draw_uniforms, sample_generator, sample_next
from tlt.speculative.decoder import SpeculativeDecoder

PREFILL_TOKEN_BUDGET = 8192  # padded prompt tokens per prefill forward: bounds its activation memory


@dataclass
class _Sequence:
    """A sample in flight. Its cache row holds prompt + tokens[:-1]; tokens[-1] is the next input."""

    request_index: int
    sample_index: int
    request: Request
    stop_ids: frozenset
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    drafter_versions: set = field(default_factory=set)

    def append(self, token: int, logprob: float) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            self.finish_reason = "stop"
        elif len(self.tokens) >= self.request.params.max_new_tokens:
            self.finish_reason = "length"

    def output(self) -> SampleOutput:
        return SampleOutput(self.request_index, self.sample_index, self.request.prompt_ids, self.tokens,
                            self.logprobs, self.finish_reason, tuple(sorted(self.drafter_versions)))


@dataclass
class _Pending:
    """Samples [first, first + count) of a request, not yet admitted."""

    request_index: int
    first: int
    count: int


class RolloutEngine:
    """Generates responses for many requests with continuous batching.

    model: a transformers Llama/Qwen2/Qwen3 causal LM (or a `LoadedModel`); its parameters are used in place.
    max_batch_size: rows decoded together; further samples wait in the queue and join as rows free up.
    eos_token_ids: default stop tokens for requests that give none (default: the model's EOS tokens).
    drafter: an `EagleDrafter` for speculative decoding (attached to this model on construction).
    speculation: when and how to speculate, decided before every decode step: None (never), a `SpecStrategy`
        (always) or a `SpeculationPolicy` (rollout/policy.py: `FixedSpeculation(strategy, gate=8)`,
        `AdaptiveSpeculation(strategies)`, or your own).
    dtype: the rollout precision: "auto" (bf16 on CUDA, the model's own dtype elsewhere), a torch dtype or its
        name. A dtype other than the model's decodes from a `RolloutCopy` refreshed at every `generate()`.
    cuda_graphs: replay decode and verification steps as CUDA graphs (default: on CUDA).
    """

    def __init__(self, model, *, max_batch_size: int = 64, eos_token_ids=None, drafter=None, speculation=None,
                 max_tree_size: int = 64, dtype="auto", cuda_graphs: bool | None = None):
        tokenizer = None
        if isinstance(model, LoadedModel):
            model, tokenizer = model.model, model.tokenizer
        if max_batch_size < 1:
            raise RequestError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.policy_forward = LeanForward(model)  # the master weights: training features, drafter training
        dtype = resolve_rollout_dtype(dtype, self.policy_forward.device, self.policy_forward.dtype)
        self.rollout_copy = RolloutCopy(model, dtype) if dtype != self.policy_forward.dtype else None
        self.forward = self.policy_forward if self.rollout_copy is None else \
            LeanForward(self.rollout_copy.model, self.rollout_copy.fused)
        use_graphs = self.forward.device.type == "cuda" if cuda_graphs is None else cuda_graphs
        if use_graphs and self.forward.device.type != "cuda":
            raise RequestError("cuda_graphs=True needs a model on CUDA")
        self.runner = GraphRunner(self.forward) if use_graphs else None
        self.spec = self.forward.spec
        self.max_batch_size = max_batch_size
        self.eos_token_ids = tuple(eos_token_ids if eos_token_ids is not None else eos_token_ids_of(model, tokenizer))
        self._cache: KVCache | None = None
        self.speculation = speculation  # normalized to a SpeculationPolicy (or None) by the property
        self.max_tree_size = max_tree_size
        self.spec_decoder = None
        self.drafter = None
        self.drafter_version = None
        self.cost_curve = None  # set by whoever derived the gate from the device's cost curve (metrics show it)
        self.running_rows = self.waiting_samples = 0  # where generate() stands (read in between_steps)
        self._generate_start = time.perf_counter()
        if drafter is not None:
            self.set_drafter(drafter)

    def set_drafter(self, drafter, version: int | None = None) -> None:
        """Use (or hot-swap to) this drafter; its state is rebuilt from the cached features at the next SD step.

        Safe between decode steps of a running generate() (see `between_steps`): the drafter's KV cache is
        rebuilt from the target features kept per slot, so no target forward is repeated. `version` is recorded
        in each sample's `drafter_versions` when this drafter serves it."""
        self.drafter_version = version
        self.drafter = drafter  # the caller's, in its own dtype: what a worker reloads and publishes
        current = self.spec_decoder
        if current is not None and self.runner is not None and _same_layout(current.drafter, drafter):
            # Captured graphs read the serving drafter's tensors: load the new weights into them in place.
            current.drafter.load_state_dict(drafter.state_dict())
            if current.cache is not None:
                current.cache.lengths.zero_()
            return
        if self.runner is not None or drafter.fc.weight.dtype != self.forward.dtype:
            drafter = drafter.inference_copy(self.forward)  # the caller's drafter (maybe in training) is untouched
        self.spec_decoder = SpeculativeDecoder(self.forward, drafter.attach(self.forward))
        if current is not None and current.cache is not None:
            self.spec_decoder.cache = current.cache
            current.cache.lengths.zero_()

    @property
    def speculation(self) -> SpeculationPolicy | None:
        """The policy deciding each decode step (None: plain decoding only)."""
        return self._speculation

    @speculation.setter
    def speculation(self, value) -> None:
        self._speculation = as_policy(value)

    @property
    def device(self) -> torch.device:
        return self.forward.device

    @torch.no_grad()
    def generate(self, requests: list[Request], *, progress: bool = False, between_steps=None,
                 collect_features=None) -> RolloutResult:
        """Sample every request's n responses.

        between_steps(engine), if given, is called before every decode step with no forward in flight: the place
        to hot-swap the drafter (`set_drafter`) mid-rollout; `engine.running_rows` and `engine.waiting_samples`
        say where the rollout stands (the long tail: nothing waits and few rows run).
        collect_features(tokens, features), if given (an engine with a drafter), receives each finished sample's
        target features as the rollout computed them, before its cache row is reused: tokens [T] (the last
        prompt token and the response but its last token, which was never fed) and the final normed hidden
        states [T, H] at those positions, on the device — drafter training data at no extra forward."""
        start = self._generate_start = time.perf_counter()
        self._validate(requests)
        if collect_features is not None and self.spec_decoder is None:
            raise RequestError("collect_features needs an engine with a drafter (only then are features kept)")
        if self.rollout_copy is not None:  # the policy changed since the last rollout: one device-to-device copy
            self.rollout_copy.refresh()
        cache = self._cache_for(requests)
        queue = deque(_Pending(i, 0, r.n) for i, r in enumerate(requests))
        running: list[_Sequence] = []
        finished: list[_Sequence] = []
        steps: list[StepTrace] = []
        bar = _progress_bar(sum(r.n for r in requests), progress)
        while queue or running:
            if queue and len(running) < self.max_batch_size:
                self._admit(requests, queue, running, cache, steps)
            self._retire(running, cache, finished, bar, collect_features)
            if running:
                if between_steps is not None:
                    self.running_rows, self.waiting_samples = len(running), sum(p.count for p in queue)
                    between_steps(self)
                self._decode(running, cache, steps)
                self._retire(running, cache, finished, bar, collect_features)
        if bar is not None:
            bar.close()
        finished.sort(key=lambda s: (s.request_index, s.sample_index))
        return RolloutResult([s.output() for s in finished], steps, time.perf_counter() - start)

    # -- validation and cache -------------------------------------------------------------------------

    def _validate(self, requests: list[Request]) -> None:
        if not requests:
            raise RequestError("no requests to generate")
        for index, request in enumerate(requests):
            if not isinstance(request, Request):
                raise RequestError(f"requests[{index}] is a {type(request).__name__}, expected tlt Request")
            ids = request.prompt_ids
            if min(ids) < 0 or max(ids) >= self.spec.vocab_size:
                raise RequestError(f"requests[{index}]: prompt token id out of range [0, {self.spec.vocab_size})")
            total = len(ids) + request.params.max_new_tokens
            if total > self.spec.max_positions:
                raise RequestError(
                    f"requests[{index}]: prompt of {len(ids)} tokens + max_new_tokens "
                    f"{request.params.max_new_tokens} = {total} exceeds the model's context of "
                    f"{self.spec.max_positions} tokens (nothing is truncated: shorten the prompt or the budget)")

    def _cache_for(self, requests: list[Request]) -> KVCache:
        rows = min(self.max_batch_size, sum(r.n for r in requests))
        if self.runner is not None:  # a graph pads the batch to a bucket: its padded rows need cache rows
            rows = batch_bucket(rows, 1 << 30) or rows
        length = max(len(r.prompt_ids) + r.params.max_new_tokens for r in requests)
        if self.spec_decoder is not None:
            length += self.max_tree_size + 1  # a verified tree sits past the committed tokens
        cache = self._cache
        if cache is None or cache.max_rows < rows or cache.max_len < length:
            self._cache = None  # free the old buffers before allocating the new ones
            if self.runner is not None:
                self.runner.reset()
            cache = KVCache(self.spec, rows, length, device=self.device, dtype=self.forward.dtype)
            self._cache = cache
        if self.spec_decoder is not None:
            if "tokens" not in cache.slot_data:
                cache.add_slot_data("tokens", dtype=torch.long)
                cache.add_slot_data("features", (self.spec.hidden_size,), dtype=self.forward.dtype)
            self.spec_decoder.allocate(cache.max_rows, cache.max_len)
        cache.lengths.zero_()
        return cache

    # -- the three phases of a step -------------------------------------------------------------------

    def _admit(self, requests, queue: deque, running: list[_Sequence], cache: KVCache, steps) -> None:
        """Prefill the prompts of queued samples that fit; every sample of a prompt shares one prefill."""
        free = self.max_batch_size - len(running)
        groups: list[_Pending] = []
        while queue and free > 0:
            pending = queue[0]
            padded = max([len(requests[g.request_index].prompt_ids) for g in groups]
                         + [len(requests[pending.request_index].prompt_ids)]) * (len(groups) + 1)
            if groups and padded > PREFILL_TOKEN_BUDGET:
                break
            take = min(pending.count, free)
            groups.append(_Pending(pending.request_index, pending.first, take))
            if take == pending.count:
                queue.popleft()
            else:
                queue[0] = _Pending(pending.request_index, pending.first + take, pending.count - take)
            free -= take
        started = time.perf_counter()
        logits = self._prefill(requests, groups, len(running), cache)
        new = self._spawn(requests, groups, len(running), cache, logits)
        running.extend(new)
        steps.append(StepTrace("prefill", len(groups), len(new), time.perf_counter() - started,
                               start_s=started - self._generate_start))

    def _prefill(self, requests, groups: list[_Pending], first_row: int, cache: KVCache) -> torch.Tensor:
        """Run each group's prompt in its own row; returns next-token logits [G, V]."""
        prompts = [requests[g.request_index].prompt_ids for g in groups]
        lengths = torch.tensor([len(p) for p in prompts])
        ids = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, :len(prompt)] = torch.tensor(prompt)
        rows = cache.rows(first_row, len(groups))
        rows.lengths.zero_()
        ids = ids.to(self.device)
        out = self.forward(ids, rows, logits_at=(lengths - 1).to(self.device))
        self._store_slot_data(rows, ids, out.hidden)
        rows.advance(lengths)
        if self.spec_decoder is not None:
            self.spec_decoder.forget_rows(first_row, self.spec_decoder.cache.max_rows - first_row)
        return out.logits[:, 0]

    def _store_slot_data(self, rows, ids: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep token ids and target features of the tokens just written: the drafter is built from them."""
        if self.spec_decoder is None:
            return
        slots = rows.lengths.to(self.device)[:, None] + torch.arange(ids.shape[1], device=self.device)[None, :]
        rows.write_slots("tokens", slots, ids.to(self.device))
        rows.write_slots("features", slots, hidden)

    def _spawn(self, requests, groups: list[_Pending], first_row: int, cache: KVCache, logits) -> list[_Sequence]:
        """Create every group's sequences. Row order: the group leaders (rows first_row + g, prefilled), then
        the siblings of each group in turn, whose rows receive a copy of their leader's prompt KV."""
        leaders, siblings, leader_source, sibling_source = [], [], [], []
        next_row = first_row + len(groups)
        for g_index, group in enumerate(groups):
            request = requests[group.request_index]
            params = request.params
            stop = frozenset(params.stop_token_ids if params.stop_token_ids is not None else self.eos_token_ids)
            for k in range(group.count):
                sample_index = group.first + k
                generator = sample_generator(params.seed, group.request_index, sample_index)
                seq = _Sequence(group.request_index, sample_index, request, stop, generator)
                if k == 0:
                    leaders.append(seq)
                    leader_source.append(g_index)
                else:
                    siblings.append(seq)
                    sibling_source.append(g_index)
            cache.copy_prefix(first_row + g_index, list(range(next_row, next_row + group.count - 1)))
            next_row += group.count - 1
        new = leaders + siblings
        source = torch.tensor(leader_source + sibling_source, device=logits.device)
        self._sample_into(new, logits[source])
        return new

    def _decode(self, running: list[_Sequence], cache: KVCache, steps) -> None:
        started = time.perf_counter()
        arm = self._choose(len(running))
        strategy = None if arm in (None, "off") else arm
        if strategy is not None and self.spec_decoder is not None:
            trace = self._speculative_step(running, cache, strategy)
        else:
            self._plain_step(running, cache)
            trace = StepTrace("decode", len(running), len(running), 0.0)
        trace = dataclasses.replace(trace, wall_s=time.perf_counter() - started, start_s=started - self._generate_start)
        steps.append(trace)
        if self.speculation is not None:
            self.speculation.observe(trace.batch_size, arm if arm is not None else "off", trace.new_tokens,
                                     trace.wall_s, verify_steps=trace.batch_size)

    def _plain_step(self, running: list[_Sequence], cache: KVCache) -> None:
        rows = cache.rows(0, len(running))
        ids = torch.tensor([[s.tokens[-1]] for s in running])  # host: the forward or the graph's buffer copies it
        if self.runner is None:
            out = self.forward(ids, rows, logits_at="all")
            self._store_slot_data(rows, ids, out.hidden)
            rows.advance(1)
            self._sample_into(running, out.logits[:, 0])
            return
        settings = RowSampling.from_params([s.request.params for s in running], "cpu")  # copied into the graph
        uniforms = draw_uniforms([s.generator for s in running])
        tokens, logprobs, hidden = self.runner.decode(ids, rows, settings, uniforms)  # sampled inside the graph
        self._store_slot_data(rows, ids, hidden)
        rows.advance(1)
        _append(running, tokens, logprobs)

    def _choose(self, batch_size: int):
        if self.speculation is None or self.spec_decoder is None:
            return None
        return self.speculation.choose(batch_size)

    def _speculative_step(self, running: list[_Sequence], cache: KVCache, strategy) -> StepTrace:
        if max(strategy.tree_size, (strategy.depth - 1) * strategy.branching) > self.max_tree_size:
            raise RequestError(f"strategy {strategy.name} needs more than max_tree_size={self.max_tree_size} "
                               f"cache slots past the committed tokens; raise max_tree_size")
        if strategy.branching > self.spec_decoder.drafter.draft_vocab_size:
            raise RequestError(f"strategy {strategy.name} drafts {strategy.branching} children per node, but the "
                               f"drafter's vocabulary has only {self.spec_decoder.drafter.draft_vocab_size} tokens")
        rows = cache.rows(0, len(running))
        pending = torch.tensor([s.tokens[-1] for s in running])
        settings = RowSampling.from_params([s.request.params for s in running], "cpu")
        uniforms = draw_uniforms([s.generator for s in running], strategy.uniforms_per_row)
        outcome = None
        if self.runner is not None:  # the whole step as one graph (host inputs are copied into its buffers)
            outcome = self.runner.speculative_step(self.spec_decoder, rows, pending, settings, uniforms, strategy)
        if outcome is None:
            outcome = self.spec_decoder.step(rows, pending.to(self.device), settings.to(self.device),
                                            uniforms.to(self.device), strategy)
        result = outcome.acceptance
        emitted = 0
        for seq, tokens, logprobs, count in zip(running, result.tokens.tolist(), result.logprobs.tolist(),
                                                result.emitted.tolist()):
            for token, logprob in zip(tokens[:count], logprobs[:count]):
                seq.append(token, logprob)
                emitted += 1
                if seq.finish_reason is not None:
                    break  # nothing after a stop token or past the length budget is emitted
        if self.drafter_version is not None:
            for seq in running:
                seq.drafter_versions.add(self.drafter_version)
        accepted = torch.bincount(result.accepted, minlength=strategy.depth + 1).tolist()
        return StepTrace("decode", len(running), emitted, 0.0, mode="sd", strategy=strategy.name,
                         accepted_hist=tuple(accepted), draft_s=outcome.draft_s, verify_s=outcome.verify_s)

    def _sample_into(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        settings = RowSampling.from_params([s.request.params for s in seqs], self.device)
        uniforms = draw_uniforms([s.generator for s in seqs])[:, 0]
        tokens, logprobs = sample_next(logits, settings, uniforms)
        _append(seqs, tokens, logprobs)

    def _retire(self, running: list[_Sequence], cache: KVCache, finished: list[_Sequence], bar,
                collect_features=None) -> None:
        """Remove finished rows; the last running row fills each hole so the batch stays dense."""
        done = [i for i, s in enumerate(running) if s.finish_reason is not None]
        if collect_features is not None:
            for index in done:
                _hand_features(cache, index, running[index], collect_features)
        for index in reversed(done):
            last = len(running) - 1
            finished.append(running[index])
            if index != last:
                cache.move_row(last, index)
                if self.spec_decoder is not None:
                    self.spec_decoder.move_row(last, index)
                running[index] = running[last]
            running.pop()
        if bar is not None and done:
            bar.update(len(done))


def _append(seqs: list[_Sequence], tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
    """One device-to-host copy for both (token ids < 2^53 are exact in float64)."""
    host = torch.stack([tokens.double(), logprobs.double()]).cpu()
    for seq, token, logprob in zip(seqs, host[0].long().tolist(), host[1].float().tolist()):
        seq.append(token, logprob)


def _hand_features(cache: KVCache, row: int, seq: _Sequence, collect_features) -> None:
    """The committed tokens and features of a finished row, from the last prompt token to the response's
    second-to-last token (slot p + j holds response token j; the last one was emitted but never fed). A
    speculative step may have committed slots past a stop token: they are not the sample's and are left out."""
    start = len(seq.request.prompt_ids) - 1
    end = start + len(seq.tokens)
    if end > int(cache.lengths[row]):
        raise AssertionError(f"row {row} holds {int(cache.lengths[row])} committed tokens, expected >= {end}")
    collect_features(cache.slot_data["tokens"][row, start:end], cache.slot_data["features"][row, start:end])


def _same_layout(serving, drafter) -> bool:
    """Whether `drafter`'s weights can be loaded into the serving drafter's tensors (same shapes and vocabulary)."""
    theirs, ours = drafter.state_dict(), serving.state_dict()
    if theirs.keys() != ours.keys() or any(theirs[k].shape != ours[k].shape for k in ours):
        return False
    if (serving.draft_to_target is None) != (drafter.draft_to_target is None):
        return False
    return serving.draft_to_target is None or torch.equal(serving.draft_to_target.cpu(), drafter.draft_to_target.cpu())


def resolve_rollout_dtype(dtype, device: torch.device, model_dtype: torch.dtype) -> torch.dtype:
    """"auto" -> bf16 on CUDA (decode streams half the bytes), else the model's dtype (bf16 matmuls are slow on
    most CPUs); a name ("bfloat16", "float32", ...) or a torch dtype as given."""
    if dtype == "auto" or dtype is None:
        return torch.bfloat16 if device.type == "cuda" else model_dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
            raise RequestError(f"rollout dtype must be auto, float32, bfloat16 or float16, got {dtype!r}")
        return resolved
    return dtype


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="rollout", unit="sample")

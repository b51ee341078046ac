"""Equal-work replay: the same prompts with every sample's response length fixed in advance.

Comparing decoding modes on natural rollouts at T > 0 compares different samples: one mode's responses may
simply be shorter. A replay records each sample's length in a reference rollout (speculation off), then asks
every mode for exactly those lengths — `max_new_tokens` = the recorded length, stop tokens ignored — so each mode
decodes the same number of tokens per sample, at the same temperature (acceptance rates stay realistic).

A request's n samples share one SamplingParams, so a replay serves each sample as its own request (n=1); its
random stream is derived from the request's seed and its position in sample order (distinct per sample, the
same in every mode). `regroup` gives the samples back their original (request, sample) indices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tlt.errors import RequestError
from tlt.rollout.request import Request, RolloutResult


def length_matched(requests: list[Request], lengths: Sequence[int]) -> list[Request]:
    """One request per sample (sample order: request-major), each decoding exactly its `lengths` entry."""
    total = sum(r.n for r in requests)
    if len(lengths) != total:
        raise RequestError(f"a replay needs one length per sample: {total} samples, {len(lengths)} lengths")
    replayed, k = [], 0
    for position, request in enumerate(requests):
        stream = request.stream_at(position)
        for sample in range(request.n):
            length = lengths[k]
            if not (isinstance(length, int) and not isinstance(length, bool) and length >= 1):
                raise RequestError(f"replay length of sample {k} must be an integer >= 1, got {length!r}")
            params = dataclasses.replace(request.params, max_new_tokens=length, stop_token_ids=())
            replayed.append(Request(request.prompt_ids, n=1, params=params, label=request.label,
                                    stream=stream * request.n + sample))
            k += 1
    return replayed


def regroup(result: RolloutResult, requests: list[Request]) -> RolloutResult:
    """The result of generating `length_matched(requests, ...)`, with each sample's index in `requests` back."""
    origin = [(i, j) for i, request in enumerate(requests) for j in range(request.n)]
    samples = [dataclasses.replace(s, request_index=origin[s.request_index][0], sample_index=origin[s.request_index][1])
               for s in result.samples]
    return dataclasses.replace(result, samples=samples)

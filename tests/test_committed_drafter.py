"""The warmed drafter in the tree (benchmarks/drafters/smollm2-arithmetic): GPU sessions and the benchmarks serve
it to the default model, so a file that no longer fits that model (a wrong shape, a draft vocabulary outside the
vocabulary, fp32 weights too large to travel) fails here, not on the device."""

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from tlt.models.eagle import EagleDrafter

DRAFTER = Path(__file__).resolve().parents[1] / "benchmarks" / "drafters" / "smollm2-arithmetic"
SMOLLM2 = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
           "intermediate_size": 1536, "vocab_size": 49152}  # the drafter's one layer is shaped as the target's


def test_the_committed_drafter_loads_into_a_model_of_smollm2s_shape():
    meta = json.loads((DRAFTER / "drafter_config.json").read_text())
    settings = dict(meta["target_config"])
    assert {key: settings[key] for key in SMOLLM2} == SMOLLM2
    weights = load_file(str(DRAFTER / "drafter.safetensors"))
    assert {t.dtype for t in weights.values() if t.is_floating_point()} == {torch.bfloat16}  # half the bytes
    ids = weights["draft_to_target"]
    assert len(ids) == meta["draft_vocab_size"] and len(set(ids.tolist())) == len(ids)
    assert 0 <= int(ids.min()) and int(ids.max()) < SMOLLM2["vocab_size"]
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    target = AutoModelForCausalLM.from_config(config)  # one of SmolLM2's layers, random weights: no download
    drafter = EagleDrafter.load(DRAFTER, target)
    assert drafter.draft_vocab_size == meta["draft_vocab_size"]
    provenance = json.loads((DRAFTER / "provenance.json").read_text())
    assert provenance["rounds"] and all(line.startswith("tlt drafter warmup") for line in provenance["rounds"])

"""Checkpoint files: tied embeddings resume whichever name of the pair safetensors kept, a checkpoint that lacks a
weight is refused, and the final policy is a Hugging Face model directory with its tokenizer."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from conftest import tiny_model
from tlt.rl.checkpoint import CheckpointError, file_crc32, load_checkpoint, save_checkpoint, save_final_model

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def checkpoint_keeping(tmp_path, model, drop: str):
    """A checkpoint of `model` whose policy file lacks `drop` (as safetensors' dedup of a tied pair does)."""
    path = save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()))
    weights = load_file(str(path / "policy.safetensors"))
    kept = {name: tensor.clone() for name, tensor in {**weights, **model.state_dict()}.items() if name != drop}
    save_file(kept, str(path / "policy.safetensors"))
    state = json.loads((path / "state.json").read_text())  # as that save would have recorded it
    state["crc32"]["policy.safetensors"] = file_crc32(path / "policy.safetensors")
    (path / "state.json").write_text(json.dumps(state))
    return path


@pytest.mark.parametrize("drop", [EMBED, HEAD])
def test_tied_embeddings_load_from_either_name_of_the_pair(tmp_path, drop):
    source, target = tiny_model(tie_word_embeddings=True), tiny_model(seed=1, tie_word_embeddings=True)
    path = checkpoint_keeping(tmp_path, source, drop)
    load_checkpoint(path, target, torch.optim.AdamW(target.parameters()))
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # still one tensor


def test_an_untied_model_missing_its_head_is_refused(tmp_path):
    """The tie is read from the model's tensors, not guessed from names: an untied head must be in the file."""
    source, target = tiny_model(), tiny_model(seed=1)
    path = checkpoint_keeping(tmp_path, source, HEAD)
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\]"):
        load_checkpoint(path, target, torch.optim.AdamW(target.parameters()))


@pytest.mark.parametrize("edit,detail", [
    (lambda state: state.update(step="abc"), "its step is 'abc'"),
    # resumed "from step-000001 (step 3)": trained steps 4... on weights that had one update (found by QA)
    (lambda state: state.update(step=3), "its step is 3, but its directory is step-000001"),
    (lambda state: state.update(python_rng=[1]), "IndexError"),
    (lambda state: state["optimizer"].update(param_groups=[]), "ValueError"),
    (lambda state: state.update(scheduler={"last_epoch": "x"}), "lr schedule state .* holds no step count"),
    (lambda state: state.update(scheduler="x"), "lr schedule state 'x' holds no step count")])
def test_a_damaged_state_json_value_is_named_before_anything_runs(tmp_path, edit, detail):
    """Edited or damaged values in state.json came out as a traceback, or as a worker failure whose advice
    (`--resume continues from step-000001`) met the same file again; one a whole rollout later (found by QA)."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    path = save_checkpoint(tmp_path, 1, model, optimizer, scheduler=scheduler)
    state = json.loads((path / "state.json").read_text())
    edit(state)
    (path / "state.json").write_text(json.dumps(state))
    with pytest.raises(CheckpointError, match=rf"cannot read checkpoint file .*state.json: .*{detail}.*--overwrite"):
        load_checkpoint(path, model, optimizer, scheduler)


def tiny_tokenizer(vocab_size=97):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_final_model_directory_loads_with_transformers(tmp_path, tied):
    model, tokenizer = tiny_model(tie_word_embeddings=tied), tiny_tokenizer()
    model.generation_config = GenerationConfig(eos_token_id=3, max_new_tokens=7)
    final = save_final_model(model, tokenizer, tmp_path / "final")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in final.iterdir()}
    assert not list(final.glob("*.bin")) and not list(tmp_path.glob(".final-*"))  # no pickle, no staging left
    loaded = AutoModelForCausalLM.from_pretrained(final)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.generation_config.max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(final)("w5 w9 w40").input_ids == tokenizer("w5 w9 w40").input_ids


def test_a_full_disk_is_one_error_naming_the_save_and_the_checkpoint_still_whole(tmp_path, monkeypatch):
    """A full disk while saving gave a raw traceback (a safetensors I/O error) and left its staging copy filling
    the disk further (found by review)."""
    import errno

    import tlt.rl.checkpoint as checkpoint

    model = tiny_model()
    save_checkpoint(tmp_path, 1, model, None)

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", disk_full)
    with pytest.raises(CheckpointError, match=r"cannot save the checkpoint of step 2 in .*: No space left on device "
                                              r"\(the last complete checkpoint, step-000001, is intact"):
        save_checkpoint(tmp_path, 2, model, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000001"]  # no staging copy left
    assert load_checkpoint(tmp_path / "step-000001", tiny_model(seed=1), None)["step"] == 1


def test_a_failed_final_save_keeps_the_previous_final_policy(tmp_path, monkeypatch):
    from safetensors import SafetensorError

    model, tokenizer = tiny_model(), tiny_tokenizer()
    save_final_model(model, tokenizer, tmp_path / "final")
    before = (tmp_path / "final" / "model.safetensors").read_bytes()

    def rust_io_error(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: Disk quota exceeded (os error 122)")

    monkeypatch.setattr(model, "save_pretrained", rust_io_error)
    with pytest.raises(CheckpointError, match=r"cannot save the final policy in .*Disk quota exceeded .*no complete "
                                              r"checkpoint was saved before it"):
        save_final_model(model, tokenizer, tmp_path / "final")
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]

    def not_the_disk(*args, **kwargs):
        raise SafetensorError("You are trying to save a non contiguous tensor")

    monkeypatch.setattr(model, "save_pretrained", not_the_disk)
    with pytest.raises(SafetensorError, match="non contiguous"):  # a bug is not reported as a failed write
        save_final_model(model, tokenizer, tmp_path / "final")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]


def test_a_save_killed_while_replacing_final_leaves_the_earlier_copy_for_the_next_start(tmp_path, monkeypatch):
    """Re-saving final/ (a run resumed for more steps) deleted the old copy in place, then renamed the new one
    in: a kill during the delete left a half-deleted model directory (found by review). Now the old copy is
    renamed aside first; `recover_retired` (each run start) puts it back, or drops it once the new one is in."""
    import os

    from tlt.rl.checkpoint import recover_retired

    model, tokenizer = tiny_model(), tiny_tokenizer()
    save_final_model(model, tokenizer, tmp_path / "final")
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    replace = os.replace

    def killed_between_the_renames(source, destination):
        if Path(destination) == tmp_path / "final":
            raise KeyboardInterrupt  # the process ends here: nothing after it runs
        replace(source, destination)

    monkeypatch.setattr(os, "replace", killed_between_the_renames)
    with pytest.raises(KeyboardInterrupt):
        save_final_model(tiny_model(seed=1), tokenizer, tmp_path / "final")
    monkeypatch.setattr(os, "replace", replace)
    assert not (tmp_path / "final").exists() and len(list(tmp_path.glob(".old-final-*"))) == 1
    recover_retired(tmp_path)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    (tmp_path / ".old-final-0badf00d").mkdir()  # killed while deleting it, the new copy already in place
    recover_retired(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final"]
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before


def test_checkpoints_and_the_final_policy_are_readable_as_the_umask_allows(tmp_path):
    """Staged with mkdtemp, they were 0700, and safetensors' own files 0600: a serving container or a colleague
    could not read the policy."""
    import os
    import stat

    umask = os.umask(0o022)
    try:
        final = save_final_model(tiny_model(), tiny_tokenizer(), tmp_path / "final")
        saved = save_checkpoint(tmp_path, 1, tiny_model(), None)
    finally:
        os.umask(umask)
    assert stat.S_IMODE(final.stat().st_mode) == stat.S_IMODE(saved.stat().st_mode) == 0o755
    # safetensors >= 0.8 writes its files 0600 whatever the umask (its issue #782): the policy was unreadable
    files = [*final.iterdir(), *saved.iterdir()]
    assert {p.name for p in files} >= {"model.safetensors", "policy.safetensors", "config.json"}
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in files} == {p.name: 0o644 for p in files}


def test_a_saved_drafter_is_readable_as_the_umask_allows(tmp_path):
    import os
    import stat

    from tlt.models.eagle import EagleDrafter

    umask = os.umask(0o027)
    try:
        EagleDrafter(tiny_model().config).save(tmp_path)
    finally:
        os.umask(umask)
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()} == {
        "drafter.safetensors": 0o640, "drafter_config.json": 0o640}


@pytest.mark.parametrize("with_crc", [True, False], ids=["crc", "control-no-crc"])
def test_bytes_damaged_after_the_save_are_found_by_their_crc(tmp_path, with_crc):
    """Zeros written over the end of policy.safetensors (size and header intact) loaded without a word, and the
    run trained on from damaged weights (found by QA). Control: a checkpoint whose state.json keeps no CRC (one
    written before they were kept) loads the damaged bytes, as it always did."""
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(tmp_path, 1, model, optimizer)
    state = json.loads((path / "state.json").read_text())
    assert set(state["crc32"]) == {"policy.safetensors", "optimizer.safetensors", "rng.safetensors"}
    if not with_crc:
        del state["crc32"]
        (path / "state.json").write_text(json.dumps(state))
    policy = path / "policy.safetensors"
    data = bytearray(policy.read_bytes())
    data[-64:] = bytes(64)
    policy.write_bytes(bytes(data))
    if with_crc:
        with pytest.raises(CheckpointError, match=r"policy.safetensors: its bytes are not those written"):
            load_checkpoint(path, model, optimizer)
    else:
        load_checkpoint(path, model, optimizer)

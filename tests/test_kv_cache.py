import torch

from conftest import tiny_model
from tlt.models import KVCache, ModelSpec


def filled_cache(rows=3, length=10):
    spec = ModelSpec.from_config(tiny_model().config)
    cache = KVCache(spec, rows, 16)
    for layer in range(spec.num_layers):
        cache.keys[layer].copy_(torch.randn_like(cache.keys[layer]))
        cache.values[layer].copy_(torch.randn_like(cache.values[layer]))
    cache.lengths[:rows] = length
    return cache


def test_keep_commits_selected_offsets_in_order():
    cache = filled_cache()
    rows = cache.rows(0, 3)
    rows.lengths.copy_(torch.tensor([4, 6, 2]))
    before = [k.clone() for k in cache.keys]
    offsets = torch.tensor([[0, 2, 3], [1, 0, 0], [0, 0, 0]])
    counts = torch.tensor([3, 1, 0])
    rows.keep(offsets, counts)
    assert rows.lengths.tolist() == [7, 7, 2]
    for layer, old in enumerate(before):
        new = cache.keys[layer]
        assert torch.equal(new[0, :, 4:7], old[0, :, [4, 6, 7]])
        assert torch.equal(new[1, :, 6], old[1, :, 7])
        assert torch.equal(new[:, :, :2], old[:, :, :2])  # committed prefixes untouched


def test_gather_written_traced_by_dynamo_moves_the_same_slots():
    """Under torch.compile the accepted path moves layer by layer (one op over the whole buffer made Inductor copy
    the whole cache): both ways leave the same cache, rows from a middle start included."""
    eager, traced = filled_cache(rows=4), filled_cache(rows=4)
    traced.kv.copy_(eager.kv)
    for cache in (eager, traced):
        cache.add_slot_data("tokens").copy_(torch.arange(4 * 16.0).view(4, 16))
    lengths, offsets, counts = torch.tensor([4, 6, 2]), torch.tensor([[0, 2, 3], [1, 0, 0], [0, 0, 0]]), \
        torch.tensor([3, 1, 0])
    before = eager.kv.clone()
    eager.rows(1, 3).gather_written(lengths, offsets, counts)
    assert not torch.equal(eager.kv, before)  # something moved: the comparison below can see a difference
    torch._dynamo.reset()
    moved = torch.compile(lambda: traced.rows(1, 3).gather_written(lengths, offsets, counts), backend="eager",
                          fullgraph=True)
    moved()
    assert torch.equal(eager.kv, traced.kv) and torch.equal(eager.slot_data["tokens"], traced.slot_data["tokens"])


def test_move_row_and_copy_prefix():
    cache = filled_cache()
    cache.lengths[2] = 5
    cache.move_row(2, 0)
    assert cache.lengths[0] == 5
    assert torch.equal(cache.keys[0][0, :, :5], cache.keys[0][2, :, :5])
    cache.copy_prefix(1, [0, 2])
    assert cache.lengths.tolist() == [10, 10, 10]
    assert torch.equal(cache.values[1][0, :, :10], cache.values[1][1, :, :10])


def test_truncate_rolls_back_and_refuses_to_lengthen():
    cache = filled_cache()
    rows = cache.rows(0, 2)
    rows.truncate(torch.tensor([3, 4]))
    assert rows.lengths.tolist() == [3, 4]
    try:
        rows.truncate(torch.tensor([5, 4]))
    except ValueError:
        pass
    else:
        raise AssertionError("truncate lengthened a row")


def test_slot_data_follows_moves_copies_and_keep():
    cache = filled_cache()
    tokens = cache.add_slot_data("tokens", dtype=torch.long)
    features = cache.add_slot_data("features", (2,))
    tokens.copy_(torch.arange(3 * 16).view(3, 16))
    features.copy_(torch.randn(3, 16, 2))
    cache.lengths[:] = torch.tensor([4, 6, 5])
    reference = features.clone()
    cache.move_row(2, 0)
    assert tokens[0, :5].tolist() == list(range(32, 37)) and torch.equal(features[0, :5], reference[2, :5])
    cache.copy_prefix(1, [2])
    assert tokens[2, :6].tolist() == list(range(16, 22))
    rows = cache.rows(0, 2)
    rows.write_slots("tokens", torch.tensor([[5, 6, 7], [6, 7, 8]]), torch.tensor([[90, 91, 92], [80, 81, 82]]))
    rows.keep(torch.tensor([[0, 2], [1, 0]]), torch.tensor([2, 1]))
    assert tokens[0, 5:7].tolist() == [90, 92] and tokens[1, 6] == 81
    assert cache.lengths[:2].tolist() == [7, 7]

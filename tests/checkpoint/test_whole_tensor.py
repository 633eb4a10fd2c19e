"""The whole-tensor form of the state entries that are not one value per element
(``checkpoint.whole_tensor``): 8-bit block scales and Scalify's scales, cut from one
layout and rebuilt on another, against float64 references of the values they stand for."""

from __future__ import annotations

import torch

from collage_train.checkpoint import whole_tensor
from collage_train.optim.blockwise8 import BLOCK_SIZE, dequantize, dynamic_map, quantize
from collage_train.scalify.scale import store_scaled


def eight_bit_state(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The 8-bit state of one flat tensor holding ``values`` as both moments."""
    m, m_absmax = quantize(values, signed=True)
    v, v_absmax = quantize(values.abs(), signed=False)
    return {"exp_avg": m, "exp_avg_absmax": m_absmax, "exp_avg_sq": v,
            "exp_avg_sq_absmax": v_absmax}  # fmt: skip


def represented(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the codes stand for, in float64 (``blockwise8.dequantize``)."""
    return {
        name: dequantize(state[name], state[f"{name}_absmax"], signed).double()
        for name, signed in (("exp_avg", True), ("exp_avg_sq", False))
    }


def test_eight_bit_blocks_recut_keep_aligned_blocks_and_bound_the_others():
    """Two partitions [0, 700) and [700, 1500) (blocks over each), rebuilt as one tensor:
    the blocks that lie where they were keep their codes and scale bit for bit, the block
    that straddles the old cut is re-quantised within half a step of the map."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(1500, generator=generator) * torch.logspace(-3, 0, 1500)
    cut = 700
    parts = [eight_bit_state(values[:cut]), eight_bit_state(values[cut:])]
    old = [represented(part) for part in parts]
    pieces = [whole_tensor.element_range(parts[0], 0, cut),
              whole_tensor.element_range(parts[1], 0, 1500 - cut)]  # fmt: skip
    whole = {key: torch.cat([piece[key] for piece in pieces]) for key in pieces[0]}
    rebuilt = whole_tensor.compact(whole)
    assert rebuilt["exp_avg_absmax"].numel() == -(-1500 // BLOCK_SIZE)
    new = represented(rebuilt)
    # blocks [0, 256) and [256, 512) are the first partition's own: bit for bit
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(rebuilt[key][:512], parts[0][key][:512])
        assert torch.equal(rebuilt[f"{key}_absmax"][:2], parts[0][f"{key}_absmax"][:2])
        before = torch.cat([old[0][key], old[1][key]])
        signed = key == "exp_avg"
        absmax = rebuilt[f"{key}_absmax"].double().repeat_interleave(BLOCK_SIZE)[:1500]
        assert bool(
            ((new[key] - before).abs() <= whole_tensor.REQUANTISE_BOUND[signed] * absmax).all()
        )
        assert not torch.equal(new[key], before)  # the straddling blocks did move
    # the bound is half the widest gap of the map
    code = dynamic_map(True).double()
    assert whole_tensor.REQUANTISE_BOUND[True] == float((code[1:] - code[:-1]).max() / 2)


def test_eight_bit_state_of_one_tensor_round_trips_bit_for_bit():
    values = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    state = eight_bit_state(values)
    rebuilt = whole_tensor.compact(whole_tensor.element_range(state, 0, 1000))
    assert rebuilt.keys() == state.keys()
    assert all(torch.equal(rebuilt[key], state[key]) for key in state)
    # fp32 values and back, with the blocks on the whole tensor: quantize's own result
    exact = whole_tensor.values(whole_tensor.element_range(state, 0, 1000))
    assert torch.equal(exact["exp_avg"].double(), represented(state)["exp_avg"])
    codes, absmax = whole_tensor.quantised_elements(values, signed=True)
    again = whole_tensor.compact({"exp_avg": codes, "exp_avg_absmax": absmax})
    assert torch.equal(again["exp_avg"], state["exp_avg"])
    assert torch.equal(again["exp_avg_absmax"], state["exp_avg_absmax"])


def test_scalify_scales_per_piece_become_one_per_tensor_and_back():
    """A ZeRO partition holds pieces of two tensors (and padding), each under its whole
    tensor's scale: rebuilt as the two tensors (0-d scales) and as another cut of pieces,
    the data is the same bits and the values data x scale unchanged (float64)."""
    generator = torch.Generator().manual_seed(2)
    a, b = torch.randn(300, generator=generator) * 1e-3, torch.randn(200, generator=generator)
    (data_a, scale_a), (data_b, scale_b) = store_scaled(a), store_scaled(b)
    lengths = torch.tensor([300, 200, 12])  # the last: padding
    flat = {
        "exp_avg": torch.cat([data_a, data_b, torch.zeros(12, dtype=torch.float16)]),
        "exp_avg_scale": torch.stack([scale_a, scale_b, torch.tensor(1.0)]),
        "piece_lengths": lengths,
    }
    elements = whole_tensor.element_range(flat, 0, 512)
    assert "piece_lengths" not in elements
    first = whole_tensor.compact({k: v[:300] for k, v in elements.items()})
    assert torch.equal(first["exp_avg"], data_a) and torch.equal(first["exp_avg_scale"], scale_a)
    assert first["exp_avg_scale"].dim() == 0 and "piece_lengths" not in first
    # another partition: the second tensor's last 150 elements, then 50 of padding
    cut = {
        k: torch.cat([v[350:500], whole_tensor.blank(k, 50, v.dtype)]) for k, v in elements.items()
    }
    second = whole_tensor.compact(cut, torch.tensor([150, 50]))
    assert torch.equal(second["exp_avg_scale"], torch.stack([scale_b, torch.tensor(1.0)]))
    assert torch.equal(second["piece_lengths"], torch.tensor([150, 50]))
    value = whole_tensor.values({"exp_avg": second["exp_avg"][:150],
                                 "exp_avg_scale": elements["exp_avg_scale"][350:500]})  # fmt: skip
    assert torch.equal(second["exp_avg"][:150], data_b[50:])
    assert torch.equal(value["exp_avg"].double(), data_b[50:].double() * scale_b.double())


def test_a_partition_restored_a_window_at_a_time_is_bit_for_bit_the_one_restored_at_once():
    """``restore_flat`` over windows of one block and of three builds the same state as
    over the whole flat tensor: 8-bit codes re-quantised where the blocks move, per-block
    absmax, a per-element entry, index positions and the uncovered tail alike; only the
    memory it holds at once differs (the 1.3B rehearsal's elastic resume)."""
    from collage_train.checkpoint.param_state import FullState
    from collage_train.checkpoint.pieces import Piece

    generator = torch.Generator().manual_seed(1)
    sizes = {"a": 700, "b": 1000}
    sources = {}  # each parameter's state as a writer that cut its blocks elsewhere left it
    for name, size in sizes.items():
        values = torch.randn(size, generator=generator) * torch.logspace(-3, 0, size)
        part = eight_bit_state(values)
        form = whole_tensor.element_range(part, 0, size)
        form["weight"] = values.to(torch.bfloat16)
        form["dtheta"] = (values * 1e-3).to(torch.bfloat16)
        form["remainder_ties"] = torch.arange(0, size, 97)
        sources[name] = form

    def read(name: str, start: int, stop: int) -> dict[str, torch.Tensor]:
        out = {k: v[start:stop].clone() for k, v in sources[name].items() if k != "remainder_ties"}
        ties = sources[name]["remainder_ties"]
        out["remainder_ties"] = ties[(ties >= start) & (ties < stop)] - start
        return out

    shapes = {name: (size,) for name, size in sizes.items()}
    state = FullState("zero2", 2, shapes, {"a": 5, "b": 5}, {"step": 5}, False, read)
    # a partition of 2048 elements: a's last 600, all of b, then 448 of padding
    pieces = [Piece("a", 0, 100, 0, 600), Piece("b", 0, 0, 600, 1000)]
    results = []
    for window in (BLOCK_SIZE, 3 * BLOCK_SIZE, 2048):
        flat = torch.zeros(2048, dtype=torch.bfloat16)
        step, restored = whole_tensor.restore_flat(state, pieces, flat, window=window)
        results.append((step, flat, restored))
    step, flat, whole = results[-1]
    assert step == 5 and flat[:600].equal(sources["a"]["weight"][100:])
    assert whole["exp_avg_absmax"].numel() == 2048 // BLOCK_SIZE  # one absmax a block
    assert whole["remainder_ties"].tolist() == [t - 100 for t in range(0, 700, 97) if t >= 100] + [
        600 + t for t in range(0, 1000, 97)
    ]
    for other_step, other_flat, restored in results[:-1]:
        assert other_step == step and other_flat.equal(flat)
        assert list(restored) == list(whole)
        for key, value in whole.items():
            assert restored[key].dtype == value.dtype and restored[key].equal(value), key

"""SparseLoCo codec: chunked top-k, 2-bit quantization with bin means, exact packing."""

from __future__ import annotations

import math

import pytest
import torch

from collage_train.comm.codec import (
    CodecSettings,
    compress_with_feedback,
    compression_ratio,
    decode,
    density,
    encode,
    pack_bits,
    payload_nbytes,
    unpack_bits,
)

SMALL = CodecSettings(chunk=256, k=16, bits=2)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def parse_one(payload: torch.Tensor, numel: int, s: CodecSettings):
    """Independent reading of a one-tensor payload: (indices [n, k], codes, fp32 means)."""
    n_chunks = math.ceil(numel / s.chunk)
    kept = n_chunks * s.k
    index_bits = max(1, math.ceil(math.log2(s.chunk)))
    a, b = math.ceil(kept * index_bits / 8), math.ceil(kept * s.bits / 8)
    assert payload.numel() == a + b + 4 * 2**s.bits
    indices = unpack_bits(payload[:a], index_bits, kept).view(n_chunks, s.k)
    codes = unpack_bits(payload[a : a + b], s.bits, kept)
    means = payload[a + b :].clone().view(torch.float32)
    return indices, codes, means


# --- bit packing ----------------------------------------------------------------------


@pytest.mark.parametrize("width", range(1, 17))
def test_pack_unpack_are_exact_inverses(width):
    gen = torch.Generator().manual_seed(width)
    for count in (0, 1, 7, 9, 13, 64, 1001, int(torch.randint(1, 5000, (1,), generator=gen))):
        values = torch.randint(0, 2**width, (count,), generator=gen)
        packed = pack_bits(values, width)
        assert packed.dtype == torch.uint8
        assert packed.numel() == math.ceil(count * width / 8)
        assert torch.equal(unpack_bits(packed, width, count), values)


def test_pack_bits_is_little_endian():
    assert pack_bits(torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1]), 1).tolist() == [1, 1]
    assert pack_bits(torch.tensor([0xABC]), 12).tolist() == [0xBC, 0x0A]
    assert pack_bits(torch.tensor([1, 2, 3, 0]), 2).tolist() == [0b00111001]


def test_pack_rejects_values_that_do_not_fit_and_unpack_wrong_lengths():
    with pytest.raises(ValueError, match="2\\*\\*3"):
        pack_bits(torch.tensor([8]), 3)
    with pytest.raises(ValueError, match="needs 2 bytes"):
        unpack_bits(torch.zeros(3, dtype=torch.uint8), 3, 5)


# --- top-k selection ------------------------------------------------------------------


def test_exactly_k_largest_magnitudes_are_kept_per_chunk():
    s = SMALL
    x = randn(8 * s.chunk)  # no exact zeros, and no bin mean can be 0 (see below)
    payload = encode([x], s)
    rows = x.view(-1, s.chunk)
    dense = decode(payload, [x.shape], s)[0].view(-1, s.chunk)
    kept = dense != 0
    assert kept.sum(dim=1).tolist() == [s.k] * rows.shape[0]
    # Every kept |value| is at least every dropped one, chunk by chunk.
    big = torch.where(kept, rows.abs(), torch.inf).min(dim=1).values
    small = torch.where(kept, -torch.inf, rows.abs()).max(dim=1).values
    assert bool((big > small).all())
    # The same, read straight from the wire: k distinct ascending indices per chunk.
    indices, _, _ = parse_one(payload, x.numel(), s)
    assert bool((indices.diff(dim=1) > 0).all())
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(1, indices, True))


def test_padding_is_dropped_and_short_tensors_decode_to_their_shape():
    s = CodecSettings(chunk=64, k=16, bits=2)
    x = randn(10, seed=1)  # fewer entries than k: all kept, padding selected then dropped
    (dense,) = decode(encode([x], s), [x.shape], s)
    assert dense.shape == x.shape
    assert int((dense != 0).sum()) == 10
    assert torch.equal(torch.sign(dense), torch.sign(x))


# --- quantization ---------------------------------------------------------------------


def test_codes_and_bin_means_follow_the_six_sigma_bins():
    s = SMALL
    x = randn(4 * s.chunk + 37, seed=2) ** 3  # heavy tails: some values clamp to end bins
    payload = encode([x], s)
    indices, codes, means = parse_one(payload, x.numel(), s)
    padded = torch.cat([x, x.new_zeros(-x.numel() % s.chunk)]).view(-1, s.chunk)
    selected = padded.gather(1, indices).reshape(-1).double()

    sigma = selected.square().mean().sqrt()
    width = 6 * sigma / 2**s.bits
    expected = ((selected + 3 * sigma) / width).floor().clamp(0, 2**s.bits - 1).long()
    assert torch.equal(codes, expected)
    assert bool((selected.abs() > 3 * sigma).any())  # the clamp was exercised

    for b in range(2**s.bits):
        members = selected[codes == b]
        if members.numel():
            assert means[b].item() == members.mean().float().item()
        else:
            assert means[b].item() == (-3 * sigma + (b + 0.5) * width).float().item()

    (dense,) = decode(payload, [x.shape], s)
    flat = torch.cat([dense, dense.new_zeros(-x.numel() % s.chunk)]).view(-1, s.chunk)
    assert torch.equal(flat.gather(1, indices).reshape(-1), means[codes])
    nonzero = dense[dense != 0]
    assert bool((nonzero >= selected.min()).all() and (nonzero <= selected.max()).all())


def test_all_zero_tensor_decodes_to_zeros():
    s = SMALL
    x = torch.zeros(3, 300)
    payload = encode([x], s)
    _, _, means = parse_one(payload, x.numel(), s)
    assert torch.equal(means, torch.zeros(4))
    assert torch.equal(decode(payload, [x.shape], s)[0], x)


# --- payload --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shapes",
    [
        [(1000,)],
        [(0,)],
        [(5,), (0, 3), (256,), (257,)],
        [(3, 100), (2, 4, 64), (1,)],
        [(17, 31), (4096,), (2, 3, 5, 7)],
    ],
)
@pytest.mark.parametrize("s", [SMALL, CodecSettings(chunk=100, k=3, bits=1), CodecSettings()])
def test_payload_length_is_payload_nbytes_and_shapes_roundtrip(shapes, s):
    tensors = [randn(*shape, seed=i) for i, shape in enumerate(shapes)]
    payload = encode(tensors, s)
    numels = [t.numel() for t in tensors]
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    assert payload.numel() == payload_nbytes(numels, s)
    out = decode(payload, [t.shape for t in tensors], s)
    assert [o.shape for o in out] == [t.shape for t in tensors]
    assert all(o.dtype == torch.float32 for o in out)


def test_payload_nbytes_formula_by_hand():
    s = CodecSettings()  # index_bits 12, 2-bit codes, 4 fp32 means
    # 5000 -> 2 chunks, 128 kept: 192 index bytes + 32 code bytes + 16 mean bytes.
    assert payload_nbytes([5000, 0], s) == 192 + 32 + 16
    # 1 -> 1 chunk, 64 kept; chunk 5 -> 3 index bits: 3 kept * 3 bits = 2 bytes, 3*2 bits = 1.
    assert payload_nbytes([1], s) == 96 + 16 + 16
    assert payload_nbytes([5], CodecSettings(chunk=5, k=3, bits=2)) == 2 + 1 + 16


def test_decode_rejects_a_payload_of_the_wrong_length():
    payload = encode([randn(300)], SMALL)
    with pytest.raises(ValueError, match="bytes"):
        decode(payload[:-1], [(300,)], SMALL)


def test_encoding_is_deterministic():
    tensors = [randn(3000, seed=3), randn(7, 9, seed=4)]
    first = encode(tensors, SMALL)
    assert torch.equal(first, encode([t.clone() for t in tensors], SMALL))
    shapes = [t.shape for t in tensors]
    for a, b in zip(
        decode(first, shapes, SMALL), decode(first.clone(), shapes, SMALL), strict=True
    ):
        assert torch.equal(a, b)


def test_compression_ratio_and_density_at_the_defaults():
    s = CodecSettings()  # chunk 4096, k 64, 2 bits
    assert density(s) == 64 / 4096
    # 2**20 fp32 = 4 MiB -> 256 chunks * 64 = 16384 kept: 24576 + 4096 + 16 = 28688 bytes.
    assert payload_nbytes([2**20], s) == 28688
    assert compression_ratio([2**20], s) == pytest.approx(146.2, abs=0.05)
    assert compression_ratio([1_000_000], s) > 50


# --- unquantized (bits=32) -------------------------------------------------------------


def test_raw_values_travel_unquantized():
    s = CodecSettings(chunk=64, k=5, bits=32)
    x = randn(3, 70, seed=9)  # 210 entries: 4 chunks of 64 (the last one padded), 20 kept
    payload = encode([x], s)
    assert payload.numel() == payload_nbytes([x.numel()], s) == math.ceil(20 * 6 / 8) + 20 * 4
    (dense,) = decode(payload, [x.shape], s)
    kept = dense != 0
    assert int(kept.sum()) == 20
    assert torch.equal(dense[kept], x[kept])  # the kept values, bit for bit


@pytest.mark.parametrize("shapes", [[(1000,)], [(5,), (0, 3), (256,), (17, 31)]])
def test_full_density_without_quantization_is_lossless(shapes):
    s = CodecSettings(chunk=256, k=256, bits=32)
    tensors = [randn(*shape, seed=i) for i, shape in enumerate(shapes)]
    decoded = decode(encode(tensors, s), [t.shape for t in tensors], s)
    for dec, t in zip(decoded, tensors, strict=True):
        assert torch.equal(dec, t)
    _, errors = compress_with_feedback([torch.zeros_like(t) for t in tensors], tensors, 0.0, s)
    assert all(torch.equal(e, torch.zeros_like(e)) for e in errors)


# --- error feedback -------------------------------------------------------------------


def test_error_feedback_identity_is_bitwise():
    s = SMALL
    beta = 0.9
    errors = [randn(4, 300, seed=5), randn(77, seed=6), torch.zeros(0)]
    deltas = [randn(4, 300, seed=7).bfloat16(), randn(77, seed=8), torch.zeros(0)]
    payload, new_errors = compress_with_feedback(errors, deltas, beta, s)
    accs = [torch.add(d.float(), e, alpha=beta) for e, d in zip(errors, deltas, strict=True)]
    assert torch.equal(payload, encode(accs, s))
    decoded = decode(payload, [a.shape for a in accs], s)
    for new, acc, dec in zip(new_errors, accs, decoded, strict=True):
        assert new.dtype == torch.float32
        assert torch.equal(new, acc - dec)
    # What was not sent stays in the error unchanged.
    kept = decoded[0] != 0
    assert int(kept.sum()) == 5 * SMALL.k  # 1200 entries: 5 chunks of 256
    assert torch.equal(new_errors[0][~kept], accs[0][~kept])


def test_error_feedback_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="shape"):
        compress_with_feedback([torch.zeros(4)], [torch.zeros(1)], 0.5, SMALL)


# --- settings -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chunk": 0},
        {"k": 0},
        {"chunk": 8, "k": 9},
        {"bits": 0},
        {"bits": 9},
        {"bits": 16},
        {"chunk": 4096.0},
        {"k": True},
    ],
)
def test_invalid_settings_raise(kwargs):
    with pytest.raises(ValueError, match="CodecSettings"):
        CodecSettings(**kwargs)


def test_index_bits():
    assert CodecSettings().index_bits == 12
    assert CodecSettings(chunk=1, k=1).index_bits == 1
    assert CodecSettings(chunk=5, k=1).index_bits == 3
    assert CodecSettings(chunk=4097, k=1).index_bits == 13

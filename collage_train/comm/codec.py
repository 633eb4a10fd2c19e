"""SparseLoCo codec: chunked top-k with 2-bit quantization, packed into one uint8 payload.

Each tensor is flattened to fp32 and zero-padded to a multiple of ``chunk``; per chunk the
``k`` entries of largest ``|value|`` are kept, in ascending index order. A tensor's kept
values are quantized together into ``2**bits`` equal-width bins over
``[-3 sigma, 3 sigma]`` (``sigma`` their float64 RMS), a value decoding to its bin's mean.
``bits=32`` sends the kept values as fp32; with ``k == chunk`` too the codec is lossless
(SparseLoCo then reduces exactly to dense DiLoCo). The payload is the tensors' sections
back to back: indices, codes and bin means, each part padded to a whole byte, integers
packed little-endian bit first (``pack_bits``). Contract: deterministic, the same input
gives the same bytes and the same decoded tensors.
The wire format, part by part: docs/distributed.md, "The outer step and its payload".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

RAW_BITS = 32  # ``bits`` value that sends the kept values unquantized, as fp32


@dataclass(frozen=True)
class CodecSettings:
    """``k`` of every ``chunk`` entries kept, each quantized to ``bits`` bits (32: raw fp32)."""

    chunk: int = 4096
    k: int = 64
    bits: int = 2

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"CodecSettings.{field.name} must be an int, got {value!r}")
        if self.chunk < 1:
            raise ValueError(f"CodecSettings.chunk must be >= 1, got {self.chunk}")
        if not 1 <= self.k <= self.chunk:
            raise ValueError(f"CodecSettings.k must be in [1, chunk={self.chunk}], got {self.k}")
        if not (1 <= self.bits <= 8 or self.bits == RAW_BITS):
            raise ValueError(
                f"CodecSettings.bits must be in [1, 8] or {RAW_BITS} (raw fp32), got {self.bits}"
            )

    @property
    def quantized(self) -> bool:
        """False for ``bits=32``: kept values travel as raw fp32."""
        return self.bits != RAW_BITS

    @property
    def index_bits(self) -> int:
        """Bits per within-chunk index: max(1, ceil(log2(chunk)))."""
        return max(1, (self.chunk - 1).bit_length())


def pack_bits(values: torch.Tensor, width: int) -> torch.Tensor:
    """Pack non-negative int64 ``values`` (< 2**width) into ceil(len*width/8) uint8 bytes.

    Little-endian throughout: bit i of value j is bit ``j*width + i`` of the stream, and
    stream bit b is bit ``b % 8`` of byte ``b // 8``. Trailing bits of the last byte are 0.
    """
    if not 1 <= width <= 32:
        raise ValueError(f"pack_bits width must be in [1, 32], got {width}")
    values = values.reshape(-1).long()
    if values.numel() and (values.min() < 0 or values.max() >= 1 << width):
        raise ValueError(f"pack_bits values must lie in [0, 2**{width})")
    shifts = torch.arange(width, device=values.device)
    stream = ((values[:, None] >> shifts) & 1).to(torch.uint8).reshape(-1)
    stream = F.pad(stream, (0, -stream.numel() % 8)).view(-1, 8)
    weights = torch.arange(8, device=values.device, dtype=torch.uint8)
    return (stream << weights).sum(dim=1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: ``count`` int64 values of ``width`` bits from ``packed``."""
    if not 1 <= width <= 32:
        raise ValueError(f"unpack_bits width must be in [1, 32], got {width}")
    if packed.numel() != math.ceil(count * width / 8):
        raise ValueError(
            f"unpack_bits needs {math.ceil(count * width / 8)} bytes for {count} values "
            f"of {width} bits, got {packed.numel()}"
        )
    weights = torch.arange(8, device=packed.device, dtype=torch.uint8)
    stream = ((packed.reshape(-1, 1) >> weights) & 1).reshape(-1)[: count * width]
    shifts = torch.arange(width, device=packed.device)
    return (stream.view(count, width).long() << shifts).sum(dim=1)


def _section_parts(numel: int, s: CodecSettings) -> tuple[int, int, int]:
    """Bytes of the (indices, codes, means) parts of one tensor's section."""
    if numel == 0:
        return 0, 0, 0
    kept = math.ceil(numel / s.chunk) * s.k
    means = 4 * 2**s.bits if s.quantized else 0
    return math.ceil(kept * s.index_bits / 8), math.ceil(kept * s.bits / 8), means


def payload_nbytes(numels: Sequence[int], settings: CodecSettings) -> int:
    """Exact payload length in bytes.

    ``sum over tensors of ceil(n*k*index_bits/8) + ceil(n*k*bits/8) + 4 * 2**bits`` with
    ``n = ceil(numel/chunk)`` (no means term for ``bits=32``); a tensor with numel 0
    contributes 0.
    """
    return sum(sum(_section_parts(numel, settings)) for numel in numels)


def density(settings: CodecSettings) -> float:
    """Fraction of entries kept: k / chunk."""
    return settings.k / settings.chunk


def compression_ratio(numels: Sequence[int], settings: CodecSettings) -> float:
    """fp32 bytes over payload bytes: 4 * sum(numels) / payload_nbytes(numels)."""
    nbytes = payload_nbytes(numels, settings)
    if nbytes == 0:
        raise ValueError("compression_ratio needs at least one non-empty tensor")
    return 4 * sum(numels) / nbytes


def _quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat fp32 ``values`` -> (int64 bin numbers, fp32 bin means)."""
    bins = 2**bits
    v = values.double()
    sigma = v.square().mean().sqrt()
    width = 6 * sigma / bins
    scale = torch.where(width > 0, width, torch.ones_like(width))
    codes = ((v + 3 * sigma) / scale).floor().clamp(0, bins - 1).long()
    centres = -3 * sigma + (torch.arange(bins, device=v.device) + 0.5) * width
    # One masked reduction per bin (not scatter_add), so the sums are deterministic anywhere.
    sums = torch.stack([torch.where(codes == b, v, 0.0).sum() for b in range(bins)])
    counts = torch.bincount(codes, minlength=bins)
    means = torch.where(counts > 0, sums / counts.clamp(min=1), centres)
    return codes, means.float()


def _encode_one(tensor: torch.Tensor, s: CodecSettings) -> torch.Tensor:
    flat = tensor.detach().reshape(-1).float()
    rows = F.pad(flat, (0, -flat.numel() % s.chunk)).view(-1, s.chunk)
    indices = rows.abs().topk(s.k, dim=1).indices.sort(dim=1).values
    kept = rows.gather(1, indices).reshape(-1)
    if not s.quantized:
        return torch.cat([pack_bits(indices, s.index_bits), kept.view(torch.uint8)])
    codes, means = _quantize(kept, s.bits)
    parts = (pack_bits(indices, s.index_bits), pack_bits(codes, s.bits), means.view(torch.uint8))
    return torch.cat(parts)


def encode(tensors: Sequence[torch.Tensor], settings: CodecSettings) -> torch.Tensor:
    """The 1-D uint8 payload (``payload_nbytes`` long) of ``tensors``, on their device."""
    sections = [_encode_one(t, settings) for t in tensors if t.numel() > 0]
    if not sections:
        device = tensors[0].device if tensors else None
        return torch.empty(0, dtype=torch.uint8, device=device)
    return torch.cat(sections)


def _decode_one(section: torch.Tensor, numel: int, s: CodecSettings) -> torch.Tensor:
    index_bytes, code_bytes, _ = _section_parts(numel, s)
    n_chunks = math.ceil(numel / s.chunk)
    kept = n_chunks * s.k
    indices = unpack_bits(section[:index_bytes], s.index_bits, kept).view(n_chunks, s.k)
    value_bytes = section[index_bytes : index_bytes + code_bytes]
    if s.quantized:
        codes = unpack_bits(value_bytes, s.bits, kept)
        values = section[index_bytes + code_bytes :].clone().view(torch.float32)[codes]
    else:
        values = value_bytes.clone().view(torch.float32)
    rows = torch.zeros(n_chunks, s.chunk, dtype=torch.float32, device=section.device)
    rows.scatter_(1, indices, values.view(n_chunks, s.k))
    return rows.view(-1)[:numel]


def decode(
    payload: torch.Tensor, shapes: Sequence[Sequence[int]], settings: CodecSettings
) -> list[torch.Tensor]:
    """Dense fp32 tensors of ``shapes`` (on the payload's device) from an ``encode`` payload."""
    numels = [math.prod(shape) for shape in shapes]
    expected = payload_nbytes(numels, settings)
    if payload.dtype != torch.uint8 or payload.shape != (expected,):
        raise ValueError(
            f"decode expects a 1-D uint8 payload of {expected} bytes for these shapes, "
            f"got {payload.dtype} of shape {tuple(payload.shape)}"
        )
    out, offset = [], 0
    for shape, numel in zip(shapes, numels, strict=True):
        size = sum(_section_parts(numel, settings))
        section = payload[offset : offset + size]
        dense = _decode_one(section, numel, settings) if numel else payload.new_zeros(0).float()
        out.append(dense.view(tuple(shape)))
        offset += size
    return out


def compress_with_feedback(
    errors: Sequence[torch.Tensor],
    deltas: Sequence[torch.Tensor],
    beta: float,
    settings: CodecSettings,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Error-feedback compression: (payload, new fp32 errors).

    ``acc = torch.add(delta.float(), error, alpha=beta)`` per tensor (one fused op, so
    bitwise it may differ from ``beta * error + delta`` computed in two steps), then
    ``payload = encode(acc)`` and ``new_error = acc - decode(payload)``.
    """
    accs = []
    for error, delta in zip(errors, deltas, strict=True):
        if error.shape != delta.shape:
            raise ValueError(f"error shape {tuple(error.shape)} != delta {tuple(delta.shape)}")
        accs.append(torch.add(delta.float(), error, alpha=beta))
    payload = encode(accs, settings)
    decoded = decode(payload, [acc.shape for acc in accs], settings)
    return payload, [acc - dec for acc, dec in zip(accs, decoded, strict=True)]

"""Binary masks at 1 bit per entry: MaTU's per-task masks travel and are stored this way.

Written here because torch has no packbits; the layout is numpy's `packbits` (big-endian bit
order within each byte, the last byte zero-padded), so files can be read with numpy as well.
Masks are packed and unpacked on their own device."""

from __future__ import annotations

import torch

_BIT_WEIGHTS = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8)


def packed_size(numel: int) -> int:
    """Bytes needed for `numel` mask entries."""
    return (numel + 7) // 8


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """A boolean tensor (any shape, read flat) as a uint8 tensor of ⌈n/8⌉ bytes."""
    flat = mask.reshape(-1).to(torch.bool)
    pad = packed_size(flat.numel()) * 8 - flat.numel()
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    return (flat.view(-1, 8).to(torch.uint8) * _BIT_WEIGHTS.to(flat.device)).sum(dim=1, dtype=torch.uint8)


def pack_rows(mask: torch.Tensor) -> torch.Tensor:
    """Each row of a 2-D boolean tensor packed as `pack_bits` packs it: (rows, ⌈n/8⌉) uint8 (the torch
    counterpart of numpy's `packbits(mask, axis=1)`)."""
    rows, n = mask.shape
    bits = mask.to(torch.uint8)
    pad = packed_size(n) * 8 - n
    if pad:
        bits = torch.cat([bits, bits.new_zeros(rows, pad)], dim=1)
    return (bits.reshape(rows, -1, 8) * _BIT_WEIGHTS.to(bits.device)).sum(dim=2, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """Inverse of `pack_bits`: the first `numel` entries as a flat bool tensor."""
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError(f"packed mask must be a 1-D uint8 tensor, got {packed.dtype} with shape {tuple(packed.shape)}")
    if packed.numel() != packed_size(numel):
        raise ValueError(f"packed mask has {packed.numel()} bytes, expected {packed_size(numel)} for {numel} entries")
    bits = (packed.unsqueeze(1) & _BIT_WEIGHTS.to(packed.device)).ne(0).reshape(-1)
    return bits[:numel]

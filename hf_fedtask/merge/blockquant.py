"""Block-wise absmax quantization of flat float vectors to 4 or 8 bits: MaTU's per-task downlink sends
each τ^t this way (`hf_fedtask.strategies.matu`).

Each block of `BLOCK` consecutive entries keeps one bfloat16 scale s = max|x| / L (L = 2^(b-1) - 1 levels
a side) and one code q = round(x / s) in [-L, L] per entry, stored as q + L in b bits, 8/b codes a byte
(the first code in the highest bits); the last block and byte are zero-padded. x is decoded as q·s in
float32, the same on every machine. 4 bits cost 4.25 bits an entry (0.133 of float32), 8 bits 8.25.

Written here because the wire carries plain safetensors tensors: torch's quantized tensors do not
serialize to safetensors, are per tensor or per channel rather than per block, and stop at 8 bits (4 bits
only for embedding bags). 2 bits (three levels) were tried and left out: on `benchmarks/matu_start.py`'s toy
their rounding error, about 70% of a vector's norm, costs a third of the score, and with error feedback
the fed-back error grows as large as the vector and the run diverges."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (4, 8)
BLOCK = 64


def levels(bits: int) -> int:
    """L: the codes of `bits` bits are -L..L."""
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits!r}")
    return 2 ** (bits - 1) - 1


def num_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def code_bytes(numel: int, bits: int) -> int:
    """Bytes of the codes of `numel` entries."""
    per = 8 // bits
    return -(-numel // per)


@dataclass
class Quantized:
    """`codes` (uint8, `code_bytes(numel, bits)`) and `scales` (bfloat16, one a block) of a flat vector."""

    codes: torch.Tensor
    scales: torch.Tensor
    bits: int


@torch.no_grad()
def quantize(flat: torch.Tensor, bits: int) -> Quantized:
    """The codes and scales of a 1-D float tensor (round to nearest, ties to even, as torch.round)."""
    top = levels(bits)
    numel = flat.numel()
    padded = torch.zeros(num_blocks(numel) * BLOCK, dtype=torch.float32, device=flat.device)
    padded[:numel] = flat.reshape(-1).float()
    blocks = padded.view(-1, BLOCK)
    scales = (blocks.abs().amax(1) / top).to(torch.bfloat16)
    s = scales.float().unsqueeze(1)
    q = torch.where(s > 0, torch.round(blocks / torch.where(s > 0, s, 1.0)), 0.0).clamp_(-top, top)
    codes = (q + top).to(torch.uint8).reshape(-1)[:numel]
    return Quantized(_pack(codes, bits), scales, bits)


@torch.no_grad()
def dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The float32 vector of `numel` entries that `codes` and `scales` encode."""
    top = levels(bits)
    if codes.dtype != torch.uint8 or codes.dim() != 1 or codes.numel() != code_bytes(numel, bits):
        raise ValueError(f"codes must be a 1-D uint8 tensor of {code_bytes(numel, bits)} bytes for {numel} entries "
                         f"at {bits} bits, got {codes.dtype} of shape {tuple(codes.shape)}")
    if scales.dim() != 1 or scales.numel() != num_blocks(numel):
        raise ValueError(f"scales must hold {num_blocks(numel)} values for {numel} entries, got {tuple(scales.shape)}")
    q = _unpack(codes, bits, numel).float() - top
    padded = torch.zeros(num_blocks(numel) * BLOCK, dtype=torch.float32, device=codes.device)
    padded[:numel] = q
    return (padded.view(-1, BLOCK) * scales.float().unsqueeze(1)).reshape(-1)[:numel]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return codes.contiguous()
    pad = (-codes.numel()) % per
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    shifts = torch.arange(per - 1, -1, -1, device=codes.device, dtype=torch.uint8) * bits
    return (codes.view(-1, per) << shifts).sum(1, dtype=torch.uint8)


def _unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    per = 8 // bits
    if per == 1:
        return packed
    shifts = torch.arange(per - 1, -1, -1, device=packed.device, dtype=torch.uint8) * bits
    return ((packed.unsqueeze(1) >> shifts) & (2 ** bits - 1)).reshape(-1)[:numel]

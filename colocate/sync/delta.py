"""Lossless weight deltas: what changed in a tensor since the last sync, found byte for byte, encoded, and applied
as a selective overwrite (issue: "send only what changed"; PULSE, Miahi and Belilovsky 2026; TRL's and slime's
delta weight sync).

    delta = encode(previous, current)            # the positions whose bits differ, and their new elements
    apply(engine_tensor, delta)                  # engine_tensor now equals `current`, bit for bit
    delta.nbytes, delta.density                  # what it would send, and the share of elements that changed

Changes are found on the elements' bits (an integer view), not their values: -0.0 against 0.0, or two NaNs with
other payloads, are changes, and a delta applied to the previous bits gives the current bits exactly. Nothing is
computed on the receiving side but a scatter of the new elements into their positions.

The positions travel as gaps from the previous changed position (delta-coded): a gap below 255 is one byte, a
larger one is the byte 255 and a 4-byte gap in a side array. At RL learning rates most changed weights sit close
together, so most gaps take one byte and a changed bf16 weight costs about 3 bytes, not the 6 of a 4-byte index
and its value. When zlib (level 1) makes the whole smaller it is compressed; and when the delta would be as large
as the tensor, `encode` says so (`full`): the receiver then takes the tensor whole.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
ESCAPE = 255  # a gap byte that says: the gap is the next entry of the 4-byte array
LEVEL = 1  # zlib's fastest: the encode runs on the sync's path


def bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s elements as same-width integers, flattened (a view where `t` is contiguous)."""
    return t.detach().reshape(-1).view(_BITS[t.element_size()])


def changed(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """The flat positions (int64, ascending) whose bits differ."""
    assert previous.shape == current.shape and previous.dtype == current.dtype, (previous.shape, current.shape)
    return torch.nonzero(bits(previous) != bits(current), as_tuple=False).reshape(-1)


@dataclass
class Delta:
    numel: int
    element_size: int
    count: int
    """Elements that changed."""
    payload: bytes
    """Gap bytes, the 4-byte gaps, then the new elements' bytes; zlib-compressed when `compressed`."""
    num_large: int
    compressed: bool
    full: bool
    """The delta would be at least the tensor's own size: send the tensor whole instead (`payload` is empty)."""

    @property
    def nbytes(self) -> int:
        """What it sends: the payload, or the whole tensor when `full`."""
        return self.numel * self.element_size if self.full else len(self.payload)

    @property
    def density(self) -> float:
        return self.count / self.numel if self.numel else 0.0


def encode(previous: torch.Tensor, current: torch.Tensor, *, compress: bool = True) -> Delta:
    positions = changed(previous, current).cpu().numpy()
    size, numel, count = current.element_size(), current.numel(), len(positions)
    assert numel < 2**32, "gaps travel in 4 bytes at most"
    gaps = np.diff(positions, prepend=0) if count else np.zeros(0, dtype=np.int64)
    if count:
        gaps[1:] -= 1  # after the first, a gap counts the unchanged positions between two changed ones
    small = gaps < ESCAPE
    gap_bytes = np.where(small, gaps, ESCAPE).astype(np.uint8).tobytes()
    large = gaps[~small].astype(np.uint32).tobytes()
    values = bits(current)[torch.from_numpy(positions).to(current.device)].cpu().numpy().tobytes()
    payload = gap_bytes + large + values
    compressed = False
    if compress and payload:
        packed = zlib.compress(payload, LEVEL)
        if len(packed) < len(payload):
            payload, compressed = packed, True
    full = len(payload) >= numel * size
    return Delta(numel, size, count, b"" if full else payload, int((~small).sum()), compressed, full)


def decode(delta: Delta) -> tuple[np.ndarray, np.ndarray]:
    """(positions int64, the new elements' bytes as integers) of a delta that is not `full`."""
    assert not delta.full, "a full delta carries no positions: the tensor travels whole"
    payload = zlib.decompress(delta.payload) if delta.compressed else delta.payload
    n = delta.count
    gap_bytes = np.frombuffer(payload, dtype=np.uint8, count=n).astype(np.int64)
    large = np.frombuffer(payload, dtype=np.uint32, count=delta.num_large, offset=n).astype(np.int64)
    gaps = gap_bytes.copy()
    gaps[gap_bytes == ESCAPE] = large
    positions = np.cumsum(gaps + 1) - 1
    values = np.frombuffer(payload, dtype=np.dtype(f"i{delta.element_size}") if delta.element_size > 1 else np.uint8,
                           count=n, offset=n + 4 * delta.num_large)
    return positions, values


def apply(target: torch.Tensor, delta: Delta, current: torch.Tensor | None = None) -> None:
    """Overwrite `target`'s changed elements with their new bits (selective overwrite, no arithmetic). A `full`
    delta needs `current`, the tensor to copy whole."""
    if delta.full:
        assert current is not None, "a full delta is the whole tensor: pass it"
        target.copy_(current)
        return
    if not delta.count:
        return
    assert target.is_contiguous(), "a selective overwrite writes through a view of the target's own storage"
    positions, values = decode(delta)
    flat = bits(target)
    flat[torch.from_numpy(positions).to(target.device)] = torch.from_numpy(values.copy()).to(target.device)

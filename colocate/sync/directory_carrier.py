"""The broadcast's stand-in over shared storage (sync.carrier=directory): for engines that reach the trainers only
through a directory both can read, a Ray cluster of their own or another site. The feeder writes each of its
broadcasts to a file, every engine worker of that TP rank reads it; with sync.delta (sync/delta_channel.py) the
files hold the slices' changes, so the storage carries what changed, not the model.

    channel = DirectoryChannel(root, name="3fa9-tp0", rank=0, timeout_s=60)   # the feeder (rank 0)
    channel.broadcast(data)          # rank 0 writes the next file; every other rank waits for it and reads it

It has BroadcastChannel's face (sync/broadcast.py), so the feeder and the receive run over either unchanged.
Each broadcast is the channel's next file, `<root>/<name>/<sequence>.bin`: a header (magic, payload bytes, CRC-32
of the payload) and the payload, written to a temporary name and renamed into place, so a reader never sees a
file being written. A reader checks the length and the checksum before it copies anything: a torn or corrupted
file (storage that lost a write, a copy cut short) is refused (TornFile) and nothing is applied. A file that does
not appear within `timeout_s` raises, as a lost member of a broadcast group does.

Files are removed by the feeder two syncs after they were written (`begin_version`): by then every engine has
loaded the sync that read them, since a sync returns only once every engine's load of every bucket did.
"""

from __future__ import annotations

import os
import struct
import time
import zlib
from pathlib import Path

import torch

from colocate.sync.broadcast import BroadcastError

MAGIC = b"CLCD"
HEAD = struct.Struct("<4sQI")  # magic, payload bytes, CRC-32
POLL_S = 0.002


class TornFile(BroadcastError):
    """A carrier file whose length or checksum does not hold: nothing of it was applied."""


class DirectoryChannel:
    def __init__(self, root: str | Path, *, name: str, rank: int, timeout_s: float):
        self.directory = Path(root) / name
        self.name, self.rank, self.timeout_s = name, rank, timeout_s
        self.sequence = 0
        self.starts: dict[int, int] = {}  # version -> its first file's sequence (the feeder's, for removal)
        if rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)

    def path(self, sequence: int) -> Path:
        return self.directory / f"{sequence:010d}.bin"

    def broadcast(self, data: torch.Tensor) -> None:
        """Rank 0's `data` into every member's `data`, through the next file (BroadcastChannel.broadcast's face)."""
        if data.numel() == 0:
            return
        path = self.path(self.sequence)
        self.sequence += 1
        raw = data.detach().reshape(-1).view(torch.uint8).cpu()
        if self.rank == 0:
            payload = raw.numpy().tobytes()
            temporary = path.with_suffix(".tmp")
            with open(temporary, "wb") as f:
                f.write(HEAD.pack(MAGIC, len(payload), zlib.crc32(payload)))
                f.write(payload)
            os.replace(temporary, path)  # atomic: a reader sees the whole file or none
            return
        payload = self._read(path, raw.numel())
        data.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))

    def _read(self, path: Path, expected: int) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while not path.exists():
            if time.monotonic() > deadline:
                raise BroadcastError(f"the directory carrier {self.directory}: {path.name} did not appear within "
                                     f"{self.timeout_s:g} s (the feeder stopped, or the storage does not share it)")
            time.sleep(POLL_S)
        blob = path.read_bytes()
        where = f"the directory carrier's {path}"
        if len(blob) < HEAD.size:
            raise TornFile(f"{where} is torn: {len(blob)} bytes, shorter than its header; nothing applied")
        magic, size, crc = HEAD.unpack_from(blob)
        payload = blob[HEAD.size:]
        if magic != MAGIC or size != expected or len(payload) != size or zlib.crc32(payload) != crc:
            raise TornFile(f"{where} is torn or corrupted (magic {magic!r}, {len(payload)} of {size} payload bytes "
                           f"for {expected} expected, checksum {'ok' if zlib.crc32(payload) == crc else 'wrong'}); "
                           "nothing applied")
        return payload

    def begin_version(self, version: int) -> None:
        """The feeder starts sync `version`: the files of sync version - 2 and before are removed."""
        if self.rank != 0:
            return
        self.starts[version] = self.sequence
        keep_from = self.starts.get(version - 1)
        if keep_from is None:
            return
        for old in sorted(self.starts):
            if old < version - 1:
                del self.starts[old]
        for path in self.directory.glob("*.bin"):
            if int(path.stem) < keep_from:
                path.unlink(missing_ok=True)

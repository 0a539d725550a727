"""A chunk's fp32 weights in a scratch file mapped shared, so the pages a stage has read go back to the system when
it is done with them.

Why: coremltools' torch frontend turns every parameter into an fp32 const that is a view of the torch tensor, and its
fp16 pass then makes an fp16 copy of each. In anonymous memory the whole fp32 chunk (~4 GB for E2B's chunk_3) stays
resident beside the whole fp16 program (~2 GB) until the conversion returns: that sum was the converter's peak. Backed
by a file, a page that was read is only a cached copy of the file: `drop` unmaps it (madvise DONTNEED; the data stays
in the file and a later read maps it back), so the fp32 weight a cast has just copied no longer counts, and the
chunk's functions still trace from the same tensors.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import torch

ALIGN = 64  # bytes: each tensor starts on a cache line, as an allocator would place it


class MappedWeights:
    """One scratch file of `nbytes`, mapped shared; `take` hands out tensors in it, `drop` returns their pages. The
    file is unlinked at once: it lives as long as the mapping and is never left behind, even by a killed process."""

    def __init__(self, path: Path, nbytes: int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.unlink(path)
            os.ftruncate(fd, max(nbytes, 1))
            self._map = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self._base, self._size = self._bytes.data_ptr(), len(self._bytes)  # plain ints: drop_range runs in traces
        self._used = 0
        self._extent: dict[int, int] = {}  # address -> bytes of each tensor taken

    @staticmethod
    def size_of(tensors) -> int:
        """Bytes of a file holding `tensors` (anything with .numel() and .element_size()), as `take` lays them out."""
        return sum(-(-t.numel() * t.element_size() // ALIGN) * ALIGN for t in tensors)

    def take(self, like: torch.Tensor) -> torch.Tensor:
        """The next free tensor of `like`'s shape and dtype in the file (its values are whatever the file holds)."""
        nbytes = like.numel() * like.element_size()
        start, self._used = self._used, self._used + -(-nbytes // ALIGN) * ALIGN
        if self._used > self._size:
            # internal: size_of sized the file for exactly these tensors
            raise RuntimeError(f"scratch weights: {self._used} bytes taken from a file of {self._size}")
        tensor = self._bytes[start : start + nbytes].view(like.dtype).view(like.shape)
        self._extent[tensor.data_ptr()] = nbytes
        return tensor

    def holds(self, array: np.ndarray) -> bool:
        address = array.__array_interface__["data"][0]
        return self._base <= address < self._base + self._size

    def drop(self, array: np.ndarray | None = None) -> None:
        """Unmap the resident pages of `array` (a view into the file), or of the whole file."""
        if array is None:
            self.drop_range(self._base, self._size)
        else:
            self.drop_range(array.__array_interface__["data"][0], array.nbytes)

    def drop_tensor(self, address: int) -> None:
        """Unmap the pages of the tensor taken at `address` (its data_ptr; an int, so a trace records nothing)."""
        self.drop_range(address, self._extent.get(address, 0))

    def drop_range(self, address: int, nbytes: int) -> None:
        """Unmap the whole pages of [address, address + nbytes) that lie in the file; the data stays in the file."""
        start = max(address - self._base, 0)
        stop = min(address - self._base + nbytes, self._size)
        start = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
        stop = stop // mmap.PAGESIZE * mmap.PAGESIZE
        if stop > start:
            self._map.madvise(mmap.MADV_DONTNEED, start, stop - start)

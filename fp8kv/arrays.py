"""Framework-neutral description of an array argument: what the core validates and plans from."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArrayInfo:
    """Shape, strides (in elements), dtype name and device string of one array argument."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    device: str

    @classmethod
    def contiguous(cls, shape, dtype: str, device: str) -> "ArrayInfo":
        shape = tuple(int(n) for n in shape)
        strides, step = [], 1
        for n in reversed(shape):
            strides.append(step)
            step *= max(n, 1)
        return cls(shape, tuple(reversed(strides)), dtype, device)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def drop_dim(self, dim: int) -> "ArrayInfo":
        """The view that fixes index 0 of ``dim`` (e.g. the K half of a combined cache)."""
        keep = [i for i in range(self.ndim) if i != dim]
        return ArrayInfo(tuple(self.shape[i] for i in keep), tuple(self.strides[i] for i in keep),
                         self.dtype, self.device)


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(n) for n in shape) + "]"

"""Host-to-device staging of a step's small inputs through reusable pinned buffers.

Every decode step copies a few packed int64/float32 arrays to the device (block tables, positions, catch-up
feeds, sampling parameters). ``tensor.pin_memory()`` per copy asks the CUDA caching host allocator for a
fresh page-locked block each time, copies the array into it, and hands the block back once the copy's event
has completed; at 256 requests with a 4,096-token context that batch is ~0.5 MB per step. Writing the array
straight into a pinned buffer that lives as long as the engine skips the allocator round trip and the extra
host copy: one ``memcpy`` into pinned memory and one asynchronous copy per array.

The buffers are used as a bump arena, ``num_buffers`` of them in turn. Leaving a buffer records a CUDA event
on the current stream; coming back to it waits for that event, so no array is overwritten before the copy
that reads it has run -- whether or not the engine synchronises between steps. An array larger than one
buffer takes the ordinary ``pin_memory()`` path.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# Device copies read host memory in wide transactions; 64 bytes also satisfies every dtype's alignment.
_ALIGN = 64


class PinnedStaging:
    """``to_device(array)``: an asynchronous copy of a host array onto ``device`` through pinned memory.

    On a CPU device the array is returned as a tensor that owns a copy (never a view of a reused buffer).
    ``pin`` exists for tests on machines without CUDA: the arena logic runs over ordinary host memory.
    """

    def __init__(self, device: torch.device, buffer_bytes: int = 4 << 20, num_buffers: int = 2,
                 pin: bool | None = None) -> None:
        if buffer_bytes < _ALIGN or num_buffers < 2:
            raise ValueError(f"need buffer_bytes >= {_ALIGN} and num_buffers >= 2, got {buffer_bytes}, {num_buffers}")
        self.device = device
        self._cuda = device.type == "cuda"
        pin = self._cuda if pin is None else pin
        self._buffers = [torch.empty(buffer_bytes, dtype=torch.uint8, pin_memory=pin) for _ in range(num_buffers)]
        self._events: list[torch.cuda.Event | None] = [None] * num_buffers
        self._current = 0
        self._offset = 0
        self.num_fallbacks = 0  # arrays larger than a buffer (a long prefill batch), staged the ordinary way

    @property
    def buffer_bytes(self) -> int:
        return self._buffers[0].numel()

    def _next_buffer(self) -> None:
        """Leave the current buffer (its copies are marked done by an event) for the next one, once the
        copies that last read the next one have run."""
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events[self._current] = event
        self._current = (self._current + 1) % len(self._buffers)
        self._offset = 0
        waiting = self._events[self._current]
        if waiting is not None:
            waiting.synchronize()
            self._events[self._current] = None

    def to_device(self, data: np.ndarray | Tensor) -> Tensor:
        """``data`` (a host array or CPU tensor) on the device; the copy is asynchronous on CUDA."""
        array = np.require(data.numpy() if isinstance(data, Tensor) else data, requirements="C")
        nbytes = array.nbytes
        dtype = torch.from_numpy(np.empty(0, dtype=array.dtype)).dtype
        if nbytes == 0:
            return torch.empty(array.shape, dtype=dtype, device=self.device)
        if nbytes > self.buffer_bytes:
            self.num_fallbacks += 1
            host = torch.from_numpy(array)
            return host.pin_memory().to(self.device, non_blocking=True) if self._cuda else host.clone()
        start = -(-self._offset // _ALIGN) * _ALIGN
        if start + nbytes > self.buffer_bytes:
            self._next_buffer()
            start = 0
        self._offset = start + nbytes
        raw = self._buffers[self._current][start : start + nbytes]
        host = raw.view(dtype).reshape(array.shape)
        host.numpy()[...] = array
        if self._cuda:
            return host.to(self.device, non_blocking=True)
        return host.clone()

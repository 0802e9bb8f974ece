"""``CpuAccelerator``: the accelerator of CPU-only runs (gloo). See [Note: CPU accelerator semantics]
in ``zero_core.protocols.accelerator``."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from zero_core.accelerator._validate import check_index, check_rng_state, check_seed, check_tensor
from zero_core.accelerator.typed_tensors import LEGACY_CPU_TYPES, TensorFactory, TypedTensorsMixin

if TYPE_CHECKING:
    from zero_core.protocols.accelerator import Event, Stream

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class CpuEvent:
    """A CPU event: recording captures a timestamp; CPU work is already complete when recorded."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.enable_timing = bool(enable_timing)
        self._time: float | None = None
        self._recorded = False

    def record(self, stream: Stream | None = None) -> None:
        self._recorded = True
        if self.enable_timing:
            self._time = time.perf_counter()

    def synchronize(self) -> None:
        # All CPU work issued before record() has finished by the time record() returns.
        return None

    def query(self) -> bool:
        return True

    def wait(self, stream: Stream | None = None) -> None:
        return None

    def elapsed_time(self, end_event: CpuEvent) -> float:
        """Milliseconds between this event's and ``end_event``'s records (as torch.cuda.Event)."""
        if not isinstance(end_event, CpuEvent):
            raise TypeError(f"elapsed_time: end_event must be a CpuEvent, got {type(end_event).__name__}")
        if not (self.enable_timing and end_event.enable_timing):
            raise RuntimeError("elapsed_time: both events must be created with enable_timing=True")
        if self._time is None or end_event._time is None:
            raise RuntimeError("elapsed_time: both events must be recorded before measuring")
        return (end_event._time - self._time) * 1000.0


class CpuStream:
    """A CPU stream: work runs synchronously on the issuing thread, so ordering is trivial."""

    def __init__(self, device: torch.device | str | int | None = None, priority: int = 0) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: Stream) -> None:
        return None

    def wait_event(self, event: Event) -> None:
        return None

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = CpuEvent() if event is None else event
        event.record(self)
        return event


def _rss_bytes() -> int:
    """Current resident set size of this process."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except OSError:
        # No procfs: ru_maxrss (KiB on Linux) is the best portable approximation.
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_rss_bytes() -> int:
    """Peak RSS (VmHWM) of this process since start or since the last reset."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class CpuAccelerator(TypedTensorsMixin):
    """The host CPU as an accelerator.

    * One device: ``device_count()`` is 1, ``set_device(i)`` accepts any non-negative index as
      a no-op, because all ranks on a host share the CPU (a launcher calls ``set_device(local_rank)``
      on every rank).
    * Memory: ``memory_allocated`` is the process RSS (``/proc/self/statm``),
      ``max_memory_allocated`` the peak RSS (``VmHWM`` in ``/proc/self/status``).
      ``reset_peak_memory_stats`` resets the kernel's peak by writing ``5`` to
      ``/proc/self/clear_refs`` (Linux >= 4.0); where that is not permitted the peak is the
      process lifetime peak (``getrusage``). These counts include everything the process holds
      (interpreter, libraries), not only tensors: compare differences, not absolute values.
    * Pinned memory: ``pin_memory`` returns the tensor unchanged unless CUDA is present (pinning
      only matters for host-to-device copies).
    """

    device_type = "cpu"
    Stream = CpuStream
    Event = CpuEvent

    def __init__(self) -> None:
        self._current_stream = CpuStream()
        # Highest RSS this object has sampled since the last reset. The kernel's VmHWM is
        # updated lazily (per-thread RSS counters are folded in periodically), so it can lag
        # a value we already observed; the peak reported is the max of both.
        self._observed_peak = 0

    def _sample(self) -> tuple[int, int]:
        current = _rss_bytes()
        self._observed_peak = max(self._observed_peak, current)
        return current, max(_peak_rss_bytes(), self._observed_peak)

    def __repr__(self) -> str:
        return "CpuAccelerator()"

    # -- devices ---------------------------------------------------------------------------
    def is_available(self) -> bool:
        return True

    def device_name(self, index: int | None = None) -> str:
        check_index(index, "CpuAccelerator.device_name")
        return "cpu"

    def device(self, index: int | None = None) -> torch.device:
        check_index(index, "CpuAccelerator.device")
        return torch.device("cpu")

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "cpu"

    def set_device(self, index: int) -> None:
        if index is None:
            raise ValueError("CpuAccelerator.set_device: index must be a non-negative int, got None")
        check_index(index, "CpuAccelerator.set_device")

    def device_count(self) -> int:
        return 1

    def communication_backend_name(self) -> str:
        return "gloo"

    # -- streams and events --------------------------------------------------------------
    @contextmanager
    def stream(self, stream: CpuStream | None) -> Iterator[CpuStream | None]:
        if stream is not None and not isinstance(stream, CpuStream):
            raise TypeError(
                f"CpuAccelerator.stream: expected a CpuStream or None, got {type(stream).__name__}"
            )
        previous = self._current_stream
        if stream is not None:
            self._current_stream = stream
        try:
            yield stream
        finally:
            self._current_stream = previous

    def current_stream(self, index: int | None = None) -> CpuStream:
        check_index(index, "CpuAccelerator.current_stream")
        return self._current_stream

    def default_stream(self, index: int | None = None) -> CpuStream:
        check_index(index, "CpuAccelerator.default_stream")
        return self._current_stream

    def synchronize(self, index: int | None = None) -> None:
        check_index(index, "CpuAccelerator.synchronize")

    def record_stream(self, tensor: torch.Tensor, stream: Stream) -> None:
        """No-op: CPU work is synchronous, so memory freed after a use is never still in use."""
        check_tensor(tensor, "CpuAccelerator.record_stream")

    # -- memory --------------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int:
        check_index(index, "CpuAccelerator.memory_allocated")
        return self._sample()[0]

    def max_memory_allocated(self, index: int | None = None) -> int:
        check_index(index, "CpuAccelerator.max_memory_allocated")
        return self._sample()[1]

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        check_index(index, "CpuAccelerator.reset_peak_memory_stats")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # documented: the peak then stays the lifetime peak
        self._observed_peak = _rss_bytes()

    def memory_stats(self, index: int | None = None) -> dict[str, int]:
        """CUDA-style keys for the two counters the CPU has (both are RSS, see class doc)."""
        check_index(index, "CpuAccelerator.memory_stats")
        current, peak = self._sample()
        return {
            "allocated_bytes.all.current": current,
            "allocated_bytes.all.peak": peak,
            "rss_bytes": current,
            "peak_rss_bytes": peak,
        }

    def empty_cache(self) -> None:
        return None

    # -- pinned memory -------------------------------------------------------------------
    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        check_tensor(tensor, "CpuAccelerator.pin_memory")
        if tensor.device.type != "cpu":
            raise ValueError(f"CpuAccelerator.pin_memory: tensor must be on the CPU, got {tensor.device}")
        if torch.cuda.is_available() and not tensor.is_pinned():
            return tensor.pin_memory()
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        check_tensor(tensor, "CpuAccelerator.is_pinned")
        return tensor.device.type == "cpu" and tensor.is_pinned()

    # -- RNG -----------------------------------------------------------------------------
    def manual_seed(self, seed: int) -> None:
        check_seed(seed, "CpuAccelerator.manual_seed")
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        check_index(index, "CpuAccelerator.get_rng_state")
        return torch.get_rng_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        check_index(index, "CpuAccelerator.set_rng_state")
        check_rng_state(state, "CpuAccelerator.set_rng_state")
        torch.set_rng_state(state)

    # -- dtypes --------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def _typed_tensor(self, dtype: torch.dtype) -> TensorFactory:
        # torch's legacy CPU tensor types, as DeepSpeed's CPU accelerator returns them
        return LEGACY_CPU_TYPES[dtype]

    def supported_dtypes(self) -> list[torch.dtype]:
        """fp32, bf16 and fp16 (DeepSpeed's CPU accelerator lists the same)."""
        return [torch.float32, torch.bfloat16, torch.float16]

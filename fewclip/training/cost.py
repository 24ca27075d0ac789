"""What a run cost: wall time, training time, images encoded, peak memory and trainable parameters.

``RunCost`` is started when a run starts (after its backbone and dataset are loaded, which a sweep shares
between runs) and its ``record()`` goes into the run's ``metrics.json``:

* ``wall_time_s``: the run, from its split to its test accuracy.
* ``train_time_s``: the training itself (the loop or ``fit``, validation included). Encoding the frozen
  tower's features is not part of it (that is shared work, below); encoding fresh pixels at every step is.
* ``images_encoded``: every image passed through an image tower for this run: test images, validation
  images, training images in every view, every freshly encoded batch. Shared work is charged in full to
  every run that uses it, so a run costs the same whether it ran first or last in a sweep;
  ``images_encoded_shared`` says how many of them this run did not encode itself but took from a cache
  (the rest were encoded during this run, and are in its wall time), and ``images_from_store`` how many
  of those came from the on-disk feature store (``fewclip.features.store``): encoded by another worker process or
  an earlier sweep, not by this process.
* ``peak_rss_mib``: the process's peak resident memory during the run (``VmHWM`` of ``/proc/self/status``,
  reset at the run's start with ``/proc/self/clear_refs`` where Linux allows it; ``peak_rss_reset`` says
  whether it was). It includes what the process already held: the backbone and, in a sweep, the cache.
* ``peak_cuda_mib``: on CUDA, the allocator's peak (``torch.cuda.max_memory_allocated``, reset at the run's
  start); ``None`` on the CPU.
* ``trainable_parameters``: the number of trainable adapter parameters.

``scripts/bench_lora.py`` measures one training step with the same functions.
"""
from __future__ import annotations

import ctypes
import gc
import resource
import sys
import time
from typing import Optional

import torch

MiB = 2**20


def rss_bytes() -> int:
    """The process's resident set size now (Linux; 0 where ``/proc`` is not available)."""
    return _status("VmRSS:") or 0


def peak_rss_bytes() -> int:
    """The process's peak resident set size: ``VmHWM`` (which ``reset_peak_rss`` resets), else ``ru_maxrss``."""
    hwm = _status("VmHWM:")
    if hwm is not None:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def _status(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss(collect: bool = False) -> bool:
    """Hand freed heap memory back to the system and reset the peak RSS to the current RSS; False where it
    cannot be reset (not Linux, or Linux < 4.0). ``collect`` runs the garbage collector first (about 0.3 s
    with torch loaded, so runs leave it to Python; a benchmark that wants setup's garbage gone asks for it)."""
    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so new work has to touch new ones
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # 5: reset the peak RSS to the current RSS
        return True
    except OSError:
        return False


class RunCost:
    """The cost of one run (see the module docstring); ``count_images`` and ``training`` are fed by the engine."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.images_encoded = 0
        self.images_encoded_shared = 0
        self.images_from_store = 0
        self.train_time_s = 0.0
        self.rss_reset = reset_peak_rss()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._t0 = time.perf_counter()

    def count_images(self, used: int, encoded: Optional[int] = None, from_store: int = 0) -> None:
        """``used`` images went through an image tower for this run; ``encoded`` of them now (default: all),
        the rest came from a cache, ``from_store`` of them from the on-disk feature store."""
        encoded = used if encoded is None else encoded
        if not 0 <= int(from_store) <= int(used) - int(encoded):
            raise ValueError(f"{from_store} images from the store, but {used - encoded} not encoded by this run")
        self.images_encoded += int(used)
        self.images_encoded_shared += int(used) - int(encoded)
        self.images_from_store += int(from_store)

    def record(self, trainable_parameters: int) -> dict:
        cuda = self.device.type == "cuda"
        return {
            "wall_time_s": round(time.perf_counter() - self._t0, 3),
            "train_time_s": round(self.train_time_s, 3),
            "images_encoded": self.images_encoded,
            "images_encoded_shared": self.images_encoded_shared,
            "images_from_store": self.images_from_store,
            "peak_rss_mib": round(peak_rss_bytes() / MiB, 1),
            "peak_rss_reset": self.rss_reset,
            "peak_cuda_mib": round(torch.cuda.max_memory_allocated(self.device) / MiB, 1) if cuda else None,
            "trainable_parameters": int(trainable_parameters),
        }

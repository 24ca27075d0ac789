"""Randomness is an argument: library code takes a ``torch.Generator`` or a seed, and never reseeds the process.

Some code fewclip stands on draws from torch's global RNG and takes no generator: ``nn.Dropout`` (LoRA's
dropout while training), peft's initialisation of LoRA's A matrices, open_clip's weight initialisation.
``forked_global_rng`` is the one place that handles it: such code runs on a fork of the global RNG
(``torch.random.fork_rng``) seeded from a seed or a generator of ours, and the caller's RNG state is
restored afterwards, so callers never need to guard against fewclip moving it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Union

import torch


def seed_from(generator: torch.Generator) -> int:
    """A seed drawn from ``generator`` (advances it by one draw)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator).item())


@contextmanager
def forked_global_rng(seed: Union[int, torch.Generator]) -> Iterator[None]:
    """Run the body on torch's global RNG (CPU, and every CUDA device in use) seeded with ``seed`` (or a seed
    drawn from a generator), then restore the global RNG as it was."""
    if isinstance(seed, torch.Generator):
        seed = seed_from(seed)
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)  # inside the fork only: the caller's state comes back on exit
        yield

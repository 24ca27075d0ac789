"""The parity harness: fixtures made by running the authors' code (tests/fixtures/*/README.md says how each was
made) and the check that compares fewclip against them, keeping the largest difference per method for the
closing lines of ``pytest -s``."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file

FIXTURE_ROOT = Path(__file__).resolve().parents[1] / "fixtures"


def fixture_loader(folder: Path) -> Callable[[str], tuple[dict[str, torch.Tensor], dict]]:
    """``load(name)`` -> (the tensors of ``folder/name.safetensors``, the JSON of ``folder/name.json``)."""
    def load(name: str):
        return load_file(str(folder / f"{name}.safetensors")), json.loads((folder / f"{name}.json").read_text())
    return load


class Parity:
    """``check(what, got, want)``: max |got - want| within the tolerance, the largest per method (``what``'s first
    word) kept for :meth:`print_worst`."""

    def __init__(self, tol: float):
        self.tol = tol
        self.worst: dict[str, tuple[float, str]] = {}

    def check(self, what: str, got, want, tol: float | None = None) -> float:
        tol = self.tol if tol is None else tol
        diff = float((torch.as_tensor(got).detach().float() - torch.as_tensor(want).float()).abs().max())
        method = what.split()[0]
        self.worst[method] = max(self.worst.get(method, (0.0, "")), (diff, what))
        assert diff <= tol, f"{what}: max |fewclip - authors| = {diff:.3g} > {tol}"
        return diff

    def print_worst(self) -> None:
        for method, (diff, what) in sorted(self.worst.items()):
            print(f"\n{method}: largest difference from the authors' code {diff:.2e} ({what})")

"""Largest difference between fewclip's text-prompt methods and their authors' code, per fixture.

    python scripts/prompt_parity.py          # about 20 s on the 2-core CPU

Rebuilds every fixture of ``tests/fixtures/prompt_ref`` (numbers the authors' repositories computed on the
tiny CLIP of ``tests/helpers/tiny_clip.py``: CoOp in five layouts, CoCoOp, KgCoOp, ProGrad, TCP, and the zero-shot
baseline) with fewclip (``tests/helpers/prompt_parity.py``: logits in every text mode, text features, losses, one
step's gradients and parameters through the engine's loop), and prints, per fixture, the largest absolute
difference and where it is, with the range of the numbers compared.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parents[1] / "tests"
sys.path.insert(0, str(TESTS))

from helpers.prompt_parity import ALL_FIXTURES, TOLERANCE, checks, load, max_diff, tiny_backbone  # noqa: E402


def main() -> int:
    torch.set_num_threads(1)
    bb = tiny_backbone()
    print(f"{'fixture':15s} {'checks':>6s} {'largest |diff|':>15s}  {'where':48s} {'|value| up to':>13s}  "
          f"authors' code")
    worst_all = 0.0
    for name in ALL_FIXTURES:
        results = checks(bb, name)
        diffs = [(max_diff(got, want), what, float(want.abs().max())) for what, got, want in results]
        d, what, scale = max(diffs)
        worst_all = max(worst_all, d)
        meta = load(name)[1]
        repo = meta.get("authors_commit", "")[:8]
        files = ", ".join(f for f in meta.get("authors_files", []) if f.endswith(".py"))[:60]
        print(f"{name:15s} {len(results):6d} {d:15.2e}  {what[:48]:48s} {scale:13.3g}  {files} @ {repo}")
    print(f"largest difference over all fixtures: {worst_all:.2e} (tolerance of the tests: {TOLERANCE:g})")
    return 0 if worst_all <= TOLERANCE else 1


if __name__ == "__main__":
    sys.exit(main())

"""Record the zero-shot top-1 of every shipped reference backbone on every toy task.

    python scripts/record_reference_zeroshot.py            # writes fewclip/reference/zeroshot.json

Each card is evaluated on the CPU on a fixed, class-stratified subset of each
task's test split (``data.max_test=200``, subset seed 1, the task's full
template ensemble), the same path as ``fewclip zeroshot backbone=CARD
data=TASK data.max_test=200 backbone.device=cpu``. ``tests/test_reference.py``
recomputes every number and compares it to the recorded one to two decimals,
so a change to the loader, the geometries, the toy world or the weights that
moves a reference accuracy fails loudly. It also records the base and new
halves of toy-objects (CoCoOp's base-to-novel split, ``protocols.plan_base2new``),
each on its own 200-image subset with the same seed, so a change to the class
split or to the class-subset view fails as well. Rerun this script only when such a
change is intended, and say why in the commit message.
"""
import logging
import platform
import sys
from pathlib import Path

import torch

from fewclip.backbones.backbone import REFERENCE_DIR, BackboneConfig, load_backbone, shipped_cards
from fewclip.data.protocols import plan_base2new
from fewclip.data.splits import TEST_SUBSET_SEED
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets.toytasks import TASKS
from fewclip.runs.run import score_zeroshot
from fewclip.utils.io import atomic_write_json
from fewclip.utils.logs import setup_logging

log = logging.getLogger("fewclip.record_reference_zeroshot")

FORMAT = "fewclip.reference-zeroshot/1"
MAX_TEST = 200
TEMPLATES = "ensemble"
DEVICE = "cpu"
COMMAND = "python scripts/record_reference_zeroshot.py"
BASE2NEW_TASK = "toy-objects"


def record() -> dict:
    """Zero-shot top-1 (percent, 2 decimals) per shipped card and toy task."""
    datasets = {task: build_dataset(DataConfig(name=task, max_test=MAX_TEST)) for task in TASKS}
    halves = {e.name: e.dataset for e in plan_base2new(datasets[BASE2NEW_TASK]).evals}
    top1, n_test, sha = {}, {}, {}
    b2n_top1, b2n_n_test = {}, {}
    for card, path in shipped_cards().items():
        if not card.startswith("toy-"):  # the first toy world's cards only (world 2's: scripts/world2_check.py)
            continue
        bb = load_backbone(BackboneConfig(name=str(path), device=DEVICE))
        sha[card] = bb.weights_sha256
        top1[card] = {}
        for task, ds in datasets.items():
            m = score_zeroshot(bb, ds, templates=TEMPLATES, max_test=MAX_TEST)
            top1[card][task] = round(m["top1"], 2)
            n_test[task] = m["n_test"]
        b2n_top1[card] = {}
        for half, ds in halves.items():
            m = score_zeroshot(bb, ds, templates=TEMPLATES, max_test=MAX_TEST)
            b2n_top1[card][half] = round(m["top1"], 2)
            b2n_n_test[half] = m["n_test"]
    return {
        "format": FORMAT,
        "command": COMMAND,
        "subset": {"split": "test", "max_test": MAX_TEST, "seed": TEST_SUBSET_SEED, "templates": TEMPLATES,
                   "n_test": n_test},
        "device": f"{DEVICE} ({platform.machine()}), torch {torch.__version__}",
        "weights_sha256": sha,
        "top1": top1,
        "base2new": {"task": BASE2NEW_TASK, "n_test": b2n_n_test, "top1": b2n_top1},
    }


def main(argv) -> int:
    out = Path(argv[0]) if argv else REFERENCE_DIR / "zeroshot.json"
    setup_logging("warning")
    result = record()
    atomic_write_json(out, result)
    tasks = list(TASKS)
    print(f"{'backbone':12s} " + " ".join(f"{t:>14s}" for t in tasks))
    for card, row in result["top1"].items():
        print(f"{card:12s} " + " ".join(f"{row[t]:13.2f}%" for t in tasks))
    b2n = result["base2new"]
    for card, row in b2n["top1"].items():
        print(f"{card:12s} {b2n['task']} base {row['base']:.2f}%  new {row['new']:.2f}%")
    print(f"-> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

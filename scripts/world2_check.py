"""Check a world-2 backbone's properties (issue 31): zero-shot top-1 per task, and how well its image tower
clusters by class (1-shot nearest neighbour: a test image gets the label of its most similar one-per-class
training image, cosine similarity of the image embeddings).

    OMP_NUM_THREADS=1 python scripts/world2_check.py backbone=w2-clip
    python scripts/world2_check.py backbone=/tmp/w2out/w2-clip.yaml max_test=1000

Prints one row per task (w2-net's domain-shift targets: zero-shot only) and the averages; exit 0.
"""
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.data.splits import sample_few_shot, test_items
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets.world2tasks import DOMAIN_SHIFT_TARGETS, FEWSHOT_TASKS
from fewclip.features.encode import extract_features
from fewclip.runs.run import score_zeroshot


@dataclass
class CheckConfig:
    backbone: str = "w2-clip"
    max_test: Optional[int] = 2000
    seed: int = 1


def nn_one_shot(bb, ds, max_test, seed) -> float:
    """Top-1 of a 1-shot nearest neighbour on the image embeddings (cosine), mean over the seed's draw."""
    pool = ds.items("train")
    train = [pool[i] for i in sample_few_shot([it.label for it in pool], 1, seed)]
    f_tr, y_tr = extract_features(bb, ds, train, batch_size=256, desc=f"{ds.name} 1-shot")
    f_te, y_te = extract_features(bb, ds, test_items(ds, max_test), batch_size=256, desc=f"{ds.name} test")
    a = torch.nn.functional.normalize(f_tr.float(), dim=-1)
    b = torch.nn.functional.normalize(f_te.float(), dim=-1)
    pred = y_tr[(b @ a.T).argmax(1)]
    return float((pred == y_te).float().mean() * 100)


def main(argv) -> int:
    opts = dict(a.split("=", 1) for a in argv if "=" in a)
    bad = [a for a in argv if "=" not in a] + [k for k in opts if k not in ("backbone", "max_test", "seed")]
    if bad:
        print(f"world2_check: unknown argument(s) {bad}; use backbone=NAME max_test=N seed=S", file=sys.stderr)
        return 2
    cfg = CheckConfig(backbone=opts.get("backbone", "w2-clip"), max_test=int(opts.get("max_test", 2000)),
                      seed=int(opts.get("seed", 1)))
    bb = load_backbone(BackboneConfig(name=cfg.backbone, device="cpu"))
    print(f"{'task':15s} {'classes':>7s} {'zs single':>9s} {'zs ens':>7s} {'1-NN':>6s}")
    rows = []
    t0 = time.time()
    for task in FEWSHOT_TASKS + DOMAIN_SHIFT_TARGETS["w2-net"]:
        ds = build_dataset(DataConfig(name=task, max_test=cfg.max_test))
        zs1 = score_zeroshot(bb, ds, templates="single", max_test=cfg.max_test)["top1"]
        zse = score_zeroshot(bb, ds, templates="ensemble", max_test=cfg.max_test)["top1"]
        nn = nn_one_shot(bb, ds, cfg.max_test, cfg.seed) if "train" in ds.splits else float("nan")
        rows.append((task, zs1, zse, nn))
        print(f"{task:15s} {len(ds.classnames):7d} {zs1:9.1f} {zse:7.1f} {nn:6.1f}", flush=True)
    few = [r for r in rows if r[0] in FEWSHOT_TASKS]
    print(f"{'average (10)':15s} {'':7s} {np.mean([r[1] for r in few]):9.1f} {np.mean([r[2] for r in few]):7.1f} "
          f"{np.mean([r[3] for r in few]):6.1f}   ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

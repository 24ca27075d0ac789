"""Check a world-2 backbone's properties (issue 31): zero-shot top-1 per task, and how well its image tower
clusters by class (1-shot nearest neighbour: a test image gets the label of its most similar one-per-class
training image, cosine similarity of the image embeddings).

    OMP_NUM_THREADS=1 python scripts/world2_check.py backbone=w2-clip
    python scripts/world2_check.py backbone=/tmp/w2out/w2-clip.yaml max_test=1000 probe=true

Prints one row per task (w2-net's domain-shift targets: zero-shot only) and the averages; exit 0. ``probe=true``
adds a quick linear probe at 1, 4 and 16 shots (the seed's draw; a multinomial logistic regression on the
L2-normalised image embeddings, fit by L-BFGS with a fixed small L2 penalty: how much the image tower holds beyond
zero-shot, not fewclip's ``linear_probe`` method with its validation search).
"""
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.config.compose import ConfigError, load_config
from fewclip.data.splits import sample_few_shot, test_items
from fewclip.datasets import DataConfig, build_dataset
from fewclip.datasets.world2tasks import DOMAIN_SHIFT_TARGETS, FEWSHOT_TASKS
from fewclip.features.encode import extract_features
from fewclip.runs.run import score_zeroshot


@dataclass
class CheckConfig:
    # a section, as in every fewclip command: `backbone=w2-clip` or `backbone=/path/card.yaml` sets its name
    backbone: BackboneConfig = field(default_factory=lambda: BackboneConfig(name="w2-clip", device="cpu"))
    max_test: Optional[int] = 2000
    seed: int = 1
    probe: bool = False


def shot_features(bb, ds, shots: int, seed: int):
    """L2-normalised image embeddings and labels of the seed's ``shots``-per-class draw of the train split."""
    pool = ds.items("train")
    train = [pool[i] for i in sample_few_shot([it.label for it in pool], shots, seed)]
    f, y = extract_features(bb, ds, train, batch_size=256, desc=f"{ds.name} {shots}-shot")
    return torch.nn.functional.normalize(f.float(), dim=-1), y


def nn_one_shot(train, test) -> float:
    """Top-1 of a nearest neighbour (cosine) on the image embeddings: ``train`` and ``test`` are (features,
    labels) pairs, the features L2-normalised."""
    (a, y_tr), (b, y_te) = train, test
    return float((y_tr[(b @ a.T).argmax(1)] == y_te).float().mean() * 100)


def quick_probe(train, test, n_classes: int) -> float:
    """Top-1 of a logistic regression on ``train`` (features, labels), L-BFGS, L2 penalty 1e-3."""
    (a, y_tr), (b, y_te) = train, test
    w = torch.zeros(a.shape[1], n_classes, requires_grad=True)
    bias = torch.zeros(n_classes, requires_grad=True)
    opt = torch.optim.LBFGS([w, bias], max_iter=200, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(a @ w * 10 + bias, y_tr) + 1e-3 * (w ** 2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float(((b @ w * 10 + bias).argmax(1) == y_te).float().mean() * 100)


def main(argv) -> int:
    try:
        cfg = load_config(argv, CheckConfig)
    except (ConfigError, ValueError) as e:  # an unknown key, a value of the wrong type
        print(f"world2_check: {e}", file=sys.stderr)
        return 2
    bb = load_backbone(cfg.backbone)
    shots = (1, 4, 16) if cfg.probe else ()
    print(f"{'task':15s} {'classes':>7s} {'zs single':>9s} {'zs ens':>7s} {'1-NN':>6s}"
          + "".join(f" {'LP' + str(k):>6s}" for k in shots))
    rows = []
    t0 = time.time()
    for task in FEWSHOT_TASKS + DOMAIN_SHIFT_TARGETS["w2-net"]:
        ds = build_dataset(DataConfig(name=task, max_test=cfg.max_test))
        zs1 = score_zeroshot(bb, ds, templates="single", max_test=cfg.max_test)["top1"]
        zse = score_zeroshot(bb, ds, templates="ensemble", max_test=cfg.max_test)["top1"]
        nn, lp = float("nan"), [float("nan")] * len(shots)
        if "train" in ds.splits:  # the test images encoded once, each draw once, for 1-NN and the probes
            f_te, y_te = extract_features(bb, ds, test_items(ds, cfg.max_test), batch_size=256, desc=f"{task} test")
            test = (torch.nn.functional.normalize(f_te.float(), dim=-1), y_te)
            draws = {k: shot_features(bb, ds, k, cfg.seed) for k in sorted({1, *shots})}
            nn = nn_one_shot(draws[1], test)
            lp = [quick_probe(draws[k], test, len(ds.classnames)) for k in shots]
        rows.append((task, zs1, zse, nn, *lp))
        print(f"{task:15s} {len(ds.classnames):7d} {zs1:9.1f} {zse:7.1f} {nn:6.1f}"
              + "".join(f" {x:6.1f}" for x in lp), flush=True)
    few = [r for r in rows if r[0] in FEWSHOT_TASKS]
    print(f"{'average (10)':15s} {'':7s} {np.mean([r[1] for r in few]):9.1f} {np.mean([r[2] for r in few]):7.1f} "
          f"{np.mean([r[3] for r in few]):6.1f}" + "".join(f" {np.mean([r[4 + j] for r in few]):6.1f}"
                                                          for j in range(len(shots)))
          + f"   ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

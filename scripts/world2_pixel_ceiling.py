"""How well can a world-2 task be told apart from its pixels alone? A small CNN trained from scratch on many
rendered images of the task's concepts (far more than any few-shot split), scored on the task's test split after
each epoch. If it ends well above what a backbone's features reach (a 16-shot linear probe), the limit is the
backbone's image tower, not the renderer (issue 31: few shots add little over zero-shot on world 2).

    OMP_NUM_THREADS=1 python scripts/world2_pixel_ceiling.py task=w2-cars per_class=150 epochs=8

The training images are rendered at indices far from the task's own splits (``OFFSET``), in the task's style and
difficulty. Prints one line per epoch; exit 0, or 2 for a bad argument.
"""
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

OFFSET = 50_000_000  # render indices of the training images: the task's splits use small ones


@dataclass
class CeilingConfig:
    task: str = "w2-cars"
    per_class: int = 150  # rendered training images per class
    epochs: int = 8
    seed: int = 0


def make_net(classes: int) -> nn.Module:
    def block(cin, cout):
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU()]

    return nn.Sequential(*block(3, 32), nn.MaxPool2d(2), *block(32, 64), nn.MaxPool2d(2), *block(64, 128),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, classes))


def to_tensor(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255) - 0.5


def main(argv) -> int:
    import fewclip.datasets.world2 as w2
    from fewclip.config.compose import ConfigError, load_config
    from fewclip.datasets import DataConfig, build_dataset

    try:
        cfg = load_config(argv, CeilingConfig)
    except ConfigError as e:
        print(f"world2_pixel_ceiling: {e}", file=sys.stderr)
        return 2
    ds = build_dataset(DataConfig(name=cfg.task))
    spec, per, epochs = ds.spec, cfg.per_class, cfg.epochs
    torch.manual_seed(cfg.seed)
    C = len(spec.concepts)
    n = np.arange(per * C, dtype=np.int64)
    concepts = np.asarray(spec.concepts, dtype=np.int64)[n % C]
    styles = np.full(len(n), w2.STYLES.index(spec.style))
    x = to_tensor(w2.render(concepts, styles, spec.seed, n + OFFSET, difficulty=spec.difficulty))
    y = torch.from_numpy(n % C)
    x_test = to_tensor(ds.render_split("test"))
    y_test = torch.tensor([it.label for it in ds.items("test")])
    net = make_net(C)
    opt = torch.optim.Adam(net.parameters(), 2e-3)
    t0 = time.time()
    print(f"{cfg.task}: {C} classes, {per} rendered training images each, {len(y_test)} test images")
    for epoch in range(epochs):
        net.train()
        order = torch.randperm(len(x))
        for i in range(0, len(x), 128):
            b = order[i:i + 128]
            loss = nn.functional.cross_entropy(net(x[b]), y[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            top1 = float((net(x_test).argmax(1) == y_test).float().mean() * 100)
        print(f"epoch {epoch + 1}/{epochs}: loss {loss.item():.3f}, test top-1 {top1:.1f} ({time.time() - t0:.0f} s)",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

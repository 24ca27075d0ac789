"""Benchmark the cache-based methods: training time for 100 classes x 16 shots on ViT-B-32, and what each
run encodes, in one run.

    python scripts/bench_cache.py                 # every method below, CPU
    python scripts/bench_cache.py methods=tip_adapter,lpp threads=1

Setting: ViT-B-32 with random weights (its text tower builds the zero-shot classifiers of 100 ImageNet class
names), 100 classes x 16 shots (1600 training images), 4 validation images per class, 1000 test images.
The images are tiny synthetic pictures and the image tower is replaced by *random features*: a fixed
random projection of the average-pooled pixels (768-d, ViT-B-32's width), then a fixed random projection to the
512-d embedding (ViT-B-32's ``visual.proj``), so augmented views differ as views do, and every image that
reaches the tower is counted. As for every tower with a projection, the feature cache keeps the features before
it and derives the projected ones (``fewclip.features.store``): ProLIP and the other methods share one encoding.
Each method runs through ``fewclip.runs.run.run_train`` with the defaults of ``fewclip adapters``, all runs sharing
one feature cache as a sweep's runs do.

Printed per method: the training time (``train_time_s``: the fit or the loop, not the frozen tower), the
run's wall time, the images the run charged (``images_encoded``: every image it used, shared ones included),
how many of them the image tower encoded *during* that run, and what it expected: the un-augmented training
images, the views the method asks for (``fit_views()``, or the loop's ``train.augment_views``), the validation
images where it uses them, and the test images. The script fails if any run encoded an image beyond the
shared views (a method encoding fresh pixels per epoch, as Tip-Adapter-F's and TaskRes's own code do, would),
or if the image tower saw more images than the union of the views every method asked for.

CoOp is left out (200 epochs of its text tower on ViT-B-32 is hours on a CPU; one epoch is timed by
``scripts/bench_train.py``).
"""
import sys
import tempfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.config.compose import load_config

DEFAULT_METHODS = "tip_adapter,tip_adapter_f,clip_adapter,taskres,lpp,clap,gda,proker,prolip,zs_probe,linear_probe"
# Settings a method runs with here instead of its defaults: ProLIP's own recipe searches 49 (lr, lambda) pairs of
# 300 full-batch epochs on 300 views, which is minutes on a GPU and hours on this CPU; here one run (lr 1e-5,
# lambda 1 / shots: its no-validation recipe) on 20 views.
# ProKeR's search solves an N x N system (N = 16000 here) for each of its 200 grid points: here one solve, at
# ImageNet's tuned beta and lambda (its search=false values).
BENCH_SETTINGS = {"prolip": ["adapter.search=false", "adapter.views=20"], "proker": ["adapter.search=false"]}


@dataclass
class BenchConfig:
    arch: str = "ViT-B-32"
    classes: int = 100
    shots: int = 16
    test_per_class: int = 10
    methods: str = DEFAULT_METHODS
    threads: int = 0
    seed: int = 1


def synthetic_dataset(classes: int, shots: int, test_per_class: int):
    """A dataset of tiny pictures: each image is a colour field with a class-dependent and an image-dependent
    tint (16 x 16 pixels; the views crop and resize them to the backbone's size)."""
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from fewclip.datasets import Dataset, Item

    class Synthetic(Dataset):
        def load_image(self, item):
            g = torch.Generator().manual_seed(zlib.crc32(item.id.encode()))
            tint = torch.tensor([item.label % 5, item.label % 7, item.label % 3]) / 10
            base = torch.rand(3, generator=g) * 0.5 + tint
            px = (base[None, None, :] + 0.2 * torch.rand(16, 16, 3, generator=g)).clamp(0, 1)
            return Image.fromarray((px * 255).to(torch.uint8).numpy())

    def split(name, per_class):
        return [Item(f"{name}/{c}/{i}", c) for c in range(classes) for i in range(per_class)]

    return Synthetic(name="synthetic", classnames=list(IMAGENET_CLASSNAMES[:classes]), templates=["a photo of a {}."],
                     splits={"train": split("train", shots), "val": split("val", 4),
                             "test": split("test", test_per_class)})


class RandomImageTower:
    """Random features for the backbone's image tower: a fixed projection of 8 x 8 average-pooled pixels; counts
    every image it encodes."""

    def __init__(self, dim: int):
        self.proj = torch.randn(3 * 8 * 8, dim, generator=torch.Generator().manual_seed(0))
        self.images = 0

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        self.images += len(pixels)
        pooled = F.adaptive_avg_pool2d(pixels.float(), 8).flatten(1)  # [B, 192]
        return pooled @ self.proj


def main(argv):
    cfg = load_config(argv, BenchConfig)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from fewclip.adapters import adapter_info
    from fewclip.features.encode import FeatureCache
    from fewclip.runs.run import load_train_config, run_train

    torch.manual_seed(0)  # the random weights (a script may seed the process; the library never does)
    bb = load_backbone(BackboneConfig(name=cfg.arch, pretrained="none", device="cpu"))
    dim = int(bb.encode_text(["a"]).shape[-1])
    # the image tower of this benchmark (instance attributes; the class is untouched): random features of the
    # ViT's width, then a fixed projection; every method's features come from this one tower
    width = int(bb.image_projection().shape[0])
    tower = RandomImageTower(width)
    bb.encode_images_preproj = tower
    projection = torch.randn(width, dim, generator=torch.Generator().manual_seed(1)) / width ** 0.5
    bb.image_projection = lambda: projection
    bb.encode_images = lambda pixels: tower(pixels) @ projection  # the same tower, had anything asked it directly
    ds = synthetic_dataset(cfg.classes, cfg.shots, cfg.test_per_class)
    # the few-shot split: shots per class, min(shots, 4) validation images per class (fewclip.datasets)
    n, n_val, n_test = cfg.classes * cfg.shots, cfg.classes * min(cfg.shots, 4), len(ds.items("test"))
    cache = FeatureCache()
    methods = [m for m in cfg.methods.split(",") if m]
    print(f"{len(methods)} methods, {cfg.arch} random weights (text tower) + random image features ({width}-d, "
          f"then a fixed projection to {dim}-d), "
          f"{cfg.classes} classes x {cfg.shots} shots ({n} training, {n_val} validation, {n_test} test images), "
          f"CPU, {torch.get_num_threads()} threads")
    print(f"  {'method':14s} {'train (s)':>10s} {'wall (s)':>9s} {'charged':>8s} {'encoded now':>11s} "
          f"{'expected':>30s}")
    views_asked = 0
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in methods:
            run_cfg = load_train_config([f"adapter={name}", f"shots={cfg.shots}", f"seed={cfg.seed}",
                                         "data.templates=single", "log_level=warning", *BENCH_SETTINGS.get(name, [])])
            before = tower.images
            m = run_train(run_cfg, Path(tmp) / name, backbone=bb, dataset=ds, cache=cache)
            encoded_now = tower.images - before
            cls = adapter_info(name).adapter_cls
            if cls.trained_by == "fit":
                adapter = cls(run_cfg.adapter, bb, ds.classnames, ds.prompts("single"))
                views, plain, val = adapter.fit_views(), 1, 1
            else:  # the engine's loop on cached views
                views, plain, val = min(run_cfg.train.augment_views, m["epochs"]), 0, int(run_cfg.train.select == "val")
            expected = (plain + views) * n + val * n_val + n_test
            what = f"{plain + views} x {n}" + (f" + {n_val}" if val else "") + f" + {n_test}"
            print(f"  {name:14s} {m['train_time_s']:10.2f} {m['wall_time_s']:9.2f} {m['images_encoded']:8d} "
                  f"{encoded_now:11d} {what + ' = ' + str(expected):>30s}")
            if m["images_encoded"] != expected or m["images_encoded"] - m["images_encoded_shared"] != encoded_now:
                bad.append(f"{name}: charged {m['images_encoded']}, encoded {encoded_now} now, expected {expected}")
            views_asked = max(views_asked, views)
    union = (1 + views_asked) * n + n_val + n_test  # the un-augmented images, the views any method asked for
    print(f"  image tower, all methods together: {tower.images} images; the shared views: (1 + {views_asked}) x {n} "
          f"+ {n_val} + {n_test} = {union}")
    if tower.images > union:
        bad.append(f"the image tower encoded {tower.images} images, more than the {union} of the shared views")
    if bad:
        print("FAILED: " + "; ".join(bad))
        return 1
    print("OK: no method encoded an image beyond the shared views")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

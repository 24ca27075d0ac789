"""Why Tip-Adapter and LP++ fall short on the toy tasks: what the cache holds, what validation can choose, and
what the choices would give. A diagnostic, not a method: it reads test labels to *measure* what a perfect
choice would reach; no method ever does (``tests/test_cache_methods.py``).

    python scripts/diagnose_cache.py                                  # 4 reference backbones x 5 tasks
    python scripts/diagnose_cache.py backbones=toy-clip shots=1,16

For each backbone, task and shot count (seed 1 unless ``seeds=``), with the same features, views and split
as the sweep's runs:

* ``zs``: zero-shot test top-1.
* ``1nn`` and ``mean``: the cache alone as a classifier: the label of the nearest key (the geometry's
  similarity), and the nearest class mean of the keys in the geometry's linear space. How much class
  information the image-to-image similarities carry, without the text.
* ``same-other``: the mean gap ``s_max - s`` of a test image to the keys of its own class and to those of
  the other classes: the affinity can only separate classes by the difference.
* Tip-Adapter: test top-1 at the (beta, alpha) chosen on validation, and the largest test top-1 over the
  whole default grid (an oracle) and over a wide grid (beta and alpha log-spaced up to 1000); ``ties``: how
  many of the 4000 grid points tie at the best validation accuracy.
* LP++: test top-1 at the epoch chosen on validation, the best and the last epoch's (oracle), and on how many
  of the 300 epochs validation accuracy equals its maximum.
"""
import sys
from dataclasses import dataclass

import torch

from fewclip.config.compose import load_config


@dataclass
class DiagConfig:
    backbones: str = "toy-clip,toy-euclip,toy-meru,toy-siglip"
    tasks: str = "toy-shapes,toy-sketch,toy-patterns,toy-positions,toy-colours"
    shots: str = "1,4,16"
    seeds: str = "1"
    threads: int = 1


def top1(logits, y):
    return 100.0 * float((logits.argmax(-1).cpu() == y).double().mean())


def main(argv):
    cfg = load_config(argv, DiagConfig)
    torch.set_num_threads(cfg.threads)
    from fewclip.adapters import build_adapter
    from fewclip.adapters._cache import search_alpha_beta
    from fewclip.backbones.backbone import BackboneConfig, load_backbone
    from fewclip.data.splits import test_items
    from fewclip.datasets import DataConfig, build_dataset, make_few_shot_split
    from fewclip.features.encode import FeatureCache
    from fewclip.runs.run import load_train_config
    from fewclip.training.engine import RunFeatures

    wide = [float(v) for v in torch.logspace(-1, 3, 41)]
    print("test top-1 (%); tip: chosen / oracle on the default grid / oracle on a wide grid; "
          "lpp: chosen / best / last epoch")
    print(f"{'backbone':11s} {'task':14s} {'k':>2s} {'zs':>5s} {'1nn':>5s} {'mean':>5s} {'same-other':>12s}  "
          f"{'tip chosen/grid/wide':>20s} {'ties':>5s}  {'lpp chosen/best/last':>20s} {'val ties':>8s}")
    for bname in cfg.backbones.split(","):
        bb = load_backbone(BackboneConfig(name=bname, device="cpu"))
        g = bb.geometry
        for task in cfg.tasks.split(","):
            ds = build_dataset(DataConfig(name=task, templates="single"))
            cache = FeatureCache()
            for k in (int(v) for v in cfg.shots.split(",")):
                for seed in (int(v) for v in cfg.seeds.split(",")):
                    split = make_few_shot_split(ds, k, seed)
                    run = {}
                    for name in ("tip_adapter", "lpp"):
                        rc = load_train_config([f"adapter={name}", f"backbone={bname}", f"data={task}",
                                                "data.templates=single", f"shots={k}", f"seed={seed}"])
                        gen = torch.Generator().manual_seed(seed)
                        ad = build_adapter(rc.adapter, bb, ds.classnames, ds.prompts("single"), generator=gen)
                        rf = RunFeatures(ad, ds, split, rc.train, seed=seed, cache=cache)
                        data = rf.fit_data(ad.fit_views(), k, gen)
                        run[name] = (ad, data, rf)
                    tip, data, rf = run["tip_adapter"]
                    tx, ty = rf.test(test_items(ds, None))
                    with torch.no_grad():
                        img = g.embed_image(tx)
                        zs = g.logits(img, tip.prototypes)
                        tip.fit(data)
                        keys, L = tip.cache_keys, tip.cache_values
                        s = g.similarity(img, keys)  # [B, N]
                        nn1 = L[s.argmax(-1)].argmax(-1)
                        lin = g.to_linear(keys)
                        means = torch.stack([lin[data.train.y == c].mean(0) for c in range(len(ds.classnames))])
                        mean_pred = g.similarity(img, g.from_linear(means)).argmax(-1)
                        gap = tip.s_max - s
                        own = L[:, ty].T.bool()  # [B, N]: key of the image's class
                        same, other = float(gap[own].mean()), float(gap[~own].mean())
                        chosen = top1(tip(tx), ty)
                        _, _, grid = search_alpha_beta(zs, gap, L, ty, [0.1 + i * 6.9 / 200 for i in range(200)],
                                                       [0.1 + j * 2.9 / 20 for j in range(20)], "first")
                        _, _, wgrid = search_alpha_beta(zs, gap, L, ty, wide, wide, "first")
                        vx, vy = data.val
                        vimg = g.embed_image(vx)
                        _, _, vgrid = search_alpha_beta(g.logits(vimg, tip.prototypes), tip.s_max - g.similarity(
                            vimg, keys), L, vy, [0.1 + i * 6.9 / 200 for i in range(200)],
                            [0.1 + j * 2.9 / 20 for j in range(20)], "first")
                        ties = int((vgrid == vgrid.max()).sum())
                    lpp, ldata, _ = run["lpp"]
                    train = ldata.views[0]
                    f, sl = lpp._parts(train.x.double())
                    vf, vs = lpp._parts(ldata.val.x.double())
                    tf, ts = lpp._parts(tx.double())
                    curve, vcurve = [], []

                    def record(epoch, W, b, alpha):
                        curve.append(top1(tf @ W.T + b + alpha * ts, ty))
                        vcurve.append(top1(vf @ W.T + b + alpha * vs, ldata.val.y))

                    lpp.fit(ldata)  # the method as it runs (init, step sizes, validation choice)
                    with torch.no_grad():
                        lchosen = top1(lpp(tx), ty)
                    lpp.cfg.epochs = 0  # the initialisation again, then the same epochs with the recorder
                    lpp.fit(ldata)
                    W0, b0, a0 = (p.detach().double().clone() for p in (lpp.weight, lpp.bias, lpp.alpha))
                    lpp.cfg.epochs = 300
                    lpp.train_blocks(f, sl, train.y, vf, vs, ldata.val.y, W0, b0, a0, on_epoch=record)
                    vties = sum(v == max(vcurve) for v in vcurve)
                    print(f"{bname:11s} {task:14s} {k:2d} {top1(zs, ty):5.1f} {100 * float((nn1 == ty).double().mean()):5.1f}"
                          f" {100 * float((mean_pred == ty).double().mean()):5.1f} {same:5.2f}-{other:5.2f}  "
                          f"{chosen:6.1f}/{float(grid.max()):5.1f}/{float(wgrid.max()):5.1f} {ties:5d}  "
                          f"{lchosen:6.1f}/{max(curve):5.1f}/{curve[-1]:5.1f} {vties:8d}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Benchmark one CoOp epoch: fewclip's fast path against the faithful path, in one run.

    python scripts/bench_train.py                         # CPU: ViT-B-32, random weights
    python scripts/bench_train.py arch=ViT-B-16 precision=bf16 device=cuda

Setting: 100 classes, 16 shots (1600 training images, 50 steps of 32 per epoch),
CoOp with 16 unified context vectors before the class name.

* faithful: every step encodes its 32 images with the frozen image tower and runs
  the text tower on all 100 prompts at the full 77-token context (CoOp's reference code);
* fast: image features come from the cache (encoded once per view, before training),
  and the text tower runs the shared start+context prefix once, with each class's
  remaining tokens attending to it as cached keys/values.

* compiled: the same cached-feature paths with the text step compiled by ``torch.compile``
  (``fewclip.training.compiled``, what ``train.compile=on`` does) and the fused optimiser where torch has
  one; the compile's one-off time is reported beside it (``compile=false`` skips these rows).

All are timed for a few steps each (forward, backward, optimiser step) and scaled to
an epoch; the one-off cost of caching K views is reported beside it. The largest logit
difference between the two paths is measured on the same images (no augmentation).
Images are random pixels: the timing does not depend on their content.
"""
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.config.compose import load_config
from fewclip.training.compiled import compile_text_step, fused_supported, uncompile_text_step


@dataclass
class BenchConfig:
    arch: str = "ViT-B-32"
    precision: str = "fp32"
    device: str = "auto"
    classes: int = 100
    shots: int = 16
    batch_size: int = 32
    n_ctx: int = 16
    faithful_steps: int = 3
    fast_steps: int = 20
    views: int = 8
    threads: int = 0
    # also time the compiled text step and the fused optimiser (eager vs compiled in one run)
    compile: bool = True


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, steps, device):
    fn()  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def main(argv):
    cfg = load_config(argv, BenchConfig)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from fewclip.adapters.coop import CoOp, CoOpConfig

    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(name=cfg.arch, pretrained="none", precision=cfg.precision, device=cfg.device))
    dev = bb.device
    names = list(IMAGENET_CLASSNAMES[: cfg.classes])
    coop = CoOp(CoOpConfig(n_ctx=cfg.n_ctx), bb, names)
    opt = torch.optim.SGD([coop.ctx], lr=0.002, momentum=0.9)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" and cfg.precision != "fp32" \
        else torch.autocast(dev.type, enabled=False)
    n_train = cfg.classes * cfg.shots
    steps_per_epoch = -(-n_train // cfg.batch_size)
    S = bb.image_size
    pixels = torch.randn(cfg.batch_size, 3, S, S)
    labels = torch.randint(0, cfg.classes, (cfg.batch_size,), device=dev)

    # Feature extraction throughput (what caching costs).
    big = torch.randn(256 if dev.type == "cuda" else 64, 3, S, S)
    with amp:
        ips = big.shape[0] / timed(lambda: bb.encode_images(big), 3 if dev.type == "cuda" else 1, dev)
    cache = bb.encode_images(pixels)

    def step(mode, encode):
        coop.set_text_mode(mode)
        with amp:
            feats = bb.encode_images(pixels) if encode else cache
            loss = F.cross_entropy(coop(feats).float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    t_faithful = timed(lambda: step("faithful", True), cfg.faithful_steps, dev)
    t_trunc = timed(lambda: step("truncate", False), cfg.fast_steps, dev)
    t_fast = timed(lambda: step("shared", False), cfg.fast_steps, dev)
    compiled_rows, compile_s, eager_again = [], {}, {}
    if cfg.compile:
        if fused_supported(lambda ps, fused=False: torch.optim.SGD(ps, lr=0.002, momentum=0.9, fused=fused),
                           [coop.ctx]):
            opt = torch.optim.SGD([coop.ctx], lr=0.002, momentum=0.9, fused=True)
        compiled_diff = 0.0
        for mode, label in (("truncate", "cut to longest prompt"), ("shared", "shared prefix")):
            coop.set_text_mode(mode)
            uncompile_text_step(coop)
            with torch.no_grad(), amp:
                ref = coop(cache).float()
            compile_text_step(coop)
            compiled_fn = coop.__dict__[coop.text_step]
            with torch.no_grad(), amp:
                compiled_diff = max(compiled_diff, float((coop(cache).float() - ref).abs().max()))
            t0 = time.perf_counter()
            step(mode, False)  # the training graph's compile (once per text mode)
            compile_s[mode] = time.perf_counter() - t0
            # eager and compiled steps alternate, so that a busy machine slows both alike
            t_e, t_c = [], []
            for _ in range(cfg.fast_steps):
                for fn, out in ((None, t_e), (compiled_fn, t_c)):
                    if fn is None:
                        uncompile_text_step(coop)
                    else:
                        coop.__dict__[coop.text_step] = fn
                    sync(dev)
                    t0 = time.perf_counter()
                    step(mode, False)
                    sync(dev)
                    out.append(time.perf_counter() - t0)
            eager_again[mode] = sorted(t_e)[len(t_e) // 2]
            compiled_rows.append((f"cached features + {label}, compiled", sorted(t_c)[len(t_c) // 2], mode))
        uncompile_text_step(coop)
    with torch.no_grad(), amp:
        feats = bb.encode_images(pixels)
        coop.set_text_mode("faithful")
        a = coop(feats).float()
        coop.set_text_mode("shared")
        b = coop(feats).float()
    diff = float((a - b).abs().max())

    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    cache_s = cfg.views * n_train / ips
    print(f"CoOp epoch, {cfg.arch} random weights, {cfg.precision}, {cfg.classes} classes x {cfg.shots} shots "
          f"({steps_per_epoch} steps of {cfg.batch_size}), n_ctx={cfg.n_ctx}, on {where}")
    print(f"  prompt length: {coop.tokens.shape[1]} tokens (shared prefix {coop.shared_len}) of "
          f"{coop.tower.context_length}")
    print(f"  {'path':42s} {'s/step':>9s} {'s/epoch':>9s} {'speed-up':>9s}")
    rows = [("faithful (image tower + 77 tokens)", t_faithful),
            ("cached features + cut to longest prompt", t_trunc),
            ("cached features + shared prefix (fewclip)", t_fast)]
    for name, t in rows:
        print(f"  {name:42s} {t:9.4f} {t * steps_per_epoch:9.2f} {t_faithful / t:8.1f}x")
    for name, t, mode in compiled_rows:
        print(f"  {name:42s} {t:9.4f} {t * steps_per_epoch:9.2f} {t_faithful / t:8.1f}x   "
              f"(eager {eager_again[mode]:.4f} s/step alternating with it: {eager_again[mode] / t:.2f}x; "
              f"compile {compile_s[mode]:.0f} s once)")
    if compiled_rows:
        print(f"  largest logit difference, compiled vs eager, same features (before the compiled steps): "
              f"{compiled_diff:.2e}")
    print(f"  feature extraction: {ips:.1f} images/s; caching {cfg.views} views of {n_train} images "
          f"costs {cache_s:.1f} s once per run")
    print(f"  largest logit difference, faithful vs fast, same images: {diff:.2e}")
    paths = {name: t for name, t in rows} | {name: t for name, t, _ in compiled_rows}
    return {"arch": cfg.arch, "precision": cfg.precision, "classes": cfg.classes, "shots": cfg.shots,
            "device": where, "steps_per_epoch": steps_per_epoch, "s_per_step": paths,
            "reference_s_per_epoch": t_faithful * steps_per_epoch,
            "best_s_per_epoch": min(paths.values()) * steps_per_epoch,
            "speedup_vs_reference": t_faithful / min(paths.values()), "logit_diff": diff,
            "eager_alternating_s_per_step": eager_again}


if __name__ == "__main__":
    main(sys.argv[1:])

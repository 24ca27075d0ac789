"""Benchmark one CoCoOp epoch: fewclip's per-image shared prefix against the authors' procedure, in one run.

    python scripts/bench_cocoop.py                           # CPU: ViT-B-16, random weights, 100 classes
    python scripts/bench_cocoop.py rows=[64,128,256,512,0]   # also other row lengths of the packing (0: one row)
    python scripts/bench_cocoop.py precision=bf16 device=cuda

Setting: CoCoOp's base-to-novel config (4 context vectors from "a photo of a", class name at the end, batch 1,
SGD), 100 ImageNet class names, 16 shots (an epoch is 1600 steps of one image). CoCoOp's text tower runs for
every image and every class:

* faithful (``trainers/cocoop.py`` of KaiyangZhou/CoOp): every step encodes its image with the frozen image
  tower, then runs the 100 prompts of that image, ``[start] ctx + pi(x) [name] . [end]``, through the text
  tower at the full 77-token context;
* truncate: cached image features; the 100 prompts cut after the longest (exact under the causal mask);
* fewclip (the default): cached image features; the image's prefix (start token and its shifted
  context, the same for all classes) and the classes' remaining tokens, packed end to end in rows of about
  256 tokens (``rows=[...]`` times other lengths too), each row one sequence: ~470 tokens per image instead
  of 100 x 77.

Each path is timed for a few steps (forward, backward, optimiser step) and scaled to an epoch, and for scoring
test images (no gradients). The largest logit difference between the faithful and the fewclip path is
measured on the same images. Images are random pixels: the timing does not depend on their content.
"""
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fewclip.backbones.backbone import BackboneConfig, load_backbone
from fewclip.config.compose import load_config


@dataclass
class BenchConfig:
    arch: str = "ViT-B-16"
    precision: str = "fp32"
    device: str = "auto"
    classes: int = 100
    shots: int = 16
    images: int = 4  # distinct images the steps cycle through (and the logits are compared on)
    faithful_steps: int = 2
    fast_steps: int = 8
    # Row lengths of the packing to time besides the default (0: all classes in one row).
    rows: list[int] = field(default_factory=list)
    threads: int = 0


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, steps, device):
    fn(0)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    for i in range(steps):
        fn(i + 1)
    sync(device)
    return (time.perf_counter() - t0) / steps


def main(argv):
    cfg = load_config(argv, BenchConfig)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    from fewclip.adapters.cocoop import ROW_TOKENS, CoCoOp, CoCoOpConfig

    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(name=cfg.arch, pretrained="none", precision=cfg.precision, device=cfg.device))
    dev = bb.device
    names = list(IMAGENET_CLASSNAMES[: cfg.classes])
    ad = CoCoOp(CoCoOpConfig(), bb, names, generator=torch.Generator().manual_seed(0))
    opt = torch.optim.SGD(ad.trainable_parameters(), lr=0.002, momentum=0.9, weight_decay=5e-4)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" and cfg.precision != "fp32" \
        else torch.autocast(dev.type, enabled=False)
    steps_per_epoch = cfg.classes * cfg.shots  # batch 1
    S = bb.image_size
    pixels = torch.randn(cfg.images, 3, S, S, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, cfg.classes, (cfg.images,), generator=torch.Generator().manual_seed(2)).to(dev)
    with amp:
        cache = bb.encode_images(pixels)

    def step(mode, encode):
        def run(i):
            k = i % cfg.images
            ad.set_text_mode(mode)
            with amp:
                feats = bb.encode_images(pixels[k : k + 1]) if encode else cache[k : k + 1]
                loss = F.cross_entropy(ad(feats).float(), labels[k : k + 1])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return run

    def score(mode, encode):
        def run(i):
            ad.set_text_mode(mode)
            with torch.no_grad(), amp:
                ad(bb.encode_images(pixels) if encode else cache)
        return run

    can_share = ad.tower.can_share_prefix and ad.shared_len >= 2
    rows = [("faithful (image tower + 77 tokens per image)", "faithful", True, None),
            ("cached features + cut to longest prompt", "truncate", False, None)]
    if can_share:
        rows += [(f"cached features + per-image prefix, rows of {n or 'all'}", "shared", False, n)
                 for n in cfg.rows if n != ROW_TOKENS]
        rows.append((f"fewclip: per-image prefix, packed rows of {ROW_TOKENS}", "shared", False, ROW_TOKENS))
    results = []
    for label, mode, encode, n in rows:
        if n is not None:
            ad.set_row_tokens(n if n > 0 else 10 ** 9)
        steps = cfg.faithful_steps if mode == "faithful" else cfg.fast_steps
        t_step = timed(step(mode, encode), steps, dev)
        t_score = timed(score(mode, encode), 1 if mode == "faithful" else 2, dev) / cfg.images
        results.append((label, t_step, t_score, mode, n))

    ad.set_row_tokens(ROW_TOKENS)
    with torch.no_grad(), amp:
        feats = bb.encode_images(pixels)
        ad.set_text_mode("faithful")
        a = ad(feats).float()
        ad.set_text_mode("shared" if can_share else "truncate")
        b = ad(feats).float()
    diff = float((a - b).abs().max())

    where = torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    packed = ad._rows_pos.numel() if can_share else 0
    print(f"CoCoOp epoch, {cfg.arch} random weights, {cfg.precision}, {cfg.classes} classes x {cfg.shots} shots "
          f"({steps_per_epoch} steps of 1 image), n_ctx=4, on {where}")
    print(f"  prompt length: {ad.tokens.shape[1]} tokens cut, {ad.tower.context_length} full; shared prefix "
          f"{ad.shared_len}; {packed} packed suffix slots ({ad._rows_pos.shape[0] if can_share else 0} rows) "
          f"against {cfg.classes * ad.tower.context_length} tokens per image in full")
    base_step, base_score = results[0][1], results[0][2]
    print(f"  {'path':56s} {'s/step':>8s} {'s/epoch':>9s} {'speed-up':>9s} {'score s/image':>14s} {'speed-up':>9s}")
    for label, t_step, t_score, _, _ in results:
        print(f"  {label:56s} {t_step:8.3f} {t_step * steps_per_epoch:9.1f} {base_step / t_step:8.1f}x "
              f"{t_score:14.3f} {base_score / t_score:8.1f}x")
    print(f"  largest logit difference, faithful vs fewclip, same {cfg.images} images: {diff:.2e}")


if __name__ == "__main__":
    main(sys.argv[1:])

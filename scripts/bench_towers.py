"""Benchmark one training step of the methods that tune the towers' weights: fewclip's step against the
authors' procedure (SkipTuning: also against the un-skipped procedure it saves on).

    python scripts/bench_towers.py                                  # ViT-B-16 (random weights), 100 classes, CPU
    python scripts/bench_towers.py arch=toy-clip classes=8 steps=5 threads=1
    python scripts/bench_towers.py classes=1000 device=cuda out=towers.json
    python scripts/bench_towers.py methods=skiptuning classes=1000   # SkipTuning's savings, ImageNet's classes

What the procedures do (``procedures=``, a comma list), for CLIP-SVD (``clip_svd``) and 2SFS's stage 1
(``2sfs``: its LayerNorms in both towers; stage 2 trains a [C, D] classifier on image-tower outputs under
no_grad, the same in both procedures):

* ``authors``: for 2SFS, ``fs/twostage.py``'s stage-1 step (text at the full context length); for CLIP-SVD,
  HealthX-Lab/CLIP-SVD's procedure (``train.py`` ``run_training`` with
  ``svf_utils/svf_torch.py``'s ``SVD_Linear``): every adapted Linear is their chain ``x -> x V^T -> * s ->
  (.) U^T + b`` on every token, so the backward pass keeps the ``[tokens, rank]`` activations of each
  factor; the text tower at the full context length (``clip.tokenize``, 77 tokens for CLIP); both towers;
  on CUDA fp16 autocast as theirs.
* ``fewclip``: the engine's step: CLIP-SVD's ``SVDLinear`` picks per call the cheaper of their chain and
  rebuilding the weight ``(U * s) Vh`` once; the class prompts cut to the longest prompt (exact with a
  causal mask); autocast ``amp`` on CUDA.
* ``fewclip_text``: ``fewclip`` with ``adapter.towers=text``: the image tower stays frozen, so its features
  come from the run's feature store (computed once per image and view, outside the step: here a
  precomputed tensor). Not for SkipTuning, which always tunes both towers.

SkipTuning (``skiptuning``, its defaults: blocks from the middle up tuned in both towers, half of the classes
(at most 50) always run) has two more procedures, and its speed-up and memory are given against
``unskipped``:

* ``unskipped``: what it saves on, their full fine-tuning (``trainers/baselines/ft_clip.py`` ``FinetuneCLIP``,
  ``START_LAYER 0``): every block of both towers tuned, every class through the whole text tower at every step
  (``adapter.start_layer=0 adapter.top_ratio=1``).
* ``fewclip_layers``: layer-wise skipping only (``adapter.top_ratio=1``: every class at every step).
* ``authors``: ``fewclip`` with the class prompts at the full context length (their ``clip.tokenize``). Their
  trainer runs the frozen lower image blocks once per epoch over the training set (batches of 128, kept on the
  CPU) rather than inside the step; fewclip runs them inside the step, without gradients: the same
  multiply-adds per image, counted here in both steps.

Each (method, procedure) runs in a fresh Python process (this script with ``worker=``); memory as in
``scripts/bench_deep.py`` (CUDA: the allocator's peak over the steps over what was allocated before; CPU: the
resident set size, its high-water mark reset before the steps). s/step is the median of ``steps=`` steps.
"""
import gc
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from bench_deep import classnames, split, sync

from fewclip.adapters._deep import text_lower_blocks
from fewclip.backbones.backbone import BackboneConfig, load_backbone, resolve_device, shipped_cards
from fewclip.config.compose import as_dict, load_config
from fewclip.training.cost import MiB, peak_rss_bytes, reset_peak_rss, rss_bytes
from fewclip.utils.io import atomic_write_json, read_json

log = logging.getLogger("bench_towers")

METHODS = ("clip_svd", "2sfs", "skiptuning")
PROCEDURES = {
    "authors": "authors' procedure: text at full length (CLIP-SVD: their factor chain on every call)",
    "fewclip": "fewclip: text cut to the longest prompt (CLIP-SVD: chain or rebuilt weight, the cheaper)",
    "fewclip_text": "fewclip, text tower only: image features from the feature store",
    "fewclip_layers": "SkipTuning with layer-wise skipping only: every class at every step",
    "unskipped": "SkipTuning's baseline: full fine-tuning of every block of both towers on every class",
}
# the procedures that apply to each method (the others are left out of a run), and the row a method's speed-up
# and memory are measured against
APPLIES = {"clip_svd": ("authors", "fewclip", "fewclip_text"), "2sfs": ("authors", "fewclip", "fewclip_text"),
           "skiptuning": ("authors", "fewclip", "fewclip_layers", "unskipped")}
REFERENCE = {"skiptuning": "unskipped"}
SKIPTUNING = {"fewclip_layers": {"top_ratio": 1.0}, "unskipped": {"start_layer": 0, "top_ratio": 1.0}}


@dataclass
class BenchConfig:
    arch: str = "ViT-B-16"
    methods: str = "clip_svd,2sfs,skiptuning"
    procedures: str = "authors,fewclip,fewclip_text,fewclip_layers,unskipped"
    classes: int = 100
    batch: int = 4
    steps: int = 3
    device: str = "auto"
    amp: str = "fp16"
    threads: int = 0
    out: Optional[str] = None
    worker: Optional[str] = None  # internal: "METHOD:PROCEDURE", run in a fresh process
    worker_out: Optional[str] = None

    def __post_init__(self) -> None:
        bad = [m for m in split(self.methods) if m not in METHODS]
        if bad or not split(self.methods):
            raise ValueError(f"methods={self.methods!r}: use a comma list of {', '.join(METHODS)}")
        bad = [p for p in split(self.procedures) if p not in PROCEDURES]
        if bad or not split(self.procedures):
            raise ValueError(f"procedures={self.procedures!r}: use a comma list of {', '.join(PROCEDURES)}")
        for name in ("classes", "batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def chain_forward(layer):
    """Their ``SVD_Linear.forward``: ``fc_U(fc_V(x) * vector_S)``, on an ``SVDLinear``'s tensors."""
    def forward(x):
        return F.linear(F.linear(x, layer.Vh.to(x.dtype)) * layer.s.to(x.dtype), layer.U.to(x.dtype),
                        None if layer.bias is None else layer.bias.to(x.dtype))
    return forward


def build(method: str, procedure: str, bb, names):
    from fewclip.adapters import adapter_info, build_adapter

    info = adapter_info(method)
    options = {"towers": "text"} if procedure == "fewclip_text" else {}
    if method == "skiptuning":
        options = SKIPTUNING.get(procedure, {})
    adapter = build_adapter(info.config_cls(**options), bb, names, ["a photo of a {}."])
    if procedure == "authors":
        for layer in getattr(adapter, "svd", {}).values():
            layer.forward = chain_forward(layer)
        texts = [f"a photo of a {c}." for c in names]
        adapter.tokens = bb.tokenize(texts).to(bb.device)  # clip.tokenize: the full context length
        if method == "skiptuning":  # the frozen lower text blocks' output, at that length
            with torch.no_grad():
                adapter.text_mid = text_lower_blocks(adapter.tower, adapter.tower.embed(adapter.tokens),
                                                     adapter.tokens, adapter.start["text"])
    return adapter


def run_worker(cfg: BenchConfig) -> dict:
    from fewclip.training.engine import TrainConfig, amp_autocast, make_optimizer

    method, procedure = cfg.worker.split(":")
    dev = resolve_device(cfg.device)
    cuda = dev.type == "cuda"
    is_card = cfg.arch in shipped_cards() or cfg.arch.endswith((".yaml", ".yml"))
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(name=cfg.arch, pretrained=None if is_card else "none", device=cfg.device))
    adapter = build(method, procedure, bb, classnames(cfg.classes, bb.tokenizer))
    params = adapter.trainable_parameters()
    groups = adapter.param_groups() or params  # SkipTuning's staged lr
    opt = make_optimizer(groups, TrainConfig(**{k: v for k, v in adapter.train_defaults.items()
                                               if k != "iterations_per_shot"}))
    B, S = cfg.batch, bb.image_size
    pixels = torch.randn(B, 3, S, S, device=dev)
    labels = torch.randint(0, cfg.classes, (B,), device=dev)
    cached = None if adapter.trains_image_tower else bb.encode_images(pixels)  # the feature store
    amp = cfg.amp if cuda else "none"

    def step():
        with amp_autocast(dev, amp):
            feats = adapter.encode_images(pixels) if cached is None else cached
            terms = adapter.training_loss(feats, labels)
        opt.zero_grad(set_to_none=True)
        adapter.backward(terms)
        opt.step()

    adapter.train()
    sync(dev)
    if cuda:
        gc.collect()
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        reset = True
    else:
        reset = reset_peak_rss(collect=True)
        before = rss_bytes() if reset else peak_rss_bytes()
    times = []
    for _ in range(cfg.steps):
        sync(dev)
        t0 = time.perf_counter()
        step()
        sync(dev)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(dev) if cuda else peak_rss_bytes()
    return dict(method=method, procedure=procedure, amp=amp, text_tokens=int(adapter.tokens.shape[1]),
                trainable_params=sum(p.numel() for p in params),
                backbone_params=sum(p.numel() for p in bb.parameters()), s_per_step=statistics.median(times),
                step_times_s=times, memory="cuda_allocated" if cuda else "rss", peak_reset=reset,
                before_mib=before / MiB, peak_mib=peak / MiB, step_extra_mib=max(peak - before, 0) / MiB)


def run_one(cfg: BenchConfig, worker: str, device: str, tmp: str) -> dict:
    path = os.path.join(tmp, worker.replace(":", "_") + ".json")
    keep = {k: v for k, v in as_dict(cfg).items() if v is not None and k not in ("out", "worker", "worker_out")}
    keep["device"] = device
    args = [f"{k}={v}" for k, v in keep.items()] + [f"worker={worker}", f"worker_out={path}"]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{worker}: the worker process failed (exit {proc.returncode}):\n{tail}")
    return read_json(path)


def main(argv):
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = load_config(argv, BenchConfig)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.worker is not None:
        if not cfg.worker_out:
            raise SystemExit("worker= needs worker_out= (this script sets both when it runs a method)")
        atomic_write_json(cfg.worker_out, run_worker(cfg))
        return
    dev = resolve_device(cfg.device)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_towers_") as tmp:
        for m in split(cfg.methods):
            for p in split(cfg.procedures):
                if p not in APPLIES[m]:
                    continue
                log.info("%s, %s: %d step(s) in a fresh process ...", m, p, cfg.steps)
                rows.append(run_one(cfg, f"{m}:{p}", str(dev), tmp))
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"{torch.get_num_threads()} threads")
    print(f"Tower-weight methods, one training step: {cfg.arch} ({rows[0]['backbone_params']:,} backbone "
          f"parameters), {cfg.classes} classes, batch {cfg.batch}, median of {cfg.steps} step(s), on {where}, "
          f"torch {torch.__version__}; each row in a fresh process")
    print("Speed-up and memory against the authors' procedure (SkipTuning: against the un-skipped one).")
    print("| method | procedure | text tokens | trainable | s/step | speed-up | before step (MiB) | step extra (MiB) "
          "| step extra vs reference |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ref = next((x for x in rows if x["method"] == r["method"]
                    and x["procedure"] == REFERENCE.get(r["method"], "authors")), None)
        speed = f"{ref['s_per_step'] / r['s_per_step']:.2f}x" if ref else "-"
        mem = f"{r['step_extra_mib'] / ref['step_extra_mib']:.2f}x" if ref and ref["step_extra_mib"] > 0 else "-"
        print(f"| {r['method']} | {r['procedure']} | {r['text_tokens']} | {r['trainable_params']:,} | "
              f"{r['s_per_step']:.3f} | {speed} | {r['before_mib']:.0f} | {r['step_extra_mib']:.0f} | {mem} |")
    if cfg.out:
        atomic_write_json(cfg.out, {"machine": where, "torch": torch.__version__, "config": as_dict(cfg),
                                    "procedures": PROCEDURES, "rows": rows})
        log.info("wrote %s", cfg.out)


if __name__ == "__main__":
    main(sys.argv[1:])

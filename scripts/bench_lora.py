"""Benchmark LoRA against CoOp on one backbone: trainable parameters, memory and time of a training step.

    python scripts/bench_lora.py                                          # toy-clip on the CPU (seconds)
    python scripts/bench_lora.py arch=ViT-B-16 classes=10 batch=4 steps=1  # a quick look at ViT-B-16 on the CPU
    python scripts/bench_lora.py arch=ViT-B-16 classes=100 device=cuda out=lora.json
    python scripts/bench_lora.py methods=coop,lora precision=bf16 amp=none threads=1

Methods (``methods=``, a comma list; all four by default):

* ``coop``: CoOp, 16 unified context vectors (``CoOpConfig()``), on cached image features;
* ``lora_text``: LoRA on q, k, v of every text-tower layer (``LoRAConfig(towers="text")``), on cached
  image features;
* ``lora``: CLIP-LoRA's default (``LoRAConfig()``): q, k, v of every layer of both towers, so every step
  encodes its images through the adapted image tower;
* ``lora_qkvo_mlp``: as ``lora``, plus the attention output and both MLP Linears
  (``targets=q,k,v,o,mlp``).

``arch=`` is a shipped reference card (``toy-clip``, the default), a card file, or an open_clip
architecture loaded with random weights (``ViT-B-16`` means ``backbone.pretrained=none``: neither time
nor memory depends on the weights). The ``classes=`` class names are synthetic ("class 0", ...), with
LoRA's default template "a photo of a {}.". One step is what the engine's loop does
(``fewclip.training.engine.train_loop``): under ``fewclip.training.engine.amp_autocast(device, amp)`` (``amp=auto``: bf16 on
CUDA, none on the CPU), logits from ``batch=`` cached features (random, of the image tower's
output size), or from ``adapter.encode_images(pixels)`` of random pixels for the methods that adapt the
image tower; cross-entropy; backward; an optimiser step (``fewclip.training.engine.make_optimizer``) with the
adapter's own defaults (CoOp: SGD with momentum; LoRA: AdamW). The optimiser's state is created by the
first step, so it counts as step memory.

Each method runs in a fresh Python process (this script, called with ``worker=METHOD``), so no method's
memory is left over in another's numbers:

* CUDA: the caching allocator's counters. *before* is ``torch.cuda.memory_allocated()`` once the backbone,
  adapter, optimiser and inputs are built; *peak* is ``torch.cuda.max_memory_allocated()`` over the steps
  (peak statistics reset just before them), tensors only; *step extra* = peak - before.
* CPU: the process's resident set size (RSS, from ``/proc/self/status``; ``fewclip.training.cost``, which every
  run's metrics use too). After setup, garbage is collected, freed heap memory is handed back to the
  system (``malloc_trim``) and the RSS high-water mark is reset (``/proc/self/clear_refs``); *before* is
  the RSS then, *peak* is the high-water mark (``VmHWM``) after the steps. RSS
  counts more than tensors (the allocator's slack, library code first touched by the backward pass,
  Python objects), so *step extra* is an upper-bound-ish estimate of what the step needs, and small
  values (a few MiB) are noise. Where the high-water mark cannot be reset, *before* is the peak RSS of
  setup (loading the backbone can peak above what stays resident), so a step that needs less than that
  peak shows as 0; the table's header says which was used.

s/step is the median over the ``steps=`` steps, each timed on its own (the first step also builds the
optimiser state; with ``steps`` >= 3 the median leaves it out). On a shared machine, ``threads=`` below
the number of idle cores keeps threads from waiting for each other (with toy-clip on a busy 2-core CPU,
two threads made a step of milliseconds take a second). Numbers from this script say on what
machine they were taken (the first line of its output).
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
from typing import Any, Optional

import torch
import torch.nn.functional as F

from fewclip.backbones.backbone import BackboneConfig, load_backbone, resolve_device, shipped_cards
from fewclip.config.compose import as_dict, load_config
from fewclip.training.cost import MiB, peak_rss_bytes, reset_peak_rss, rss_bytes
from fewclip.training.engine import AMP_MODES, amp_dtype
from fewclip.utils.io import atomic_write_json, read_json

log = logging.getLogger("bench_lora")

# method: (adapter name, config overrides, a short description for the table)
METHODS = {
    "coop": ("coop", {}, "CoOp, 16 ctx, cached features"),
    "lora_text": ("lora", {"towers": "text"}, "LoRA q,k,v, text tower, cached features"),
    "lora": ("lora", {}, "LoRA q,k,v, both towers"),
    "lora_qkvo_mlp": ("lora", {"targets": "q,k,v,o,mlp"}, "LoRA q,k,v,o,mlp, both towers"),
}


def split(s: Any) -> list[str]:
    return [t.strip() for t in str(s).split(",") if t.strip()]


@dataclass
class BenchConfig:
    # a shipped card name, a card file, or an open_clip architecture (random weights)
    arch: str = "toy-clip"
    # comma list of coop, lora_text, lora, lora_qkvo_mlp
    methods: str = "coop,lora_text,lora,lora_qkvo_mlp"
    classes: int = 10
    batch: int = 32
    steps: int = 3
    device: str = "auto"
    # backbone precision: fp32, bf16 or fp16
    precision: str = "fp32"
    # autocast: auto (bf16 on CUDA, none on the CPU), bf16, fp16 or none (train.amp)
    amp: str = "auto"
    threads: int = 0
    # optional JSON file with every row
    out: Optional[str] = None
    # internal: set by this script when it runs one method in a fresh process
    worker: Optional[str] = None
    worker_out: Optional[str] = None

    def __post_init__(self) -> None:
        bad = [m for m in split(self.methods) if m not in METHODS]
        if bad or not split(self.methods):
            raise ValueError(f"methods={self.methods!r}: use a comma list of {', '.join(METHODS)}")
        if self.worker is not None and self.worker not in METHODS:
            raise ValueError(f"worker={self.worker!r}: use one of {', '.join(METHODS)}")
        for name in ("classes", "batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")


def backbone_config(cfg: BenchConfig) -> BackboneConfig:
    """A card (shipped or a file) names its own weights; an open_clip architecture gets random ones."""
    is_card = cfg.arch in shipped_cards() or cfg.arch.endswith((".yaml", ".yml"))
    return BackboneConfig(name=cfg.arch, pretrained=None if is_card else "none", precision=cfg.precision,
                          device=cfg.device)


# ---------------------------------------------------------------------------
# one method, in its own process
# ---------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_worker(cfg: BenchConfig) -> dict:
    from fewclip.adapters import adapter_info, build_adapter
    from fewclip.training.engine import TrainConfig, amp_autocast, make_optimizer

    method = cfg.worker
    adapter_name, overrides, _ = METHODS[method]
    dev = resolve_device(cfg.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)

    bb = load_backbone(backbone_config(cfg))
    classnames = [f"class {i}" for i in range(cfg.classes)]
    adapter = build_adapter(adapter_info(adapter_name).config_cls(**overrides), bb, classnames, [])
    params = adapter.trainable_parameters()
    # the optimiser the engine would build: TrainConfig's defaults with the adapter's own on top
    tc = TrainConfig(**adapter.train_defaults)
    opt = make_optimizer(params, tc)

    B, S = cfg.batch, bb.image_size
    labels = torch.randint(0, cfg.classes, (B,), device=dev)
    if adapter.trains_image_tower:
        inputs = torch.randn(B, 3, S, S, device=dev)  # pixels, encoded every step
    else:
        # cached features: random, of the image tower's output size (a one-image forward gives the size
        # without a batch-sized forward raising the setup peak)
        D = bb.encode_images(torch.randn(1, 3, S, S, device=dev)).shape[-1]
        inputs = torch.randn(B, D, device=dev)

    def step():
        with amp_autocast(dev, cfg.amp):
            x = adapter.encode_images(inputs) if adapter.trains_image_tower else inputs
            logits = adapter(x)
        loss = F.cross_entropy(logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    adapter.train()
    sync(dev)
    setup_peak = torch.cuda.max_memory_allocated(dev) if cuda else peak_rss_bytes()
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
    return dict(method=method, adapter=adapter_name, overrides=overrides, optimizer=tc.optimizer,
                trains_image_tower=bool(adapter.trains_image_tower),
                trainable_params=sum(p.numel() for p in params),
                backbone_params=sum(p.numel() for p in bb.parameters()),
                s_per_step=statistics.median(times), step_times_s=times,
                memory="cuda_allocated" if cuda else "rss", peak_reset=reset,
                setup_peak_mib=setup_peak / MiB, before_mib=before / MiB, peak_mib=peak / MiB,
                step_extra_mib=max(peak - before, 0) / MiB)


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------


def run_method(cfg: BenchConfig, method: str, device: str, tmp: str) -> dict:
    """Run one method in a fresh process and read back its row."""
    path = os.path.join(tmp, f"{method}.json")
    keep = {k: v for k, v in as_dict(cfg).items() if v is not None and k not in ("out", "worker", "worker_out")}
    keep["device"] = device
    args = [f"{k}={v}" for k, v in keep.items()] + [f"worker={method}", f"worker_out={path}"]
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{method}: the worker process failed (exit {proc.returncode}):\n{tail}")
    return read_json(path)


HEADER = ("| method | what | trainable params | vs coop | s/step | before step (MiB) | peak in steps (MiB) "
          "| step extra (MiB) |\n|---|---|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict, coop: Optional[int]) -> str:
    ratio = f"{r['trainable_params'] / coop:.2f}x" if coop else "-"
    return (f"| {r['method']} | {METHODS[r['method']][2]} | {r['trainable_params']:,} | {ratio} | "
            f"{r['s_per_step']:.4f} | {r['before_mib']:.1f} | {r['peak_mib']:.1f} | {r['step_extra_mib']:.1f} |")


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
    methods = split(cfg.methods)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="bench_lora_") as tmp:
        for m in methods:
            log.info("%s: running %d step(s) in a fresh process ...", m, cfg.steps)
            rows.append(run_method(cfg, m, str(dev), tmp))

    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")
    counter = ("CUDA allocator (tensors)" if dev.type == "cuda" else
               "process RSS, high-water mark reset before the steps" if all(r["peak_reset"] for r in rows)
               else "process RSS; high-water mark NOT resettable here: 'before' is setup's peak, extra a lower bound")
    amp = str(amp_dtype(dev, cfg.amp) or "none").replace("torch.", "")
    print(f"LoRA vs CoOp, {cfg.arch} ({rows[0]['backbone_params']:,} backbone parameters), {cfg.precision}, "
          f"autocast {amp}, {cfg.classes} classes, batch {cfg.batch}, median of {cfg.steps} step(s), on {where}, "
          f"torch {torch.__version__}")
    print(f"Memory: {counter}; each method in a fresh process.")
    print(HEADER)
    coop = next((r["trainable_params"] for r in rows if r["method"] == "coop"), None)
    for r in rows:
        print(table_row(r, coop))
    if coop:
        ratios = ", ".join(f"{r['method']} {r['trainable_params'] / coop:.2f}x" for r in rows if r["method"] != "coop")
        if ratios:
            print(f"\nTrainable parameters relative to coop ({coop:,}): {ratios}")
    if cfg.out:
        import open_clip
        import peft

        atomic_write_json(cfg.out, {"machine": where, "torch": torch.__version__, "open_clip": open_clip.__version__,
                                    "peft": peft.__version__, "config": as_dict(cfg), "rows": rows})
        log.info("wrote %s", cfg.out)


if __name__ == "__main__":
    main(sys.argv[1:])

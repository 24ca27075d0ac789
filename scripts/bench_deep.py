"""Benchmark one training step of IVLP, MaPLe, PromptSRC and the issue-23 prompt methods (DePT, MMRL,
CoPrompt): fewclip's step against the authors' procedure.

    python scripts/bench_deep.py                                   # ViT-B-16 (random weights), 100 classes, CPU
    python scripts/bench_deep.py classes=1000 device=cuda out=deep.json   # the ImageNet case on a GPU
    python scripts/bench_deep.py arch=toy-clip classes=8 steps=5 threads=1
    python scripts/bench_deep.py methods=dept,dept_maple arch=ViT-B-16 classes=100  # DePT on CoOp and on MaPLe

Every step of these methods runs both towers with gradients: the image tower on the batch (its prompts
are trained) and the text tower on every class prompt (so is its context). What the procedures do
(``procedures=``, a comma list):

* ``authors``: the authors' procedure as fewclip reproduces it (``multimodal-prompt-learning`` and
  ``PromptSRC`` trainers, PREC fp16): the text tower at the full context length (77 tokens for CLIP,
  ``text_mode="faithful"``); PromptSRC's frozen image features recomputed at every step by a second copy of
  the image tower (their ``ZS_image_encoder``, which is held in memory); on CUDA the whole model in fp16
  without autocast (``authors_precision``), on the CPU in fp32 (their fp16 path is not a CPU path).
* ``fewclip``: the engine's step: the text prompts cut to the longest prompt (exact; on the CPU also the
  shared start+context prefix computed once), PromptSRC's frozen image features from the feature cache
  (computed once per image and view, outside the step: here a precomputed tensor), fp32 weights with
  ``amp`` autocast on CUDA (the engine's ``train.amp``).
* MMRL: ``authors`` runs the text tower at the full context length through every block at every step and
  a second image tower for the frozen features (their ``image_encoder_clip``); ``fewclip`` computes the
  text blocks below the first representation layer once and takes the frozen features from the cache.
* CoPrompt: as PromptSRC (its frozen image features: their ``model_distill`` on a second view every step).
* ``fewclip_ckpt``: ``fewclip`` with activation checkpointing in both towers (``adapter.checkpointing=true``;
  MaPLe-based methods only).

A method whose image tower stays frozen (DePT on CoOp) gets its image features from the feature cache in
fewclip's step (computed once per image and view, outside the step) and from the frozen image tower at
every step in the authors' (their trainers encode every batch).

Class names are the first ``classes=`` of ImageNet's (open_clip's ``IMAGENET_CLASSNAMES``), so the prompts
have ImageNet's lengths (pairs of vocabulary words for the toy cards' word tokenizer); the template is
"a photo of a {}.". ``arch=`` is a shipped card or an open_clip
architecture with random weights (time and memory do not depend on the weights). Each (method, procedure)
runs in a fresh Python process (this script with ``worker=``); memory is counted as in
``scripts/bench_lora.py``: on CUDA the caching allocator's peak over the steps (tensors only) and what was
allocated before them; on the CPU the resident set size, its high-water mark reset before the steps. s/step
is the median of ``steps=`` steps (the first builds the optimiser state). The first line of the output names
the machine.
"""
import copy
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

from fewclip.backbones.backbone import BackboneConfig, load_backbone, resolve_device, shipped_cards
from fewclip.config.compose import as_dict, load_config
from fewclip.training.cost import MiB, peak_rss_bytes, reset_peak_rss, rss_bytes
from fewclip.utils.io import atomic_write_json, read_json

log = logging.getLogger("bench_deep")

METHODS = ("ivlp", "maple", "promptsrc", "dept", "dept_maple", "mmrl", "coprompt")
# methods that are another registered adapter with options
# methods with no tower blocks of their own to checkpoint (DePT on CoOp: a context and a head)
NO_CHECKPOINTING = ("dept",)
VARIANTS = {"dept_maple": ("dept", {"learner": "maple", "n_ctx": 2, "ctx_init": "a photo of a"})}
PROCEDURES = {
    "authors": "authors' procedure: text at full length, frozen image tower every step (PromptSRC), fp16 on CUDA",
    "fewclip": "fewclip: text cut to the longest prompt, frozen features cached, autocast on CUDA",
    "fewclip_ckpt": "fewclip + activation checkpointing",
}


def split(s: Any) -> list[str]:
    return [t.strip() for t in str(s).split(",") if t.strip()]


@dataclass
class BenchConfig:
    arch: str = "ViT-B-16"
    methods: str = "ivlp,maple,promptsrc"
    procedures: str = "authors,fewclip,fewclip_ckpt"
    classes: int = 100
    batch: int = 4
    steps: int = 3
    device: str = "auto"
    # fewclip's backbone precision and autocast on CUDA (the CPU runs fp32 without autocast)
    precision: str = "fp32"
    amp: str = "bf16"
    # the authors' precision on CUDA (their PREC fp16: the whole model in fp16, no autocast)
    authors_precision: str = "fp16"
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
        if self.amp not in ("bf16", "fp16", "none"):
            raise ValueError(f"amp must be bf16, fp16 or none, got {self.amp!r}")


def classnames(n: int, tokenizer) -> list[str]:
    """ImageNet's first ``n`` class names; for a word tokenizer that lacks their words (the toy cards), pairs
    of its own words."""
    from itertools import product

    from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES

    if hasattr(tokenizer, "unknown_words"):
        words = [w for w in tokenizer.encoder if not w.startswith("<")]
        return [f"{a} {b}" for a, b in product(words, words)][:n]
    names = list(IMAGENET_CLASSNAMES)
    return [names[i % len(names)] + ("" if i < len(names) else f" {i // len(names)}") for i in range(n)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_worker(cfg: BenchConfig) -> dict:
    from fewclip.adapters import adapter_info, build_adapter
    from fewclip.training.engine import TrainConfig, amp_autocast, make_optimizer

    method, procedure = cfg.worker.split(":")
    dev = resolve_device(cfg.device)
    cuda = dev.type == "cuda"
    authors = procedure == "authors"
    precision = (cfg.authors_precision if authors else cfg.precision) if cuda else "fp32"
    amp = "none" if authors or not cuda else cfg.amp
    is_card = cfg.arch in shipped_cards() or cfg.arch.endswith((".yaml", ".yml"))
    torch.manual_seed(0)
    bb = load_backbone(BackboneConfig(name=cfg.arch, pretrained=None if is_card else "none", precision=precision,
                                      device=cfg.device))
    name, options = VARIANTS.get(method, (method, {}))
    options = dict(options)
    if procedure == "fewclip_ckpt":
        options["checkpointing"] = True
    if method == "promptsrc":
        options["teacher_templates"] = "dataset"  # the teacher is computed once either way; not timed
    info = adapter_info(name)
    adapter = build_adapter(info.config_cls(**options), bb, classnames(cfg.classes, bb.tokenizer), ["a photo of a {}."])
    prompts = getattr(adapter, "learner", adapter)  # the prompt learner (DePT's is a CoOp or a MaPLe)
    if authors:
        prompts.set_text_mode("faithful")
    params = adapter.trainable_parameters()
    groups = adapter.param_groups() or params
    opt = make_optimizer(groups, TrainConfig(**adapter.train_defaults))
    B, S = cfg.batch, bb.image_size
    pixels = torch.randn(B, 3, S, S, device=dev)
    labels = torch.randint(0, cfg.classes, (B,), device=dev)
    frozen_tower, cached = None, None
    if adapter.wants_frozen_features:  # PromptSRC, MMRL: the frozen image tower's features of the batch
        for teacher in ("teacher_text_points", "description_points"):  # computed at build time: not timed
            if hasattr(adapter, teacher):
                getattr(adapter, teacher)()
        if authors:  # their ZS_image_encoder: a second image tower, run at every step
            frozen_tower = copy.deepcopy(bb.model.visual)
        else:  # from the feature cache: computed once per image and view, outside the step
            cached = bb.encode_images(pixels)
    frozen_features = None
    if not adapter.trains_image_tower and not authors:  # fewclip: from the feature cache
        frozen_features = bb.encode_images(pixels)

    def step():
        with amp_autocast(dev, amp):
            feats = adapter.encode_images(pixels) if frozen_features is None else frozen_features
            extra = {}
            if frozen_tower is not None:
                with torch.no_grad():
                    extra["frozen"] = frozen_tower(pixels.to(bb.dtype)).float()
            elif cached is not None:
                extra["frozen"] = cached
            terms = adapter.training_loss(feats, labels, **extra)
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
    return dict(method=method, procedure=procedure, precision=precision, amp=amp, text_mode=prompts.text_mode,
                text_tokens=prompts.tower.context_length if prompts.text_mode == "faithful" else
                int(prompts.tokens.shape[1]), trainable_params=sum(p.numel() for p in params),
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
    with tempfile.TemporaryDirectory(prefix="bench_deep_") as tmp:
        for m in split(cfg.methods):
            for p in split(cfg.procedures):
                if p == "fewclip_ckpt" and m in NO_CHECKPOINTING:
                    continue
                log.info("%s, %s: %d step(s) in a fresh process ...", m, p, cfg.steps)
                rows.append(run_one(cfg, f"{m}:{p}", str(dev), tmp))
    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores), "
                  f"{torch.get_num_threads()} threads")
    counter = ("CUDA allocator (tensors)" if dev.type == "cuda" else
               "process RSS, high-water mark reset before the steps" if all(r["peak_reset"] for r in rows)
               else "process RSS; high-water mark NOT resettable here: 'before' is setup's peak")
    print(f"Prompt methods, one training step: {cfg.arch} ({rows[0]['backbone_params']:,} backbone parameters), "
          f"{cfg.classes} classes, batch {cfg.batch}, median of {cfg.steps} step(s), on {where}, "
          f"torch {torch.__version__}")
    print(f"Memory: {counter}; each row in a fresh process.")
    print("| method | procedure | precision / autocast | text tokens | s/step | speed-up | before step (MiB) "
          "| peak in steps (MiB) | step extra (MiB) | step extra vs authors |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ref = next((x for x in rows if x["method"] == r["method"] and x["procedure"] == "authors"), None)
        speed = f"{ref['s_per_step'] / r['s_per_step']:.2f}x" if ref else "-"
        mem = f"{r['step_extra_mib'] / ref['step_extra_mib']:.2f}x" if ref and ref["step_extra_mib"] > 0 else "-"
        print(f"| {r['method']} | {r['procedure']} | {r['precision']} / {r['amp']} | {r['text_tokens']} | "
              f"{r['s_per_step']:.3f} | {speed} | {r['before_mib']:.0f} | {r['peak_mib']:.0f} | "
              f"{r['step_extra_mib']:.0f} | {mem} |")
    if cfg.out:
        import open_clip

        atomic_write_json(cfg.out, {"machine": where, "torch": torch.__version__, "open_clip": open_clip.__version__,
                                    "config": as_dict(cfg), "procedures": PROCEDURES, "rows": rows})
        log.info("wrote %s", cfg.out)


if __name__ == "__main__":
    main(sys.argv[1:])

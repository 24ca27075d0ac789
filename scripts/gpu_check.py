"""Validate a GPU in one command: the tests marked ``cuda``, the GPU targets, and one JSON and one Markdown table.

    python scripts/gpu_check.py                      # everything, written to gpu_check/
    python scripts/gpu_check.py out=DIR tests=false  # the benchmarks only

Without CUDA it says so in one line and exits 0. On a GPU it runs, in this order:

1. ``pytest -m cuda``: every method's training steps and scoring on the GPU, the feature store, local
   workers with one GPU each, Ray with fractional GPUs (tests/test_cuda.py);
2. the device's bf16 GEMM throughput (an N x N x N matmul, N = ``gemm_n``), the yardstick of 3;
3. the targets (docs/gpu.md):
   * CoOp per epoch, ViT-B-16, 100 classes x 16 shots, bf16: fewclip's fastest path against the reference
     procedure (``scripts/bench_train.py``), target at least 10x;
   * the text step (forward and backward of every class prompt) at 1000 classes for CoOp, CoOp CSC,
     CoCoOp (one image) and MaPLe: achieved FLOP/s (``torch.utils.flop_counter``) as a share of the GEMM
     throughput, target at least 40%, and peak memory, target at most 16 GB;
   * feature extraction: ``Backbone.encode_images`` against bare open_clip ``encode_image`` on the same
     pixels, batch and precision, target at least 95%.

The benchmarks use random weights (``pretrained=none``): speed and memory do not depend on the values.
"""
from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from open_clip.zero_shot_metadata import IMAGENET_CLASSNAMES
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import bench_train  # noqa: E402  (scripts/bench_train.py: the CoOp epoch)

from fewclip.adapters import adapter_info, build_adapter  # noqa: E402
from fewclip.backbones.backbone import BackboneConfig, load_backbone  # noqa: E402
from fewclip.config.compose import load_config  # noqa: E402
from fewclip.training.engine import amp_autocast  # noqa: E402

TARGETS = {"coop_epoch_speedup": 10.0, "text_step_gemm_share": 0.40, "text_step_peak_gb": 16.0,
           "extraction_share": 0.95}
TEXT_METHODS = {"coop": {}, "coop_csc": {"csc": True}, "cocoop": {}, "maple": {}}


@dataclass
class CheckConfig:
    out: str = "gpu_check"
    arch: str = "ViT-B-16"
    tests: bool = True
    gemm_n: int = 8192
    text_classes: int = 1000
    extraction_batch: int = 256
    steps: int = 5


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device, steps: int) -> float:
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / steps


def gemm_tflops(n: int, device: torch.device, dtype=torch.bfloat16, steps: int = 10) -> float:
    """The device's matmul throughput in TFLOP/s: ``n x n @ n x n`` in ``dtype`` (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n ** 3 / timed(lambda: a @ b, device, steps) / 1e12


def text_step(bb, key: str, classnames: list[str], amp: str, steps: int) -> dict[str, Any]:
    """One text step of method ``key`` (forward and backward through every class prompt): seconds, FLOPs
    (counted by torch's FLOP counter), achieved TFLOP/s and peak memory (CUDA only)."""
    name = key.split("_")[0]
    info = adapter_info(name)
    adapter = build_adapter(info.config_cls(**TEXT_METHODS.get(key, {})), bb, classnames, ["a photo of a {}."])
    adapter.train()
    device = bb.device
    D = int(bb.encode_text(["a"]).shape[-1])
    x = torch.randn(1, D, device=device)  # CoCoOp's text step is per image: one image's prompts
    params = adapter.trainable_parameters()

    def step():
        with amp_autocast(device, amp):
            out = adapter(x) if name == "cocoop" else adapter.text_features()
        out.float().sum().backward()
        for p in params:
            p.grad = None

    step()
    with FlopCounterMode(display=False) as counter:
        step()
    flops = counter.get_total_flops()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = timed(step, device, steps)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"method": key, "classes": len(classnames), "s_per_step": seconds, "flops": flops,
            "tflops": flops / seconds / 1e12, "peak_gb": None if peak is None else peak / 1e9}


def extraction(bb, batch: int, amp: str, steps: int) -> dict[str, Any]:
    """Images per second of ``Backbone.encode_images`` and of bare open_clip ``model.encode_image`` on the same
    pixels (already on the device), batch and precision."""
    device = bb.device
    px = torch.randn(batch, 3, bb.image_size, bb.image_size, device=device, dtype=bb.dtype)
    with torch.no_grad(), amp_autocast(device, amp):
        bare = timed(lambda: bb.model.encode_image(px), device, steps)
        ours = timed(lambda: bb.encode_images(px), device, steps)
    return {"batch": batch, "bare_images_per_s": batch / bare, "fewclip_images_per_s": batch / ours,
            "share": bare / ours}


def run_tests() -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           str(ROOT / "tests")], cwd=ROOT, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return {"passed": proc.returncode == 0, "summary": tail[0], "seconds": round(time.perf_counter() - t0, 1)}


def markdown(result: dict[str, Any]) -> str:
    t = TARGETS
    lines = [f"GPU check: {result['device']}, torch {result['torch']}, {result['date']}", "",
             "| target | measured | goal | met |", "|---|---|---|---|"]

    def row(what, value, goal, ok):
        lines.append(f"| {what} | {value} | {goal} | {'yes' if ok else 'NO'} |")

    if "tests" in result:
        row("tests marked cuda", result["tests"]["summary"], "all pass", result["tests"]["passed"])
    row("bf16 GEMM", f"{result['gemm_tflops']:.1f} TFLOP/s", "(yardstick)", True)
    c = result["coop_epoch"]
    row(f"CoOp epoch {c['arch']} {c['classes']}x{c['shots']} bf16 vs reference",
        f"{c['best_s_per_epoch']:.2f} s vs {c['reference_s_per_epoch']:.2f} s ({c['speedup_vs_reference']:.1f}x)",
        f">= {t['coop_epoch_speedup']:.0f}x", c["speedup_vs_reference"] >= t["coop_epoch_speedup"])
    for s in result["text_step"]:
        share = s["tflops"] / result["gemm_tflops"]
        row(f"text step {s['method']} {s['classes']} classes",
            f"{s['tflops']:.1f} TFLOP/s ({100 * share:.0f}% of GEMM), peak {s['peak_gb']:.1f} GB",
            f">= {100 * t['text_step_gemm_share']:.0f}%, <= {t['text_step_peak_gb']:.0f} GB",
            share >= t["text_step_gemm_share"] and s["peak_gb"] <= t["text_step_peak_gb"])
    e = result["extraction"]
    row(f"feature extraction, batch {e['batch']}", f"{e['fewclip_images_per_s']:.0f} vs {e['bare_images_per_s']:.0f} "
        f"images/s ({100 * e['share']:.1f}%)", f">= {100 * t['extraction_share']:.0f}%",
        e["share"] >= t["extraction_share"])
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    cfg = load_config(argv, CheckConfig)
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU on this machine; nothing to check (the CPU tests cover the rest).")
        return 0
    device = torch.device("cuda")
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                              "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime())}
    if cfg.tests:
        result["tests"] = run_tests()
    result["gemm_tflops"] = gemm_tflops(cfg.gemm_n, device)
    result["coop_epoch"] = bench_train.main([f"arch={cfg.arch}", "precision=bf16", "device=cuda", "classes=100",
                                             "shots=16"])
    bb = load_backbone(BackboneConfig(name=cfg.arch, pretrained="none", device="cuda"))
    names = list(IMAGENET_CLASSNAMES[: cfg.text_classes])
    result["text_step"] = [text_step(bb, key, names, "bf16", cfg.steps) for key in TEXT_METHODS]
    bf16 = load_backbone(BackboneConfig(name=cfg.arch, pretrained="none", device="cuda", precision="bf16"))
    result["extraction"] = extraction(bf16, cfg.extraction_batch, "none", cfg.steps)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / "gpu_check.md").write_text(table)
    print(table)
    print(f"written: {out / 'gpu_check.json'}, {out / 'gpu_check.md'}")
    return 0 if result.get("tests", {"passed": True})["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

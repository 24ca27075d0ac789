"""ProKeR's kernel ridge regression at scale: time and peak memory of the matrix-free cg solve.

    python scripts/bench_proker.py                          # 100 classes (with the direct solve beside it)
    python scripts/bench_proker.py classes=[100,1000] tiles_at_1000=40   # 1000 classes: a part of one iteration
    python scripts/bench_proker.py classes=[1000] max_iter=1             # 1000 classes: one whole iteration
    python scripts/bench_proker.py classes=[1000] views=3                # N = 48000: complete, beyond the direct solve
    python scripts/bench_proker.py classes=[100,1000] device=cuda        # the whole 1000-class solve on a GPU

Training points as the authors make them (``trainers/proker.py``, ``main.py`` of omarnust/BReg-Adapter): every
augmented view of every training image is a kernel row, so N = classes x shots x views (ImageNet at 16 shots and
10 views: 160,000). The features are synthetic and CLIP-like (unit vectors of width ``dim`` sharing a common
direction, clustered by class, each view a small perturbation of its image); the targets are ProKeR's (one-hot
minus the zero-shot cosine to noisy class prototypes). Each size runs in a process of its own, so its peak
resident memory (``ru_maxrss``) is its own. Where the N x N kernel fits (``direct_max``), the direct solve runs
too (in its own process) and the difference of the two solutions and of their predictions is printed.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from fewclip.adapters.proker import CG_DTYPES, KernelOperator, NystromPreconditioner, kernel, solve_cg, solve_direct
from fewclip.backbones.geometry import make_geometry
from fewclip.config.compose import load_config


class TimedOperator(KernelOperator):
    """The kernel operator, timing its products (the rest of an iteration is the preconditioner and vector updates)."""

    seconds = 0.0

    def __call__(self, P):
        t = time.perf_counter()
        out = super().__call__(P)
        self.seconds += time.perf_counter() - t
        return out


@dataclass
class BenchConfig:
    classes: list[int] = field(default_factory=lambda: [100])
    shots: int = 16
    views: int = 10
    dim: int = 512
    beta: float = 1.7  # the authors' ImageNet 16-shot values (configs/RN50/configs_proker/hyperparameters.json)
    lmbda: float = 0.1
    dtype: str = "float32"
    rank: int = 1000
    block: int = 4096
    tol: float = 1e-6
    max_iter: int = 2000
    tiles_at_1000: int = 0  # > 0: from 1000 classes up, one cg iteration whose product stops after this many tiles
    direct_max: int = 20000  # the direct solve beside cg up to this N
    threads: int = 0
    seed: int = 0
    device: str = "cpu"  # "cuda": the solve on a GPU (peak GPU memory printed beside the host's RSS)
    one: str = ""  # internal: "cg:<classes>" or "direct:<classes>" runs one case in this process


def rss_gib() -> float:
    """Peak resident set of this process so far, GiB (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


def problem(cfg: BenchConfig, classes: int):
    """Training points [N, D] (embedded), ProKeR's targets [N, C] and 1000 query points, in float64."""
    g = torch.Generator().manual_seed(cfg.seed)
    n_img, D = classes * cfg.shots, cfg.dim
    common = F.normalize(torch.randn(D, generator=g, dtype=torch.float64), dim=0)
    centers = F.normalize(common + 0.9 * F.normalize(torch.randn(classes, D, generator=g, dtype=torch.float64), dim=1),
                          dim=1)  # class means: cosine about 0.55 between classes
    images = centers.repeat_interleave(cfg.shots, 0) + 0.5 / D ** 0.5 * torch.randn(n_img, D, generator=g,
                                                                                      dtype=torch.float64)
    keys = torch.cat([F.normalize(images + 0.25 / D ** 0.5 * torch.randn(n_img, D, generator=g, dtype=torch.float64),
                                  dim=1) for _ in range(cfg.views)])  # [N, D]: view-major, as the authors' vecs
    labels = torch.arange(classes).repeat_interleave(cfg.shots).repeat(cfg.views)
    protos = F.normalize(centers + 0.5 / D ** 0.5 * torch.randn(classes, D, generator=g, dtype=torch.float64), dim=1)
    targets = F.one_hot(labels, classes).double() - keys @ protos.T  # Y - s(S, t)
    query = F.normalize(centers[torch.arange(1000) % classes] + 0.5 / D ** 0.5 * torch.randn(
        1000, D, generator=g, dtype=torch.float64), dim=1)
    return keys, targets, query


def run_one(cfg: BenchConfig) -> dict:
    kind, classes = cfg.one.split(":")
    classes = int(classes)
    geo = make_geometry("clip", logit_scale=100.0)
    dev = torch.device(cfg.device)
    keys, R, query = (t.to(dev) for t in problem(cfg, classes))
    N, C = R.shape
    out = {"kind": kind, "classes": classes, "N": N, "C": C}
    t0 = time.perf_counter()
    if kind == "direct":
        A = solve_direct(kernel(geo, keys, keys, cfg.beta, 1.0), R, cfg.lmbda)
    else:
        partial = cfg.tiles_at_1000 if classes >= 1000 else 0
        max_iter = 1 if partial else cfg.max_iter
        op = TimedOperator(geo, keys, cfg.beta, 1.0, block=cfg.block, dtype=CG_DTYPES[cfg.dtype],
                           max_tiles=partial or None)
        precond = NystromPreconditioner(op, cfg.rank) if cfg.rank else None
        out["preconditioner_s"] = round(time.perf_counter() - t0, 1)
        trace = []

        def progress(it: int, residual: float) -> None:
            trace.append((it, round(time.perf_counter() - t0, 1), residual, round(rss_gib(), 3)))
            print(f"    {classes} classes, iteration {it}: {trace[-1][1]:.1f} s, relative residual {residual:.2e}, "
                  f"peak RSS {trace[-1][3]:.2f} GiB", file=sys.stderr, flush=True)

        stats = {}
        A, it = solve_cg(geo, keys, R, cfg.beta, cfg.lmbda, 1.0, tol=cfg.tol, max_iter=max_iter, precond=precond,
                         operator=op, stats=stats, callback=progress)
        iteration_s = (time.perf_counter() - t0 - out["preconditioner_s"]) / max(it, 1)
        out.update(iterations=it, residual=stats["residual"], rank=0 if precond is None else int(precond.s.numel()),
                   trace=trace, iteration_s=round(iteration_s, 1), tiles=op.tiles, tiles_per_product=op.n_tiles,
                   tile_s=op.seconds / max(op.tiles, 1))
        if partial:  # one product of every tile, from the time of those computed, plus the rest of an iteration
            out["extrapolated_iteration_s"] = round(iteration_s - op.seconds + op.n_tiles * out["tile_s"], 1)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated() / 2 ** 30, 3)
    out["seconds"] = round(time.perf_counter() - t0, 1)
    out["peak_rss_gib"] = round(rss_gib(), 3)
    Kq = kernel(geo, query, keys, cfg.beta, 1.0)
    torch.save({"A": A.cpu(), "pred": (Kq @ A).cpu()}, f"/tmp/bench_proker_{kind}_{classes}_{cfg.seed}.pt")
    return out


def main(argv) -> int:
    cfg = load_config(argv, BenchConfig)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.one:
        print(json.dumps(run_one(cfg)))
        return 0
    print(f"ProKeR solve, beta {cfg.beta}, lambda {cfg.lmbda}, {cfg.shots} shots x {cfg.views} views, width {cfg.dim}, "
          f"cg: {cfg.dtype} tiles of {cfg.block}, Nystrom rank {cfg.rank}, tol {cfg.tol:g}; "
          f"{cfg.device}, {torch.get_num_threads()} threads")
    for classes in cfg.classes:
        N = classes * cfg.shots * cfg.views
        partial = cfg.tiles_at_1000 and classes >= 1000
        kinds = ["cg", "direct"] if N <= cfg.direct_max and not partial else ["cg"]
        res = {}
        for kind in kinds:
            proc = subprocess.run([sys.executable, __file__, *argv, f"one={kind}:{classes}"], stdout=subprocess.PIPE,
                                  text=True)
            if proc.returncode:
                print(f"  {classes} classes, {kind}: failed (exit {proc.returncode})")
                return 1
            res[kind] = r = json.loads(proc.stdout.strip().splitlines()[-1])
            if kind == "direct":
                what = "Cholesky of the N x N kernel"
            elif "extrapolated_iteration_s" in r:
                what = (f"{r['tiles']} of the {r['tiles_per_product']} kernel tiles of one product in one iteration, "
                        f"{r['tile_s']:.1f} s a tile: one whole iteration would take about "
                        f"{r['extrapolated_iteration_s'] / 60:.0f} min (EXTRAPOLATED)")
            else:
                what = (f"{r['iterations']} iterations of {r['iteration_s']} s, residual {r['residual']:.1e}, "
                        f"{r['tiles_per_product']} tiles a product")
                if r["residual"] > cfg.tol:  # max_iter stopped it: a timing of its iterations, not a solve
                    what += f"; NOT CONVERGED (tol {cfg.tol:g}): stopped at max_iter={cfg.max_iter}"
            gpu = f", peak GPU memory {r['peak_gpu_gib']:.2f} GiB" if "peak_gpu_gib" in r else ""
            print(f"  {classes} classes, N={r['N']}, {kind:6s}: {r['seconds']:8.1f} s, peak RSS {r['peak_rss_gib']:.2f} GiB"
                  f"{gpu}  ({what})", flush=True)
            if kind == "cg":
                print(f"    preconditioner (rank {r['rank']}): {r['preconditioner_s']} s; peak RSS after iteration 1: "
                      f"{r['trace'][0][3]:.2f} GiB, at the end: {r['peak_rss_gib']:.2f} GiB")
        if "direct" in res:
            a = torch.load(f"/tmp/bench_proker_cg_{classes}_{cfg.seed}.pt")
            b = torch.load(f"/tmp/bench_proker_direct_{classes}_{cfg.seed}.pt")
            rel = lambda x, y: float((x - y).norm() / y.norm())  # noqa: E731
            print(f"    cg vs direct: relative difference of A {rel(a['A'], b['A']):.1e}, of the predictions "
                  f"k(x, S) A on 1000 queries {rel(a['pred'], b['pred']):.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

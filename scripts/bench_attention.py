"""Benchmark local-window attention against full (global) attention, in one run.

    python scripts/bench_attention.py                                  # CPU: mask path, fp32
    python scripts/bench_attention.py towers=vit_b16,text batch=2 steps=2   # a quick look
    python scripts/bench_attention.py device=cuda precision=bf16       # mask and flex paths
    python scripts/bench_attention.py impl=flex windows=8 shapes=grid out=attention.json

Towers, random weights (``backbone.pretrained=none``: the timing does not depend on them):

* ``vit_b16``: the ViT-B-16 image tower, 197 tokens (class + 14x14 patches), 12 heads of 64;
* ``vit_l14_336``: the ViT-L-14-336 image tower, 577 tokens (class + 24x24 patches), 16 heads of 64;
* ``text``: the ViT-B-16 text tower, 77 tokens with its causal mask, 8 heads of 64.

Each row is one setting: a window of k = 4, 8, 16, 32 (``windows=``) in every layer, as a
``band`` (|i-j| <= k) or a ``grid`` ((2k+1) x (2k+1) patches) for the image towers and a band
for the text tower, computed with ``impl=mask`` or ``impl=flex`` (fewclip.backbones.attention). The
``full`` row of each tower is the unmodified tower (scaled_dot_product_attention with the
tower's own mask), and both timings of every row are also given as a ratio to it:

* attention: one ``fewclip.backbones.attention.attend`` call on random q, k, v of the tower's real
  shape [batch, heads, tokens, 64], laid out as the tower lays them out;
* tower: a whole forward pass (``encode_image`` on random pixels, ``encode_text`` on
  random tokens) with the window in every layer.

Each timing is the median of ``steps`` calls after ``warmup`` calls, under torch.inference_mode;
the settings of a tower are timed in interleaved rounds, so drift of the machine does not
favour the one measured first.
On a shared machine, ``threads=`` below the number of idle cores keeps threads from waiting
for each other.

What to expect. The mask path adds the window to the attention scores as an additive mask
(0 / -inf): every score is still computed, and the mask is read besides, so it does not get
faster, on the CPU or anywhere (a ratio >= 1 is expected); it is there to check the windows
and to run where FlexAttention is not available. The flex path (compiled with torch.compile at
warm-up, on CUDA and, where a C++ compiler exists, on the CPU) skips the blocks of the score
matrix that the window leaves empty and computes the partly covered ones in full: 128x128
blocks on CUDA, 32x32 on the CPU (fewclip.backbones.attention.flex_block_size). The ``blocks`` column
says how many blocks it computes. On CUDA, 77 tokens (one block) or 197 (two by two, each
touched by the diagonal or the global class token) leave nothing to skip, so only
ViT-L-14-336 (5 x 5 blocks) can get faster there. FlexAttention has no backward on the CPU,
so there it serves inference (feature extraction, zero-shot), not training through the
tower. Attention is a small part of a tower's cost at these lengths (the projections and MLPs
are the rest), so the tower ratio stays near 1 even where attention itself gets cheaper.
At small batches on CUDA the attention timing is mostly launch overhead; raise ``batch=``.

Numbers from this script say on what machine they were taken (the first line of its output).
"""
import copy
import itertools
import logging
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from fewclip.backbones.attention import (
    CLS_MODES,
    SHAPES,
    LocalAttentionConfig,
    TextWindowConfig,
    VisionWindowConfig,
    Window,
    _heads,
    _MaskCache,
    apply_local_attention,
    attend,
    flex_available,
    text_tower_parts,
    vision_tower_parts,
)
from fewclip.backbones.backbone import backbone_config_from_dict, load_backbone, resolve_device
from fewclip.config.compose import as_dict, load_config
from fewclip.utils.io import atomic_write_json

log = logging.getLogger("bench_attention")

# name: (open_clip architecture, which tower)
TOWERS = {
    "vit_b16": ("ViT-B-16", "vision"),
    "vit_l14_336": ("ViT-L-14-336", "vision"),
    "text": ("ViT-B-16", "text"),
}
IMPLS = ("mask", "flex")


def split(s: Any) -> list[str]:
    return [t.strip() for t in str(s).split(",") if t.strip()]


@dataclass
class BenchConfig:
    # comma list of vit_b16, vit_l14_336, text
    towers: str = "vit_b16,vit_l14_336,text"
    # comma list of window sizes k >= 0; the full row is always measured
    windows: str = "4,8,16,32"
    # image towers: comma list of band, grid (the text tower is always band)
    shapes: str = "band,grid"
    # image towers: the class token is "global" or takes part in the window ("local")
    cls: str = "global"
    # comma list of mask, flex; "auto": mask on the CPU, mask,flex on CUDA
    impl: str = "auto"
    batch: int = 8
    steps: int = 10
    warmup: int = 2
    threads: int = 0
    precision: str = "fp32"
    device: str = "auto"
    # optional JSON file with every row
    out: Optional[str] = None

    def __post_init__(self) -> None:
        bad = [t for t in split(self.towers) if t not in TOWERS]
        if bad or not split(self.towers):
            raise ValueError(f"towers={self.towers!r}: use a comma list of {', '.join(TOWERS)}")
        try:
            ks = [int(k) for k in split(self.windows)]
        except ValueError:
            ks = [-1]
        if not ks or min(ks) < 0:
            raise ValueError(f"windows={self.windows!r}: use a comma list of integers >= 0, such as 4,8,16,32")
        if not split(self.shapes) or any(s not in SHAPES for s in split(self.shapes)):
            raise ValueError(f"shapes={self.shapes!r}: use a comma list of {', '.join(SHAPES)}")
        if self.cls not in CLS_MODES:
            raise ValueError(f"cls must be one of {CLS_MODES}, got {self.cls!r}")
        if self.impl != "auto" and (not split(self.impl) or any(i not in IMPLS for i in split(self.impl))):
            raise ValueError(f"impl={self.impl!r}: use auto or a comma list of {', '.join(IMPLS)}")
        for name in ("batch", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 1:
            raise ValueError(f"warmup must be >= 1 (flex compiles and masks are built there), got {self.warmup}")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


@dataclass
class Tower:
    """What a benchmark of one tower needs: its shape, its own mask, and how to run it."""

    name: str
    kind: str  # vision | text
    heads: int
    head_dim: int
    tokens: int
    mask: Optional[torch.Tensor]  # the tower's own attention mask (the text tower's causal mask)
    make_window: Callable[[int, str], Window]
    forward: Callable[[torch.nn.Module], torch.Tensor]


def describe(name: str, bb, batch: int, cls: str) -> Tower:
    model, dev, dtype = bb.model, bb.device, bb.dtype
    kind = TOWERS[name][1]
    if kind == "text":
        transformer, causal = text_tower_parts(model)
        text = model.text if hasattr(model, "text") else model
        L = bb.model_context_length
        mask = text.attn_mask if causal else None
        tokens = torch.randint(1, text.token_embedding.num_embeddings, (batch, L), device=dev)
        make_window = lambda k, shape: Window(k, "band", causal=causal)  # noqa: E731
        forward = lambda m: m.encode_text(tokens)  # noqa: E731
    else:
        transformer, prefix, grid = vision_tower_parts(model)
        L = prefix + grid[0] * grid[1]
        mask = None
        pixels = torch.randn(batch, 3, bb.image_size, bb.image_size, device=dev, dtype=dtype)
        make_window = lambda k, shape: Window(k, shape, prefix=prefix, cls=cls, grid=grid)  # noqa: E731
        forward = lambda m: m.encode_image(pixels)  # noqa: E731
    attn = transformer.resblocks[0].attn
    H = attn.num_heads
    return Tower(name, kind, H, attn.embed_dim // H, L, mask, make_window, forward)


def with_window(model: torch.nn.Module, tower: Tower, k: int, shape: str, cls: str, impl: str):
    """A copy of ``model`` with the window in every layer of ``tower``. The copy shares the
    parameters and buffers (only the module tree is copied, which apply_local_attention rewrites)."""
    if tower.kind == "text":
        la = LocalAttentionConfig(text=TextWindowConfig(window=k), impl=impl)
        transformer = lambda m: text_tower_parts(m)[0]  # noqa: E731
    else:
        la = LocalAttentionConfig(vision=VisionWindowConfig(window=k, shape=shape, cls=cls), impl=impl)
        transformer = lambda m: vision_tower_parts(m)[0]  # noqa: E731
    shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    m = copy.deepcopy(model, shared)
    apply_local_attention(m, la)
    got = transformer(m).resblocks[0].attn.window
    if got != tower.make_window(k, shape):  # the attention timing must measure the tower's own window
        raise RuntimeError(f"{tower.name}: the tower's window {got} is not the benchmarked one")
    return m


def bench_tower(tower: Tower, bb, cfg: BenchConfig, impls: list[str], report: Callable[[dict], None]) -> None:
    dev, dtype, B = bb.device, bb.dtype, cfg.batch
    H, d, L = tower.heads, tower.head_dim, tower.tokens
    # q, k, v laid out as the tower lays them out: one packed projection, split into heads
    q, k, v = (_heads(x, H) for x in torch.randn(B, L, 3 * H * d, device=dev, dtype=dtype).chunk(3, dim=-1))
    row = dict(tower=tower.name, arch=TOWERS[tower.name][0], tokens=L, heads=H, head_dim=d, batch=B)

    def once(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - t0

    # Every setting is built and warmed up first (flex compiles there), then timed in interleaved
    # rounds: one attention call and one tower call of each setting per round. A machine that
    # speeds up or slows down during the run then moves every setting alike, not the first one only.
    settings = [dict(row, impl="sdpa", shape=None, window=None, model=bb.model, masks=None)]
    shapes = split(cfg.shapes) if tower.kind == "vision" else ["band"]
    for impl, shape, w in itertools.product(impls, shapes, [int(x) for x in split(cfg.windows)]):
        settings.append(dict(row, impl=impl, shape=shape, window=w, model=with_window(bb.model, tower, w, shape,
                                                                                      cfg.cls, impl),
                             masks=_MaskCache(tower.make_window(w, shape))))
    calls = []
    for st in settings:
        impl = "mask" if st["impl"] == "sdpa" else st["impl"]
        def attn(st=st, impl=impl):
            return (attend(q, k, v, tower.mask, st["masks"], impl))
        def fwd(st=st):
            return (tower.forward(st["model"]))
        for _ in range(cfg.warmup):
            attn()
            fwd()
        calls.append((attn, fwd, [], []))
    for _ in range(cfg.steps):
        for attn, fwd, ta, tt in calls:
            ta.append(once(attn))
            tt.append(once(fwd))
    full = None
    for st, (_, _, ta, tt) in zip(settings, calls):
        r = {key: val for key, val in st.items() if key not in ("model", "masks")}
        r.update(attention_s=statistics.median(ta), tower_s=statistics.median(tt), flex_blocks_pct=None)
        if st["impl"] == "flex":
            r["flex_blocks_pct"] = round(100 - float(st["masks"].block_mask(L, dev).sparsity()), 1)
        if full is None:
            full = r
        r.update(attention_ratio=r["attention_s"] / full["attention_s"], tower_ratio=r["tower_s"] / full["tower_s"])
        report(r)


HEADER = ("| tower | tokens | impl | shape | window | attention ms | vs full | tower ms | vs full | blocks |\n"
          "|---|---:|---|---|---:|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    window = "full" if r["window"] is None else r["window"]
    blocks = "-" if r["flex_blocks_pct"] is None else f"{r['flex_blocks_pct']:g}%"
    return (f"| {r['tower']} | {r['tokens']} | {r['impl']} | {r['shape'] or '-'} | {window} | "
            f"{r['attention_s'] * 1e3:.3f} | {r['attention_ratio']:.2f} | {r['tower_s'] * 1e3:.1f} | "
            f"{r['tower_ratio']:.2f} | {blocks} |")


def main(argv):
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    cfg = load_config(argv, BenchConfig)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    dev = resolve_device(cfg.device)
    impls = (["mask", "flex"] if flex_available(dev) else ["mask"]) if cfg.impl == "auto" else split(cfg.impl)
    if "flex" in impls:
        import torch._dynamo as dynamo

        # fewclip compiles flex_attention once, with static shapes; every (tokens, window) pair here
        # is a recompile, more than dynamo's default limit of 8 (past it, flex would run eagerly)
        dynamo.config.recompile_limit = max(dynamo.config.recompile_limit, 256)
    torch.manual_seed(0)

    where = (torch.cuda.get_device_name(dev) if dev.type == "cuda"
             else f"CPU ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads")
    print(f"Local-window vs full attention, random weights, {cfg.precision}, batch {cfg.batch}, "
          f"median of {cfg.steps} steps after {cfg.warmup} warm-up, class token {cfg.cls}, on {where}, "
          f"torch {torch.__version__}")
    print(HEADER, flush=True)
    rows: list[dict] = []

    def report(r):
        rows.append(r)
        print(table_row(r), flush=True)

    names = split(cfg.towers)
    archs = list(dict.fromkeys(TOWERS[n][0] for n in names))  # load each architecture once
    with torch.inference_mode():
        for arch in archs:
            log.info("loading %s (random weights) on %s ...", arch, dev)
            bb = load_backbone(backbone_config_from_dict(
                {"name": arch, "pretrained": "none", "device": str(dev), "precision": cfg.precision}))
            for name in (n for n in names if TOWERS[n][0] == arch):
                bench_tower(describe(name, bb, cfg.batch, cfg.cls), bb, cfg, impls, report)
            del bb
    if cfg.out:
        import open_clip

        atomic_write_json(cfg.out, {"machine": where, "torch": torch.__version__, "open_clip": open_clip.__version__,
                                    "config": as_dict(cfg), "rows": rows})
        log.info("wrote %s", cfg.out)


if __name__ == "__main__":
    main(sys.argv[1:])

"""Attention modules for frozen open_clip towers: local windows and split q/k/v projections.

**Local windows.** Global self-attention costs O(N^2) in the sequence length.
A local window lets token i attend only to the tokens near it:

* ``text``: j in [i-k, i+k], intersected with the tower's own mask, so a
  causal CLIP text tower gives j in [i-k, i] (a window of 0 sees only itself);
* ``vision``, ``shape=band``: |i-j| <= k over the sequence of patches;
* ``vision``, ``shape=grid``: |row_i-row_j| <= k and |col_i-col_j| <= k over
  the patch grid;
* the class token is ``global`` (it sees every token and every token sees it)
  or ``local``: in a band it is the token at position 0; in a grid it sits on
  the top-left cell, next to the first patch.

Two ways to compute it, checked against each other in the tests:

* ``mask``: the window as an additive mask (0 / -inf) added to the tower's own
  mask and passed to ``scaled_dot_product_attention``. Built once per sequence
  length, dtype and device and cached. The cost does not fall with the window:
  every score is still computed.
* ``flex``: PyTorch's FlexAttention with a block mask (``create_block_mask``),
  which skips the 128x128 blocks that the window leaves empty; compiled with
  ``torch.compile`` on CUDA. ``impl=auto`` uses it on CUDA where FlexAttention
  exists *and* the window leaves at least a quarter of the blocks empty: 77
  tokens are one block and 197 tokens four, all touched by the diagonal or the
  class token, so short sequences keep the mask path. ``impl=flex`` forces it
  (on the CPU it runs eagerly, which is for checking, not for speed). It cannot
  take per-sample padding masks; ``auto`` falls back to the mask path there.

``LocalAttention`` replaces an ``nn.MultiheadAttention`` of a standard open_clip
block and keeps its parameters under the same names (``in_proj_weight``,
``in_proj_bias``, ``out_proj``), so the model's state dict does not change.
Blocks with open_clip's own ``Attention`` (qk-norm, scaled cosine) get the
mask through a forward pre-hook instead.

**Split projections.** ``SplitAttention`` is the same computation with the
query, key, value and output projections as four ``nn.Linear`` modules, so
that a tool such as peft can adapt each of q, k and v on its own (open_clip
packs them into one ``in_proj_weight``). ``pack_split_state`` turns its state
back into open_clip's packed names.
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from open_clip.transformer import Attention, VisionTransformer

# The config sections are plain dataclasses in fewclip.config.sections (no torch: `--help` reads them); re-exported here.
from fewclip.config.sections import CLS_MODES, IMPLS, SHAPES, LocalAttentionConfig, TextWindowConfig, VisionWindowConfig, parse_layers  # noqa: F401

log = logging.getLogger(__name__)

# ---------------------------------------------------------------------------
# windows: pure functions
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Window:
    """Which tokens may attend to which in one tower: a band over the sequence or a grid neighbourhood.

    ``prefix``: tokens before the patches (the class token); ``grid``: (rows, cols) of patches;
    ``causal``: the tower also applies a causal mask (known so the flex path can rebuild it).
    Tokens after the patch grid (position >= prefix + rows * cols, e.g. the prompt tokens that deep
    prompting appends to an image tower's sequence) have no place on it: they see every token and every
    token sees them, whatever the window.
    """

    k: int
    shape: str = field(default="band", metadata={"help": 'band | grid'})
    prefix: int = 0
    cls: str = "global"
    grid: Optional[tuple[int, int]] = None
    causal: bool = False

    def mask_mod(self, with_causal: bool = True) -> Callable:
        """FlexAttention's mask_mod: (b, h, q_idx, kv_idx) -> bool tensor, True where attention is allowed.
        ``with_causal=False`` leaves the tower's causal mask out (the mask path adds the tower's own)."""
        k, P, shape, cls_global = self.k, self.prefix, self.shape, self.cls == "global"
        causal = self.causal and with_causal
        gw = self.grid[1] if self.grid else 1
        end = P + self.grid[0] * self.grid[1] if self.grid else None  # first token after the patches

        def mod(b, h, q, kv):
            if shape == "band":
                ok = (q - kv).abs() <= k
            else:
                # local class token sits on cell (0, 0); patches are numbered from P
                qi = (q - P).clamp(min=0)
                ki = (kv - P).clamp(min=0)
                ok = ((qi // gw - ki // gw).abs() <= k) & ((qi % gw - ki % gw).abs() <= k)
            if P and cls_global:
                ok = ok | (q < P) | (kv < P)
            if end is not None:
                ok = ok | (q >= end) | (kv >= end)
            if causal:
                ok = ok & (kv <= q)
            return ok

        return mod

    def allowed(self, L: int, device=None) -> torch.Tensor:
        """[L, L] bool, True where query i may attend to key j (the window only, not the tower's mask)."""
        i = torch.arange(L, device=device)
        return self.mask_mod(with_causal=False)(None, None, i[:, None], i[None, :])


def additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, float("-inf"))


class _MaskCache:
    """Additive masks and flex block masks per (length, dtype/kind, device), built on first use."""

    def __init__(self, window: Window, compile_flex: bool = True):
        self.window = window
        # impl=flex: compiled (torch.compile) or eager (computes every score; for checking the mask_mod)
        self.compile_flex = compile_flex
        self._store: dict[tuple, Any] = {}

    def additive(self, L: int, dtype: torch.dtype, device) -> torch.Tensor:
        key = ("add", L, dtype, str(device))
        if key not in self._store:
            self._store[key] = additive(self.window.allowed(L, device=device), dtype)
        return self._store[key]

    def flex_skips_enough(self, L: int, device, min_skipped: float = 50.0, min_length: int = 128) -> bool:
        """Whether flex is worth it at length L: at least ``min_length`` tokens and a block mask that skips
        at least ``min_skipped`` percent of the blocks. Below that (the toy backbones' 20 and 65 tokens,
        a text tower's 77, a band of 4 on ViT-B-16's 197 tokens on the CPU) the compile time and the
        partly used blocks cost more than they save, and ``impl=auto`` keeps the SDPA mask path."""
        key = ("skip", L, str(device))
        if key not in self._store:
            self._store[key] = L >= min_length and float(self.block_mask(L, device).sparsity()) >= min_skipped
        return self._store[key]

    def block_mask(self, L: int, device):
        key = ("flex", L, str(device))
        if key not in self._store:
            from torch.nn.attention.flex_attention import create_block_mask  # FlexAttention: only where asked for

            # The kernel evaluates the mask inside partly covered blocks: a lookup in the [L, L] table of
            # allowed pairs is cheaper there than the grid's divisions (CPU: 9.2 against 14.1 ms for a grid
            # of 4 on 577 tokens, where SDPA takes 11.6).
            i = torch.arange(L, device=device)
            table = self.window.mask_mod()(None, None, i[:, None], i[None, :])  # with the causal part

            def lookup(b, h, q, kv):
                return table[q, kv]

            self._store[key] = create_block_mask(lookup, None, None, L, L, device=str(device),
                                                 BLOCK_SIZE=flex_block_size(device))
        return self._store[key]


def flex_available(device: torch.device) -> bool:
    """FlexAttention compiled for ``device``: CUDA, or the CPU where a C++ compiler exists (inductor's CPU
    kernels need one). Asked on every windowed attention call, so answered once per device type."""
    return _flex_available(torch.device(device).type)


@functools.cache
def _flex_available(device_type: str) -> bool:

    if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
        return False
    if device_type == "cuda":
        return True
    return device_type == "cpu" and any(shutil.which(c) for c in ("g++", "c++", "clang++"))


def flex_block_size(device) -> int:
    """Block size of the flex block masks: 128 on CUDA (its kernels' tile), 32 on the CPU, where smaller
    blocks let a window skip more of the score matrix (measured in scripts/bench_attention.py)."""
    return 128 if torch.device(device).type == "cuda" else 32


_COMPILED_FLEX = None


def flex_attention_eager(q, k, v, block_mask):
    """FlexAttention without compiling: every score is computed (slow); for checking a mask_mod."""

    from torch.nn.attention.flex_attention import flex_attention  # FlexAttention: only where asked for

    with warnings.catch_warnings():  # eager flex warns that it is unfused; that is the point here
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask)


def _flex(q, k, v, block_mask, compiled: bool):
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention  # FlexAttention: only where asked for

    if not compiled:
        return flex_attention_eager(q, k, v, block_mask)
    if _COMPILED_FLEX is None:
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    # One compiled kernel per sequence length and window: allow more than dynamo's default 8 recompiles, past
    # which it would silently fall back to eager (which computes every score). Scoped to these calls (dynamo's
    # config.patch; the setting is private to torch._dynamo, so it is named here once), not the whole process.
    import torch._dynamo as dynamo  # on first use of compiled flex only: importing dynamo costs start-up time

    limit = max(dynamo.config.recompile_limit, 64)
    with dynamo.config.patch(recompile_limit=limit):
        return _COMPILED_FLEX(q, k, v, block_mask=block_mask)


def combine_masks(tower_mask: Optional[torch.Tensor], local: torch.Tensor, heads: int, batch: int) -> torch.Tensor:
    """The tower's mask (None, [L, L] or [B*H, L, L]; additive float or bool with True = blocked) plus
    the window's additive mask [L, L]; returns a mask SDPA broadcasts over [B, H, L, L]."""
    if tower_mask is None:
        return local
    if tower_mask.dtype == torch.bool:
        tower_mask = additive(~tower_mask, local.dtype)
    m = tower_mask.to(local.dtype)
    if m.dim() == 2:
        return m + local
    L = local.shape[0]
    m = m.reshape(batch, heads, L, L) + local
    # A row the window and a padding mask block entirely (a padding query far from any word) would give
    # NaN that then leaks through the zero weights of later layers: let such a token see itself.
    dead = torch.isinf(m).all(dim=-1, keepdim=True) & torch.eye(L, dtype=torch.bool, device=m.device)
    return m.masked_fill(dead, 0.0)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tower_mask: Optional[torch.Tensor],
           masks: Optional[_MaskCache], impl: str) -> torch.Tensor:
    """Attention on heads [B, H, L, d] with an optional window; returns [B, H, L, d]."""
    B, H, L, d = q.shape
    if masks is None:
        m = tower_mask
        if m is not None and m.dim() == 3:
            m = m.reshape(B, H, L, L)
        if m is not None and m.dtype == torch.bool:
            m = additive(~m, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m.to(q.dtype) if m is not None else None)
    # The flex path rebuilds the tower's causal mask (Window.causal); it cannot take per-sample (padding)
    # masks, or a 2-D mask it does not know.
    flex_ok = tower_mask is None or (tower_mask.dim() == 2 and masks.window.causal)
    if impl == "flex" and not flex_ok:
        raise ValueError("local_attention.impl=flex cannot apply this tower's attention mask (padding or "
                         "non-causal); use impl=mask or auto")
    # FlexAttention has no backward on the CPU: training through a windowed tower there takes the mask path.
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    cpu_grad = q.device.type == "cpu" and needs_grad
    if impl == "flex" and not cpu_grad:
        return _flex(q, k, v, masks.block_mask(L, q.device), compiled=masks.compile_flex)
    if (impl == "auto" and flex_ok and not cpu_grad and flex_available(q.device)
            and masks.flex_skips_enough(L, q.device)):
        return _flex(q, k, v, masks.block_mask(L, q.device), compiled=True)
    local = masks.additive(L, q.dtype, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=combine_masks(tower_mask, local, H, B))


def _heads(x: torch.Tensor, h: int) -> torch.Tensor:
    B, L, W = x.shape
    return x.view(B, L, h, W // h).transpose(1, 2)  # B, h, L, W/h


# ---------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------


class LocalAttention(nn.Module):
    """Batch-first self-attention with a local window, in place of an ``nn.MultiheadAttention``.

    Holds the original's parameters under the original names, and is called the way
    open_clip's ``ResidualAttentionBlock`` calls its attention: ``(q, k, v, need_weights=False,
    attn_mask=...) -> (out, None)``.
    """

    def __init__(self, mha: nn.MultiheadAttention, window: Window, impl: str = "auto",
                 masks: Optional[_MaskCache] = None):
        super().__init__()
        if not (isinstance(mha, nn.MultiheadAttention) and mha.batch_first and mha._qkv_same_embed_dim
                and mha.in_proj_bias is not None and mha.bias_k is None and not mha.add_zero_attn):
            raise ValueError("local attention replaces batch-first nn.MultiheadAttention with packed q/k/v and "
                             "biases (open_clip's standard blocks)")
        self.embed_dim = mha.embed_dim
        self.num_heads = mha.num_heads
        self.batch_first = True
        self.in_proj_weight = mha.in_proj_weight
        self.in_proj_bias = mha.in_proj_bias
        self.out_proj = mha.out_proj
        self.window = window
        self.impl = impl
        self.masks = masks if masks is not None else _MaskCache(window)  # shared by a tower's layers

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, window={self.window}, impl={self.impl}"

    def forward(self, query, key=None, value=None, need_weights: bool = False, attn_mask=None, **_):
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("LocalAttention is self-attention only")
        B, L, W = query.shape
        q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        h = self.num_heads
        o = attend(_heads(q, h), _heads(k, h), _heads(v, h), attn_mask, self.masks, self.impl)
        return self.out_proj(o.transpose(1, 2).reshape(B, L, W)), None


class SplitAttention(nn.Module):
    """Batch-first self-attention with separate ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` Linears.

    Built from an ``nn.MultiheadAttention`` or a ``LocalAttention`` (keeping its window); the Linear
    weights are views of the packed ``in_proj_weight``, so no memory is copied until they change.
    """

    def __init__(self, attn: nn.Module):
        super().__init__()
        W = attn.embed_dim
        self.embed_dim, self.num_heads = W, attn.num_heads
        self.batch_first = True
        wq, wk, wv = attn.in_proj_weight.chunk(3, dim=0)
        bq, bk, bv = attn.in_proj_bias.chunk(3, dim=0)
        for name, w, b in (("q_proj", wq, bq), ("k_proj", wk, bk), ("v_proj", wv, bv)):
            lin = nn.Linear(W, W, device="meta")
            lin.weight = nn.Parameter(w, requires_grad=False)
            lin.bias = nn.Parameter(b, requires_grad=False)
            setattr(self, name, lin)
        self.out_proj = attn.out_proj
        self.window: Optional[Window] = getattr(attn, "window", None)
        self.impl = getattr(attn, "impl", "auto")
        self.masks = getattr(attn, "masks", None) if self.window is not None else None

    def forward(self, query, key=None, value=None, need_weights: bool = False, attn_mask=None, **_):
        if (key is not None and key is not query) or (value is not None and value is not query):
            raise ValueError("SplitAttention is self-attention only")
        B, L, W = query.shape
        h = self.num_heads
        q, k, v = (_heads(p(query), h) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = attend(q, k, v, attn_mask, self.masks, self.impl)
        return self.out_proj(o.transpose(1, 2).reshape(B, L, W)), None


def split_attention(blocks: Sequence[nn.Module]) -> list[str]:
    """Replace each block's attention by a ``SplitAttention``; returns nothing to undo (work on a copy)."""
    done = []
    for i, blk in enumerate(blocks):
        attn = blk.attn
        if isinstance(attn, SplitAttention):
            continue
        if isinstance(attn, LocalAttention) or (isinstance(attn, nn.MultiheadAttention) and attn.batch_first
                                                and attn._qkv_same_embed_dim and attn.in_proj_bias is not None):
            blk.attn = SplitAttention(attn)
            done.append(str(i))
        else:
            raise ValueError(f"block {i}: attention {type(attn).__name__} cannot be split into q/k/v projections "
                             f"(only open_clip's standard nn.MultiheadAttention blocks can)")
    return done


def pack_split_state(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with ``...attn.{q,k,v}_proj.{weight,bias}`` turned back into open_clip's packed
    ``...attn.in_proj_weight`` / ``in_proj_bias`` (out_proj keeps its name)."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in sd.items():
        for part in ("q_proj", "k_proj", "v_proj"):
            tag = f".{part}."
            if tag in k and k.rsplit(".", 2)[-2] == part:
                prefix, kind = k.rsplit(".", 2)[0], k.rsplit(".", 1)[1]
                groups.setdefault(f"{prefix}.{kind}", {})[part] = v
                break
        else:
            out[k] = v
    for key, parts in groups.items():
        if set(parts) != {"q_proj", "k_proj", "v_proj"}:
            raise ValueError(f"{key}: q/k/v projections incomplete ({sorted(parts)})")
        prefix, kind = key.rsplit(".", 1)
        out[f"{prefix}.in_proj_{kind}"] = torch.cat([parts["q_proj"], parts["k_proj"], parts["v_proj"]], 0)
    return out


# ---------------------------------------------------------------------------
# applying windows to a model
# ---------------------------------------------------------------------------


def text_tower_parts(model: nn.Module):
    """(transformer, causal) of an open_clip CLIP / CustomTextCLIP text tower."""
    t = model.text if hasattr(model, "text") else model
    if not hasattr(t, "transformer") or not hasattr(t.transformer, "resblocks"):
        raise ValueError(f"this backbone's text tower ({type(t).__name__}) is not an open_clip transformer")
    return t.transformer, getattr(t, "attn_mask", None) is not None


def vision_tower_parts(model: nn.Module):
    """(transformer, prefix tokens, grid) of an open_clip VisionTransformer."""

    v = model.visual
    if not isinstance(v, VisionTransformer):
        raise ValueError(f"this backbone's image tower is a {type(v).__name__}, not an open_clip VisionTransformer")
    return v.transformer, 1, tuple(int(g) for g in v.grid_size)


def _hook_for(masks: _MaskCache, heads: int):
    """A forward pre-hook adding the window's mask to open_clip's custom ``Attention`` (mask path only)."""

    def hook(module, args, kwargs):
        x = args[0] if args else kwargs["x"]
        L = x.shape[1]
        local = masks.additive(L, x.dtype, x.device)
        m = kwargs.get("attn_mask")
        if m is not None and m.dim() == 3:
            m = combine_masks(m, local, heads, x.shape[0]).reshape(-1, L, L)
        else:
            m = combine_masks(m, local, heads, x.shape[0])
        kwargs["attn_mask"] = m
        return args, kwargs

    return hook


def _apply(transformer: nn.Module, window: Window, layers: list[int], impl: str, tower: str,
           compile_flex: bool = True) -> dict[str, Any]:

    blocks = transformer.resblocks
    masks = _MaskCache(window, compile_flex)  # one cache per tower: every layer uses the same masks
    for i in layers:
        blk = blocks[i]
        attn = blk.attn
        if isinstance(attn, nn.MultiheadAttention):
            blk.attn = LocalAttention(attn, window, impl, masks)
        elif isinstance(attn, Attention):
            if impl == "flex":
                raise ValueError(f"{tower} tower block {i} uses open_clip's custom Attention (qk-norm or scaled "
                                 f"cosine); local attention there has only the mask path: use impl=mask or auto")
            attn.register_forward_pre_hook(_hook_for(masks, attn.num_heads), with_kwargs=True)
        else:
            raise ValueError(f"{tower} tower block {i}: cannot add a local window to {type(attn).__name__}")
    return {"window": window.k, "shape": window.shape, "layers": layers, "cls": window.cls if window.prefix else None}


def apply_local_attention(model: nn.Module, cfg: LocalAttentionConfig) -> dict[str, Any]:
    """Put local windows into the configured layers of ``model``'s towers (in place); returns a summary."""
    summary: dict[str, Any] = {}
    if cfg.text.window is not None:
        try:
            transformer, causal = text_tower_parts(model)
        except ValueError as e:
            raise ValueError(f"{e}; text local attention needs one (set backbone.local_attention.text.window=null)") \
                from None
        layers = parse_layers(cfg.text.layers, len(transformer.resblocks))
        summary["text"] = _apply(transformer, Window(cfg.text.window, "band", causal=causal), layers, cfg.impl,
                                 "text", cfg.flex_compile)
    if cfg.vision.window is not None:
        try:
            transformer, prefix, grid = vision_tower_parts(model)
        except ValueError as e:
            raise ValueError(f"{e}; vision local attention needs one (set backbone.local_attention.vision.window=null)") \
                from None
        layers = parse_layers(cfg.vision.layers, len(transformer.resblocks))
        w = Window(cfg.vision.window, cfg.vision.shape, prefix=prefix, cls=cfg.vision.cls, grid=grid)
        summary["vision"] = _apply(transformer, w, layers, cfg.impl, "vision", cfg.flex_compile)
    if summary:
        summary["impl"] = cfg.impl
    return summary

"""Deep prompts: learnable tokens inside the layers of both frozen towers (shared plumbing of IVLP, MaPLe
and PromptSRC).

Where the tokens go is what the authors' code does (Khattak et al., ``multimodal-prompt-learning`` and
``PromptSRC``, ``clip/model.py``: ``ResidualAttentionBlock_IVLP``, ``ResidualAttentionBlock_MaPLe``,
``VisionTransformer``), pinned by ``tests/fixtures/deep_ref``:

* **image tower** (open_clip ``VisionTransformer``): the layer-0 prompts [n, W] are appended after the
  patch tokens, after the positional embedding (they get none) and before ``ln_pre`` (which they go
  through). Before every deeper prompted block i (1 <= i < depth) the last n tokens, the previous
  prompts' outputs, are replaced by that layer's tokens, as they are (no ``ln_pre``). The class token
  stays at position 0 and is pooled as usual; average pooling averages the patches only.
* **text tower**: the layer-0 prompts are context vectors at the positions right after the start
  token(s), with those positions' embeddings; before every deeper prompted block the same positions are
  replaced by that layer's tokens (no positional embedding). Through the causal mask the class name and
  the end-of-text token see them; they see only the start token and the prompts before them.
* After the last prompted layer the prompt tokens are not removed: their outputs flow on through the
  remaining blocks and are attended to.

"Depth J" means prompts in layers 0 .. J-1 (J = 1: input only, "shallow"); depth 0 is the unmodified
tower, equal to it to float rounding (``tests/test_deep.py``).

The towers are run block by block on the backbone's own modules, each block called the way open_clip's
transformers call it (``block(x, attn_mask=...)``), so open_clip's standard blocks, its custom blocks
(``Attention`` with qk-norm or scaled cosine attention) and fewclip's local-window attention all work
unchanged, and the backbone is never modified (a sweep reuses it). Tokens appended after the patch grid
have no place on it, so a local window lets them see, and be seen by, every token
(``fewclip.backbones.attention.Window``).

``DeepPromptAdapter`` is the adapter part the three methods share: the class prompts (CoOp's layout with
the class name at the end; the first ``n_ctx`` tokens of ``ctx_init`` learnable, any further words of it
fixed tokens, as in the authors' code), the text tower on them (cut to the longest prompt where exact, or
on the CPU with the shared start+context prefix computed once per step, also exact), the image tower with
prompts, optional activation checkpointing, and ``for_classnames``. A subclass says which prompts each
layer gets (``text_prompt_layers``, ``vision_prompt_layers``).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
import torch.nn as nn
from open_clip.transformer import VisionTransformer
from torch.utils.checkpoint import checkpoint as _checkpoint

from fewclip.adapter.base import Adapter, AdapterError
from fewclip.adapters._prompts import packed_suffixes, shared_prefix_length
from fewclip.adapters._text import TextTower, _block_shared, class_prompts, pad_sequences

TEXT_MODES = ("shared", "truncate", "faithful")


# ---------------------------------------------------------------------------
# towers, block by block
# ---------------------------------------------------------------------------


def vision_transformer(model: nn.Module, what: str):
    """The open_clip ``VisionTransformer`` image tower of ``model``, or a one-line error saying what to change."""

    v = getattr(model, "visual", None)
    if not isinstance(v, VisionTransformer):
        raise AdapterError(f"{what} puts prompt tokens into the image tower, which needs an open_clip "
                           f"VisionTransformer; this backbone's image tower is a {type(v).__name__}. Prompt the "
                           f"text tower only (adapter=ivlp adapter.depth_vision=0) or use another backbone")
    if v.attn_pool is not None or v.pool_type not in ("tok", "avg"):
        raise AdapterError(f"{what}: image towers with attentional pooling (CoCa) or pool_type "
                           f"{v.pool_type!r} are not supported; use a ViT pooled at its class token or by "
                           f"averaging, or prompt the text tower only (adapter=ivlp adapter.depth_vision=0)")
    if not getattr(v.transformer, "batch_first", True):
        raise AdapterError(f"{what}: this open_clip build runs its transformer sequence-first; install "
                           f"open_clip_torch >= 2.24 (batch-first blocks)")
    return v


def _call(blk: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
    return blk(x, attn_mask=mask)


def _run_block(blk: nn.Module, x: torch.Tensor, mask: Optional[torch.Tensor], checkpoint: bool) -> torch.Tensor:
    """One block, as open_clip's transformers call it; with ``checkpoint`` its activations are recomputed in
    the backward pass instead of kept (``torch.utils.checkpoint``, non-reentrant)."""
    if checkpoint and torch.is_grad_enabled():
        return _checkpoint(_call, blk, x, mask, use_reentrant=False)
    return blk(x, attn_mask=mask)


def encode_image_deep(visual: nn.Module, pixels: torch.Tensor, prompts: Optional[torch.Tensor] = None, *,
                      checkpoint: bool = False, first: Optional[int] = None, return_tokens: bool = False):
    """Raw features [B, D] of an open_clip ``VisionTransformer`` (``vision_transformer``) on preprocessed
    ``pixels`` [B, 3, H, W], with deep prompts ``prompts`` [J, n, W] (module docstring; None or J = 0: the
    unmodified tower). Runs in the tower's dtype; gradients reach ``prompts`` where enabled.

    ``first`` (an int): the prompts go into blocks ``first`` .. ``first + J - 1`` instead (MMRL's
    representation tokens): appended before block ``first`` to its input (after ``ln_pre``, which they do not
    go through, also for ``first=0``), replaced before each later one. ``return_tokens``: also the last block's outputs at the prompts'
    positions [B, n, W] (before ``ln_post``)."""
    x = vision_tokens(visual, pixels)  # B, 1+N, W
    B, T = x.shape[:2]  # T: class token + patches; the prompts start here
    J = 0 if prompts is None else prompts.shape[0]
    if J and first is None:
        x = torch.cat([x, prompts[0].to(x.dtype).unsqueeze(0).expand(B, -1, -1)], dim=1)  # B, T+n, W
    x = visual.ln_pre(x)
    for i, blk in enumerate(visual.transformer.resblocks):
        j = i - (first or 0)
        if J and first is not None and j == 0:  # MMRL: appended here, after ln_pre
            x = torch.cat([x, prompts[0].to(x.dtype).unsqueeze(0).expand(B, -1, -1)], dim=1)
        elif 1 <= j < J:  # replace the previous prompts' outputs by this layer's prompts
            x = torch.cat([x[:, :T], prompts[j].to(x.dtype).unsqueeze(0).expand(B, -1, -1)], dim=1)
        x = _run_block(blk, x, None, checkpoint)
    pooled = vision_pool(visual, x, T)
    return (pooled, x[:, T:]) if return_tokens else pooled


def vision_tokens(visual: nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The input tokens [B, 1+N, W] of an open_clip ``VisionTransformer`` (``vision_transformer``): patch
    embedding, class token in front, positional embedding, patch dropout; before ``ln_pre``."""
    x = visual.conv1(pixels)  # B, W, gh, gw
    B, W = x.shape[:2]
    x = x.reshape(B, W, -1).permute(0, 2, 1)  # B, N, W
    cls = visual.class_embedding.view(1, 1, -1).expand(B, -1, -1).to(x.dtype)
    x = torch.cat([cls, x], dim=1) + visual.positional_embedding.to(x.dtype)  # B, 1+N, W
    return visual.patch_dropout(x)


def vision_pool(visual: nn.Module, x: torch.Tensor, T: int) -> torch.Tensor:
    """Raw features [B, D] from the last block's output ``x`` [B, T', W] whose first ``T`` tokens are the class
    token and the patches (any after them, prompts, are not pooled): ``ln_post``, pooling, projection."""
    if visual.pool_type == "tok":
        pooled = visual.ln_post(x[:, 0])  # LayerNorm acts per token: pooling first changes nothing
    elif visual.final_ln_after_pool:
        pooled = visual.ln_post(x[:, 1:T].mean(dim=1))
    else:
        pooled = visual.ln_post(x[:, 1:T]).mean(dim=1)
    if visual.proj is not None:
        pooled = pooled @ visual.proj
    return pooled


def text_mask(tower: TextTower, tokens: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``TextTower.attention_mask`` for ids ``tokens`` [N, L], also where L exceeds the context length (tokens
    inserted inside the tower, MMRL): the causal mask is then built at L."""
    L = tokens.shape[1]
    if tower.attn_mask is None or L <= tower.attn_mask.shape[0]:
        return tower.attention_mask(tokens, dtype)
    causal = torch.full((L, L), float("-inf"), dtype=dtype, device=tokens.device).triu_(1)
    if not tower.use_pad_mask:
        return causal
    heads = tower.transformer.resblocks[0].attn.num_heads
    pad = torch.zeros(tokens.shape[0], 1, L, dtype=dtype, device=tokens.device)
    pad.masked_fill_((tokens == tower.mask_pad_id)[:, None, :], float("-inf"))
    return causal.unsqueeze(0) + pad.expand(-1, L, L).repeat_interleave(heads, 0)


def text_lower_blocks(tower: TextTower, x: torch.Tensor, tokens: torch.Tensor, first: int) -> torch.Tensor:
    """The text tower's hidden states [N, L, W] after its first ``first`` blocks, from token embeddings ``x``
    [N, L, W] of ids ``tokens`` (positional embedding added here)."""
    if not getattr(tower.transformer, "batch_first", True):
        raise AdapterError("tokens inside the text tower need batch-first transformer blocks (open_clip_torch >= 2.24)")
    L = x.shape[1]
    dt = tower.dtype
    x = x.to(dt) + tower.positional_embedding[:L].to(dt)
    mask = tower.attention_mask(tokens, dt)
    for blk in list(tower.transformer.resblocks)[:first]:
        x = blk(x, attn_mask=mask)
    return x


def text_upper_blocks(tower: TextTower, h: torch.Tensor, tokens: torch.Tensor, first: int, *,
                      checkpoint: bool = False) -> torch.Tensor:
    """Raw text features [N, D] from the hidden states ``h`` [N, L, W] after the first ``first`` blocks
    (``text_lower_blocks``) of ids ``tokens`` [N, L]: the remaining blocks, pooling, final LayerNorm and
    projection; ``text_upper_blocks(tower, text_lower_blocks(tower, x, tokens, k), tokens, k)`` is the tower."""
    mask = tower.attention_mask(tokens, tower.dtype)
    x = h
    for blk in list(tower.transformer.resblocks)[first:]:
        x = _run_block(blk, x, mask, checkpoint)
    return tower.head(tower.pool(x, tokens))


def encode_text_inserted(tower: TextTower, h: torch.Tensor, tokens: torch.Tensor, prompts: torch.Tensor, first: int,
                         start: int, fill_id: int, *, checkpoint: bool = False) -> torch.Tensor:
    """Raw text features [N, D] with tokens inserted inside the tower (MMRL's representation tokens): ``h``
    [N, L, W] is ``text_lower_blocks(..., first)``; ``prompts`` [J, n, W] are inserted at position ``start``
    (after the start token) before block ``first``, shifting the rest, and replace those positions before
    blocks ``first + 1`` .. ``first + J - 1``. From block ``first`` on, the mask and the pooling see the
    inserted positions as tokens ``fill_id`` (not padding, not the end token)."""
    N, L, _ = h.shape
    J, n = prompts.shape[:2]
    dt = tower.dtype
    fill = torch.full((N, n), fill_id, dtype=tokens.dtype, device=tokens.device)
    tokens = torch.cat([tokens[:, :start], fill, tokens[:, start:]], dim=1)  # N, L+n
    mask = text_mask(tower, tokens, dt)
    x = h
    for i, blk in enumerate(list(tower.transformer.resblocks)[first:]):
        p = prompts[i].to(dt).unsqueeze(0).expand(N, -1, -1) if i < J else None
        if i == 0:
            x = torch.cat([x[:, :start], p, x[:, start:]], dim=1)
        elif p is not None:
            x = torch.cat([x[:, :start], p, x[:, start + n:]], dim=1)
        x = _run_block(blk, x, mask, checkpoint)
    return tower.head(tower.pool(x, tokens))


def encode_text_deep(tower: TextTower, x: torch.Tensor, tokens: torch.Tensor, prompts: Optional[torch.Tensor],
                     start: int, *, checkpoint: bool = False) -> torch.Tensor:
    """Raw text features [N, D] from prompt embeddings ``x`` [N, L, W], the layer-0 prompts already in place
    at positions ``start`` .. ``start + n - 1``, and their ids ``tokens`` [N, L]; ``prompts`` [J, n, W]
    replace those positions before blocks 1 .. J-1 (None: ``TextTower.forward``)."""
    if not getattr(tower.transformer, "batch_first", True):
        raise AdapterError("deep text prompts need batch-first transformer blocks (open_clip_torch >= 2.24)")
    N, L, _ = x.shape
    if L > tower.context_length:
        raise ValueError(f"prompt of {L} tokens exceeds the text tower's context length {tower.context_length}")
    dt = tower.dtype
    x = x.to(dt) + tower.positional_embedding[:L].to(dt)
    mask = tower.attention_mask(tokens, dt)
    J = 0 if prompts is None else prompts.shape[0]
    n = prompts.shape[1] if J else 0
    for i, blk in enumerate(tower.transformer.resblocks):
        if 1 <= i < J:
            p = prompts[i].to(dt).unsqueeze(0).expand(N, -1, -1)
            x = torch.cat([x[:, :start], p, x[:, start + n:]], dim=1)
        x = _run_block(blk, x, mask, checkpoint)
    return tower.head(tower.pool(x, tokens))


def encode_text_packed_deep(tower: TextTower, prefix: torch.Tensor, packed: torch.Tensor, positions: torch.Tensor,
                            mask: torch.Tensor, pool_index: torch.Tensor, prompts: Optional[torch.Tensor],
                            start: int) -> torch.Tensor:
    """``TextTower.forward_packed`` with deep prompts: the shared prefix [P, W] (start token and context) is
    computed once for every class, its positions ``start`` .. ``start + n - 1`` replaced by ``prompts[i]``
    before block i. Exact where ``tower.can_share_prefix``: under the causal mask the prefix sees only itself,
    and the replacement is the same for every class."""
    P = prefix.shape[0]
    dt = tower.dtype
    xp = (prefix.to(dt) + tower.positional_embedding[:P].to(dt)).unsqueeze(0)  # 1, P, W
    xs = (packed.to(dt) + tower.positional_embedding[positions].to(dt)).unsqueeze(0)  # 1, T, W
    causal_p = torch.ones(P, P, dtype=torch.bool, device=xp.device).tril()
    J = 0 if prompts is None else prompts.shape[0]
    n = prompts.shape[1] if J else 0
    for i, blk in enumerate(tower.transformer.resblocks):
        if 1 <= i < J:
            xp = torch.cat([xp[:, :start], prompts[i].to(dt).unsqueeze(0), xp[:, start + n:]], dim=1)
        xp, xs = _block_shared(blk, xp, xs, causal_p, mask)
    return tower.head(xs[0, pool_index])


def gaussian_weights(epochs: int, mean: float, std: float) -> list[float]:
    """PromptSRC's Gaussian prompt aggregation weights of epochs 1 .. ``epochs`` (1-based): the normal density
    N(e; mean, std), divided by its sum (``PromptSRC/trainers/promptsrc.py``, ``get_gauss``)."""
    dens = [math.exp(-0.5 * ((e - mean) / std) ** 2) / (std * math.sqrt(2 * math.pi)) for e in range(1, epochs + 1)]
    total = sum(dens)
    if not total > 0:
        raise ValueError(f"adapter.gpa_mean={mean} with gpa_std={std} gives every one of the {epochs} epochs "
                         f"weight 0; put gpa_mean within the run's epochs or raise gpa_std")
    return [d / total for d in dens]


# ---------------------------------------------------------------------------
# the adapter part the methods share
# ---------------------------------------------------------------------------


def normal(shape, std: float, generator: torch.Generator) -> torch.Tensor:
    """N(0, std) draws from ``generator`` (the authors' ``nn.init.normal_(std=0.02)`` of prompt vectors)."""
    return torch.randn(shape, generator=generator) * std


def linear_init(n: int, out_features: int, in_features: int, generator: torch.Generator):
    """Weights [n, out, in] and biases [n, out] as ``nn.Linear``'s default init draws them (U(+-1/sqrt(in))
    for both: kaiming_uniform with a = sqrt(5)), from ``generator``."""
    bound = 1 / math.sqrt(in_features)
    w = torch.empty(n, out_features, in_features).uniform_(-bound, bound, generator=generator)
    b = torch.empty(n, out_features).uniform_(-bound, bound, generator=generator)
    return w, b


class DeepPromptAdapter(Adapter):
    """Class prompts, both towers with deep prompts, and the logits in the backbone's geometry (module doc).

    Subclasses register their parameters and implement ``text_prompt_layers`` -> [Jt, n_ctx, W_text] or
    None (no prompts in the text tower: its features are computed once) and ``vision_prompt_layers`` ->
    [Jv, n, W_vision] or None (the unmodified image tower: the engine then uses cached features).
    """

    uses_text_tower = True
    supports_new_classes = True
    text_step = "text_features"

    def __init__(self, cfg, backbone, classnames: Sequence[str], templates: Sequence[str], *, n_ctx: int,
                 ctx_init: Optional[str], n_ctx_key: str, checkpointing: bool = False):
        super().__init__(cfg, backbone, classnames, templates)
        if not self.classnames:
            raise AdapterError(f"adapter {self.name!r} needs at least one class name")
        tower = TextTower(backbone.model, backbone.tokenizer)
        self.keep_outside("tower", tower)
        self.checkpointing = bool(checkpointing)
        if ctx_init is not None:
            init_ids = tower.encode_words(ctx_init)
            if not init_ids:
                raise AdapterError(f"adapter.ctx_init={ctx_init!r} gives no tokens with this backbone's tokenizer; "
                                   f"give words it knows, or null for a random context")
            if n_ctx > len(init_ids):
                raise AdapterError(f"adapter.{n_ctx_key}={n_ctx} is more than the {len(init_ids)} tokens of "
                                   f"adapter.ctx_init={ctx_init!r}; use {n_ctx_key}<={len(init_ids)} (the first "
                                   f"tokens of the words become learnable, the rest stay fixed) or ctx_init=null "
                                   f"(random init)")
            ctx_ids = list(init_ids)
        else:
            ctx_ids = [tower.placeholder_id] * n_ctx
        self.n_ctx = n_ctx  # learnable context vectors at layer 0; the rest of ctx_ids stay fixed words
        self._init_ids = ctx_ids[:n_ctx] if ctx_init is not None else None
        layout = class_prompts(tower, self.classnames, ctx_ids, "end", backbone.name)
        seqs = layout.tokens
        device = backbone.device
        # Cut to the longest prompt where that is exact (causal mask, pooling at the end-of-text token).
        L = max(len(s) for s in seqs) if tower.can_truncate else tower.context_length
        self.register_buffer("tokens", pad_sequences(seqs, L, pad_id=tower.pad_id).to(device), persistent=False)
        with torch.no_grad():
            self.register_buffer("fixed_embeddings", tower.embed(self.tokens).float(), persistent=False)  # C, L, W
        self.start = len(tower.prompt_ends().start)  # the learnable context starts here
        # start token(s) and every context token (learnable and fixed) are the same in every class prompt
        self.shared_len = shared_prefix_length(len(ctx_ids), "end", n_start=self.start, csc=False)
        cls_idx, pos_idx, mask, pool = packed_suffixes(seqs, self.shared_len)
        self.register_buffer("_pack_cls", cls_idx.to(device), persistent=False)
        self.register_buffer("_pack_pos", pos_idx.to(device), persistent=False)
        self.register_buffer("_pack_mask", mask.to(device), persistent=False)
        self.register_buffer("_pack_pool", pool.to(device), persistent=False)
        # "shared" (CPU: the prefix once per step, exact), "truncate" (every prompt, cut to the longest), or
        # "faithful" (the full context length, as the authors' code runs it). On a GPU the one batched pass
        # of "truncate" beats the many small kernels of "shared" (scripts/bench_train.py, CoOp).
        can_share = tower.can_share_prefix and self.shared_len >= 2
        self.text_mode = "shared" if (can_share and device.type == "cpu" and not self.checkpointing) else "truncate"
        self._fixed_text: Optional[torch.Tensor] = None

    # -- what subclasses provide ---------------------------------------------
    def text_prompt_layers(self) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def vision_prompt_layers(self) -> Optional[torch.Tensor]:
        raise NotImplementedError

    def word_init(self) -> Optional[torch.Tensor]:
        """The token embeddings of the first ``n_ctx`` tokens of ``ctx_init`` [n_ctx, W] (None: random init)."""
        if self._init_ids is None:
            return None
        with torch.no_grad():
            return self.tower.embed(torch.tensor(self._init_ids, device=self.backbone.device)).float().cpu()

    # -- text tower ------------------------------------------------------------
    def set_text_mode(self, mode: str) -> DeepPromptAdapter:
        """How the text tower runs: "shared", "truncate" or "faithful" (all give the same logits)."""
        if mode not in TEXT_MODES:
            raise ValueError(f"text mode must be one of {TEXT_MODES}, got {mode!r}")
        if mode == "shared" and not (self.tower.can_share_prefix and self.shared_len >= 2):
            raise ValueError("this prompt layout or text tower has no shared prefix to compute once")
        self.text_mode = mode
        return self

    def text_features(self) -> torch.Tensor:
        """Raw text-tower features [C, D] of the class prompts with the current prompts."""
        P = self.text_prompt_layers()
        if P is None:  # nothing learnable in the text tower: computed once
            if self._fixed_text is None or self._fixed_text.device != self.fixed_embeddings.device:
                with torch.no_grad(), torch.autocast(self.fixed_embeddings.device.type, enabled=False):
                    self._fixed_text = self.tower.forward(self.fixed_embeddings, self.tokens).float()
            return self._fixed_text
        C, n, s = self.tokens.shape[0], P.shape[1], self.start
        fixed = self.fixed_embeddings
        x = torch.cat([fixed[:, :s], P[0].to(fixed.dtype).unsqueeze(0).expand(C, -1, -1), fixed[:, s + n:]], dim=1)
        if self.text_mode == "shared":
            packed = x[self._pack_cls, self._pack_pos]  # T, W
            return encode_text_packed_deep(self.tower, x[0, : self.shared_len], packed, self._pack_pos,
                                           self._pack_mask, self._pack_pool, P, s)
        tokens = self.tokens
        if self.text_mode == "faithful" and x.shape[1] < self.tower.context_length:
            pad = torch.full((C, self.tower.context_length - x.shape[1]), self.tower.pad_id, dtype=tokens.dtype,
                             device=x.device)
            tokens = torch.cat([tokens, pad], dim=1)
            x = torch.cat([x, self.tower.embed(pad).to(x.dtype)], dim=1)
        return encode_text_deep(self.tower, x, tokens, P, s, checkpoint=self.checkpointing)

    def prototypes(self) -> torch.Tensor:
        """Class points [C, D] in the backbone's geometry."""
        g = self.backbone.geometry
        return g.prototype(g.embed_text(self.text_features()).unsqueeze(1))

    # -- image tower -----------------------------------------------------------
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw image features [B, D] through the image tower with this adapter's prompts (gradients flow into
        them when enabled)."""
        bb = self.backbone
        V = self.vision_prompt_layers()
        if V is None:
            with torch.no_grad():
                return bb.encode_images(pixels)
        out = encode_image_deep(bb.model.visual, pixels.to(bb.device, bb.dtype), V, checkpoint=self.checkpointing)
        return out.float()

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # raw image features [B, D] -> logits [B, C]
        return self.backbone.geometry.image_logits(features, self.prototypes())

    # -- other class names -----------------------------------------------------
    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> DeepPromptAdapter:
        """The learned prompts (one context shared by all classes, class-independent deep prompts) on other
        class names, in eval mode."""
        if list(classnames) == self.classnames:
            return self
        other = type(self)(self.cfg, self.backbone, classnames, templates, generator=torch.Generator().manual_seed(0))
        other.load_adapter_state_dict(self.adapter_state_dict())
        return other.to(self.backbone.device).eval()

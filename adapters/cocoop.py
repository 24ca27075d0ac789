"""CoCoOp: CoOp's context plus an image-conditioned shift from a small meta-network.

Zhou et al., "Conditional Prompt Learning for Vision-Language Models", CVPR 2022; the authors' code is
``trainers/cocoop.py`` of KaiyangZhou/CoOp. For an image with features ``x``, a meta-network
``Linear(D, D/16) - ReLU - Linear(D/16, W)`` maps the image's point (in the geometry's linear space: the
L2-normalised feature on the sphere, as the authors' code feeds it) to one vector ``pi(x)`` of the text
width, which is added to *every* context vector; the class prompts ``[start] ctx + pi(x) [name] . [end]``
then go through the frozen text tower, and the image is scored against its own class points. So the text
tower runs for every image and every class.

Defaults are the authors' base-to-novel and cross-dataset config (``vit_b16_c4_ep10_batch1_ctxv1``): 4
context vectors from the words "a photo of a", the class name at the end, the meta-network in PyTorch's
default initialisation, batch 1, 10 epochs, SGD at lr 0.002. The context may also be random, class-specific
or placed in the middle or front as in CoOp (``adapter.*`` as for ``coop``).

Start: with ``adapter.meta_init=zero`` (last layer zero, so the shift is 0) and a word init, the prompts are
the zero-shot prompts and the logits equal zero-shot's; with the authors' default init they do not.

Speed: the start token and the shifted context are the same for all classes of one image, so (with the
class name at the end or in the middle, on a causal tower pooled at the end-of-text token) the classes'
remaining tokens are packed end to end in rows of about ``ROW_TOKENS`` tokens, each row run as one
sequence after its image's prefix (``text_mode="shared"``, the default where it applies: about 470 tokens
per image for 100 ImageNet classes instead of 7700; ``scripts/bench_cocoop.py`` times it against the
authors' procedure). ``"truncate"`` runs every prompt cut to the longest, ``"faithful"`` every image's
prompts at the full context length; all three give the same logits.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from fewclip.adapter.base import AdapterError, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._family import default_linear, learned_for_classnames, text_output_dim
from fewclip.adapters._prompts import packed_suffix_rows
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.config.presets import Preset, register_presets

META_INITS = ("default", "zero")
# Tokens of the packed class suffixes per row in the shared path (rows of a few hundred tokens keep the
# attention linear in the number of classes; one image's prefix is attended by all its rows).
ROW_TOKENS = 256
# Prompt tokens run through the text tower at once (images are taken in chunks of about this many tokens).
TOKENS_PER_PASS = 1 << 15


@dataclass
class CoCoOpConfig(CoOpConfig):
    name: str = field(default="cocoop", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx: int = field(default=4, metadata={"help": (
        "Number of context vectors (ignored when ctx_init is given: the words decide).")})
    ctx_init: Optional[str] = field(default="a photo of a", metadata={"help": (
        'Initial words of the context (CoCoOp: "a photo of a"); null = random init.')})
    reduction: int = field(default=16, metadata={"help": (
        "Hidden width of the meta-network: image-feature width // reduction (16 in the authors' code).")})
    meta_init: str = field(default="default", metadata={"help": (
        '"default": PyTorch\'s initialisation of both layers (the authors\'); "zero": the last layer starts at '
        'zero, so training starts from the plain context (zero-shot with a word init).')})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.reduction < 1:
            raise ValueError(f"adapter.reduction must be >= 1, got {self.reduction}")
        if self.meta_init not in META_INITS:
            raise ValueError(f"adapter.meta_init must be one of {META_INITS}, got {self.meta_init!r}")


class CoCoOp(CoOp):
    name = "cocoop"
    supports_new_classes = True
    text_step = "image_text_features"  # the class prompts of a chunk of images (fewclip.training.compiled)
    # vit_b16_c4_ep10_batch1_ctxv1.yaml: batch 1, 10 epochs, SGD lr 0.002 (the train section's default).
    train_defaults = {"batch_size": 1, "epochs": 10}

    def __init__(self, cfg: CoCoOpConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        generator = default_generator(generator)
        super().__init__(cfg, backbone, classnames, templates, generator=generator)
        tower, device = self.tower, backbone.device
        D, W = text_output_dim(tower), tower.width
        hidden = max(1, D // cfg.reduction)
        self.meta_net = nn.Sequential(OrderedDict([
            ("linear1", default_linear(D, hidden, generator)),
            ("relu", nn.ReLU()),
            ("linear2", default_linear(hidden, W, generator, zero=cfg.meta_init == "zero")),
        ])).to(device)
        self.n_start = len(tower.prompt_ends().start)
        self.row_tokens = ROW_TOKENS
        if tower.can_share_prefix and self.shared_len >= 2:
            self._build_rows()
            # On every device: each row is one sequence through the tower's usual kernels (unlike CoOp's
            # prefix path, which CoOp leaves for the cut prompts on a GPU), with a third of the cut prompts'
            # tokens at 100 classes. Not measured on a GPU.
            self.text_mode = "shared"

    def _build_rows(self) -> None:
        """Index buffers of the shared path: every class's tokens after the prefix, packed in rows."""
        P, device = self.shared_len, self.tokens.device
        cls, pos, mask, pool = packed_suffix_rows(self.prompt_token_ids, P, self.row_tokens)
        real = cls >= 0
        cls = cls.clamp(min=0)
        # Which context vector sits in each packed slot (the second half of a "middle" context), -1 for none;
        # worked out on the host, so that the step never asks the device whether there is one.
        ctx_pos = torch.tensor(self.prompt_ctx_positions, dtype=torch.long)  # C, n
        slot = torch.full_like(pos, -1)
        for j in range(ctx_pos.shape[1]):
            slot[(ctx_pos[cls, j] == pos) & real] = j
        self.rows_context_after_name = bool((slot >= 0).any())
        cls, pos, slot = cls.to(device), pos.to(device), slot.to(device)
        self.register_buffer("_rows_fixed", self.fixed_embeddings[cls, pos], persistent=False)  # R, S, W
        self.register_buffer("_rows_pos", pos, persistent=False)
        self.register_buffer("_rows_mask", mask.to(device), persistent=False)
        self.register_buffer("_rows_pool", pool.to(device), persistent=False)
        self.register_buffer("_rows_slot", slot, persistent=False)

    def set_row_tokens(self, n: int) -> CoCoOp:
        """Row length of the shared path's packing (speed only: every length gives the same logits)."""
        self.row_tokens = int(n)
        if self.tower.can_share_prefix and self.shared_len >= 2:
            self._build_rows()
        return self

    # -- text side ----------------------------------------------------------
    def image_context(self, bias: torch.Tensor) -> torch.Tensor:
        """Context vectors shifted by each image's meta-network output ``bias`` [B, W]: [B, n, W], or [B, C, n, W]
        for a class-specific context."""
        if self.ctx.dim() == 2:
            return self.ctx.unsqueeze(0) + bias[:, None, :]
        return self.ctx.unsqueeze(0) + bias[:, None, None, :]

    def image_text_features(self, bias: torch.Tensor) -> torch.Tensor:
        """Raw text features [B, C, D] of every class prompt for each image's shift ``bias`` [B, W]."""
        ctx = self.image_context(bias)
        B, W = bias.shape[0], self.tower.width
        if self.text_mode == "shared":
            P, s = self.shared_len, self.n_start
            start = self.fixed_embeddings[0, :s].unsqueeze(0).expand(B, s, W)
            prefix = torch.cat([start, ctx[:, : P - s].to(start.dtype)], dim=1)  # B, P, W
            packed = self._rows_fixed  # R, S, W
            slot = self._rows_slot
            if self.rows_context_after_name:  # context after the name ("middle"): each image's own
                packed = torch.where((slot >= 0)[None, :, :, None], ctx[:, slot.clamp(min=0)].to(packed.dtype),
                                     packed.unsqueeze(0))  # B, R, S, W
            return self.tower.forward_rows(prefix, packed, self._rows_pos, self._rows_mask, self._rows_pool)
        C, L, _ = self.fixed_embeddings.shape
        n = self.ctx_pos.shape[1]
        src = ctx.unsqueeze(1).expand(B, C, n, W) if ctx.dim() == 3 else ctx
        index = self.ctx_pos[None, :, :, None].expand(B, C, n, W)
        fixed = self.fixed_embeddings.unsqueeze(0).expand(B, C, L, W)
        x = fixed.scatter(2, index, src.to(fixed.dtype))  # B, C, L, W
        if self.text_mode == "truncate":
            return self.tower.forward(x.reshape(B * C, L, W), self.tokens.repeat(B, 1)).reshape(B, C, -1)
        # faithful: the authors' procedure, each image's prompts at the full context length
        full = self.tower.context_length
        pad = torch.full((C, full - L), self.tower.pad_id, dtype=self.tokens.dtype, device=x.device)
        tokens = torch.cat([self.tokens, pad], dim=1)
        pad_emb = self.tower.embed(pad).to(x.dtype)
        return torch.stack([self.tower.forward(torch.cat([x[b], pad_emb], dim=1), tokens) for b in range(B)])

    def prototypes(self) -> torch.Tensor:
        raise AdapterError("CoCoOp's class points depend on the image (its meta-network shifts the context); "
                           "score images with the adapter itself: adapter(features)")

    def _images_per_pass(self) -> int:
        if self.text_mode == "shared":
            per_image = self._rows_pos.shape[0] * self.shared_len + self._rows_pos.numel()
        else:
            per_image = self.fixed_embeddings.shape[0] * (
                self.tower.context_length if self.text_mode == "faithful" else self.fixed_embeddings.shape[1])
        return max(1, TOKENS_PER_PASS // per_image)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw -> [B, C]
        g = self.backbone.geometry
        img = g.embed_image(features.to(self.ctx.device))  # B, D
        bias = self.meta_net(g.to_linear(img).to(self.meta_net.linear1.weight.dtype))  # B, W
        chunk = self._images_per_pass()
        out = []
        for i in range(0, img.shape[0], chunk):
            tf = self.image_text_features(bias[i : i + chunk])  # b, C, D
            b, C, D = tf.shape
            points = g.prototype(g.embed_text(tf).reshape(b * C, 1, D)).reshape(b, C, D)
            out.extend(g.logits(img[i + j : i + j + 1], points[j]) for j in range(b))
        return torch.cat(out) if out else img.new_zeros(0, len(self.classnames))

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> CoCoOp:
        return learned_for_classnames(self, classnames, templates)


register_adapter("cocoop", CoCoOpConfig, CoCoOp, export=STATE)

register_presets(
    "cocoop",
    Preset("authors", "CoCoOp's vit_b16_c4_ep10_batch1_ctxv1 config: fewclip's defaults "
                      "(tests/parity/test_prompt_parity.py)"),
)

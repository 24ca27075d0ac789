"""SkipTuning: fine-tune the upper blocks of both towers, skipping the frozen lower blocks and most classes.

Wu et al., "Skip Tuning: Pre-trained Vision-Language Models are Effective and Efficient Adapters Themselves"
(Koorye/SkipTuning, ``trainers/skip_tuning.py`` ``SkipCustomCLIP`` on ``trainers/baselines/ft_clip.py``).
There is no prompt learner: the prompts are one hand-written template per dataset, and the towers' own weights
are tuned (their ``FinetuneCLIP`` with both towers learnable), from block ``start_layer`` up:

* **Layer-wise skipping.** Blocks ``0 .. start_layer-1`` of both towers, the patch and token embeddings,
  the positional embeddings and ``ln_pre`` stay frozen; blocks ``start_layer ..``, ``ln_final``, the text
  projection, ``ln_post`` and the image projection are trained. The frozen lower blocks run without gradients
  and keep no activations: the text tower's hidden states after them are computed once per class prompt
  (they never change) and each step runs the upper blocks only; the image tower's lower blocks run under
  ``torch.no_grad`` and the backward pass stops at ``start_layer``.
* **Class-wise token skipping.** Each step the text tower runs only on a subset of the classes: the classes
  are ranked by their highest score over the batch against the fixed zero-shot class prototypes (the batch's
  labels first), the top ``ceil(top_ratio x C)`` (at most ``max_top``) are kept, and the rank positions after
  them are kept with probability ``(e^(-x/lambda) - e^(-5/lambda)) / (1 - e^(-5/lambda))`` on ``x =
  linspace(0, 5)`` (their min-max normalised exponential density), drawn once at construction from the
  adapter's generator and then fixed, as theirs is drawn once; the first ``batch size`` ranks, where the
  batch's labels are, always run. The cross-entropy is over the kept classes.
* **Token dropping** (``drop_ratio``, 0 in their configs): a random share in [0, drop_ratio) of the patch
  tokens leaves the image tower at ``start_layer``.

Their base-to-novel recipe (``configs/trainers/SkipTuning/vit_b16_bs4.yaml``, ``train.py`` ``extend_cfg``) is
the default: SGD lr 2e-5 (momentum 0.9, weight decay 5e-4), batch 4, 20 epochs, cosine after one warm-up
epoch at 1e-6, and a staged learning rate: the image tower's tensors at 5e-6 (``image_lr_scale`` 0.25).
Their few-shot config is ``preset=fewshot`` (``train.lr=1e-5 train.epochs=40 train.warmup_epochs=0
adapter.image_lr_scale=1``), their cross-dataset one ``preset=cross_dataset`` (``train.lr=1e-5 train.warmup_lr=1e-8
adapter.image_lr_scale=0.1``); ImageNet, SUN397 and
Food101 run a quarter of the epochs.

Everything is scored in the backbone's geometry (``fewclip.backbones.geometry``): before a step the trained copies are the
frozen blocks, so the logits are zero-shot's in every geometry. The tuned tensors are copies in a
``shared_copy`` of the module tree (``_towers``); the backbone is never modified. Exports: ``_towers.TOWER``
(the generic adapter file; with ``merge=true`` a plain open_clip state dict with the tuned blocks).
"""
from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fewclip.adapter.base import AdapterConfig, AdapterError, default_generator, register_adapter
from fewclip.adapters._deep import _run_block, text_lower_blocks, text_upper_blocks, vision_pool, vision_tokens, vision_transformer
from fewclip.adapters._towers import TOWER, TowerWeightsAdapter, replace_module, shared_copy, tower_blocks
from fewclip.config.presets import Preset, Setting, register_presets


@dataclass
class SkipTuningConfig(AdapterConfig):
    name: str = field(default="skiptuning", metadata={"help": "The method (`fewclip adapters` lists them)."})
    start_layer: Optional[int] = field(default=None, metadata={
        "help": "blocks 0 .. start_layer-1 of both towers stay frozen and run without gradients; the blocks from "
                "it up are tuned (their TRAINER.SKIP.START_LAYER, 6 of ViT-B/16's 12); null: half of each "
                "tower's blocks"})
    top_ratio: float = field(default=0.5, metadata={
        "help": "share of the classes always run through the text tower at a step, the best-scoring first "
                "(their TOP_RATIO; 1 runs every class; above 1 a number of classes)"})
    max_top: int = field(default=50, metadata={"help": "at most this many always-run classes (their MAX_TOP)"})
    reserve_lambda: float = field(default=0.3, metadata={
        "help": "scale of the exponential decay of the chance that a lower-ranked class is run (their LAMBDA)"})
    drop_ratio: float = field(default=0.0, metadata={
        "help": "up to this share of the patch tokens is dropped at start_layer in training (their DROP_RATIO)"})
    image_lr_scale: float = field(default=0.25, metadata={
        "help": "the image tower's learning rate as a multiple of train.lr (their staged NEW_LR / LR: 5e-6 / "
                "2e-5 base-to-novel, 1e-6 / 1e-5 cross-dataset, 1 few-shot)"})

    def __post_init__(self) -> None:
        if self.start_layer is not None and self.start_layer < 0:
            raise ValueError(f"adapter.start_layer must be >= 0 or null, got {self.start_layer}")
        if not self.top_ratio > 0:
            raise ValueError(f"adapter.top_ratio must be > 0, got {self.top_ratio}")
        if self.max_top < 1:
            raise ValueError(f"adapter.max_top must be >= 1, got {self.max_top}")
        if not self.reserve_lambda > 0:
            raise ValueError(f"adapter.reserve_lambda must be > 0, got {self.reserve_lambda}")
        if not 0 <= self.drop_ratio < 1:
            raise ValueError(f"adapter.drop_ratio must be in [0, 1), got {self.drop_ratio}")
        if not self.image_lr_scale > 0:
            raise ValueError(f"adapter.image_lr_scale must be > 0, got {self.image_lr_scale}")


# ---------------------------------------------------------------------------
# class-wise skipping, as pure functions
# ---------------------------------------------------------------------------


def always_run(n_classes: int, top_ratio: float, max_top: int) -> int:
    """How many of ``n_classes`` classes a step always runs (their ``select_classes``' ``num_tops``)."""
    n = math.ceil(top_ratio * n_classes) if top_ratio <= 1.0 else math.ceil(min(top_ratio, n_classes))
    return min(n, max_top)


def reserve_ratios(n_classes: int, n_top: int, lam: float) -> torch.Tensor:
    """The chance [C] that the class at each rank is run: 1 for the first ``n_top`` ranks, then the
    exponential density of scale ``lam`` on ``linspace(0, 5, C - n_top)``, min-max normalised (their scipy
    ``expon.pdf``; a single rank after the top ones gets 0/0, never kept, as theirs)."""
    x = torch.linspace(0.0, 5.0, steps=n_classes - n_top, dtype=torch.float64)
    pdf = torch.exp(-x / lam) / lam
    if len(pdf):
        pdf = (pdf - pdf.min()) / (pdf.max() - pdf.min())
    return torch.cat([torch.ones(n_top, dtype=torch.float64), pdf]).float()


def run_ranks(keep: torch.Tensor, batch: int) -> torch.Tensor:
    """The rank positions [K] (ascending) a step on a batch of ``batch`` images runs: those ``keep`` [C] marks and
    the first ``batch``, where the batch's labels rank, so that every label runs (their code would turn a label
    outside the classes run into class 0). Computed once per batch size: a step needs no host sync."""
    keep = keep.detach().cpu().clone()
    keep[:batch] = True
    return keep.nonzero().flatten()


def skip_classes(scores: torch.Tensor, labels: torch.Tensor, ranks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The classes a step runs and the labels among them: ``scores`` [B, C] of the batch against the class
    prototypes, ``labels`` [B], ``ranks`` [K] the rank positions run (``run_ranks``). The classes are ranked by
    their highest score over the batch, the batch's labels first; returns the class indices [K] at those ranks
    in ascending order and each label's position among them [B]."""
    B, C = scores.shape
    s = scores.detach().clone()
    s[torch.arange(B, device=s.device), labels] = float("inf")  # the labels rank first (theirs: 1e4)
    order = s.max(dim=0).values.sort(descending=True).indices  # C: classes by rank
    classes = order[ranks.to(s.device)].sort().values  # K
    position = torch.full((C,), -1, dtype=torch.long, device=s.device)
    position[classes] = torch.arange(classes.shape[0], device=s.device)
    return classes, position[labels]


# ---------------------------------------------------------------------------
# the adapter
# ---------------------------------------------------------------------------


class SkipTuning(TowerWeightsAdapter):
    name = "skiptuning"
    # Their base-to-novel recipe (module docstring) instead of CoOp's.
    train_defaults = {"lr": 2e-5, "epochs": 20, "batch_size": 4, "warmup_epochs": 1, "warmup_lr": 1e-6}

    def __init__(self, cfg: SkipTuningConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        model = shared_copy(backbone.model)
        try:
            visual = vision_transformer(model, "SkipTuning")
        except AdapterError:  # its advice is for prompt methods; SkipTuning always tunes both towers
            raise AdapterError(f"SkipTuning tunes the upper blocks of an open_clip VisionTransformer (pooled at its "
                               f"class token or by averaging, batch-first blocks); this backbone's image tower is a "
                               f"{type(getattr(model, 'visual', None)).__name__}: use a ViT backbone") from None
        tuned, starts = {}, {}
        for tower in ("text", "vision"):
            try:
                prefix, blocks = tower_blocks(model, tower)
            except ValueError as e:
                raise AdapterError(f"SkipTuning tunes both towers and needs open_clip transformers there: {e}") \
                    from None
            k = len(blocks) // 2 if cfg.start_layer is None else cfg.start_layer
            if k > len(blocks):
                raise AdapterError(f"adapter.start_layer={k} is past the {len(blocks)} blocks of this backbone's "
                                   f"{tower} tower; use at most {len(blocks)} (or null: half of each tower)")
            starts[tower] = k
            for i in range(k, len(blocks)):
                tuned[f"{prefix}.{i}"] = copy.deepcopy(blocks[i])
        names = {id(m): n for n, m in model.named_modules()}
        text = model.text if hasattr(model, "text") else model
        heads = {names[id(text.ln_final)]: copy.deepcopy(text.ln_final), names[id(visual.ln_post)]:
                 copy.deepcopy(visual.ln_post)}
        if isinstance(text.text_projection, nn.Module):
            heads[names[id(text.text_projection)]] = copy.deepcopy(text.text_projection)
        for n, m in {**tuned, **heads}.items():
            replace_module(model, n, m.requires_grad_(True))
        params = {}  # the projections that are tensors, not modules (open_clip's text_projection and visual.proj)
        for owner, attr in ((text, "text_projection"), (visual, "proj")):
            p = getattr(owner, attr)
            if isinstance(p, nn.Parameter):
                new = nn.Parameter(p.detach().clone())
                setattr(owner, attr, new)
                params[f"{names[id(owner)]}.{attr}".lstrip(".")] = new
        super().__init__(cfg, backbone, classnames, templates, model, adapts_text=True, trains_image_tower=True)
        self.start = starts
        self.blocks = nn.ModuleDict({n.replace(".", "__"): m for n, m in {**tuned, **heads}.items()})
        self.projections = nn.ParameterDict({n.replace(".", "__"): p for n, p in params.items()})
        self._image_keys = (names[id(visual)].replace(".", "__") + "__",)
        with torch.no_grad():  # the frozen lower text blocks' output per class prompt: fixed for good
            mid = text_lower_blocks(self.tower, self.tower.embed(self.tokens), self.tokens, self.start["text"])
            self.register_buffer("text_mid", mid, persistent=False)
            # the zero-shot prototypes that rank the classes (their class_prototypes, taken before training)
            self.register_buffer("class_protos", self._protos(backbone.geometry).float(), persistent=False)
        C = len(self.classnames)
        n_top = always_run(C, cfg.top_ratio, cfg.max_top)
        self.skips_classes = not (cfg.top_ratio == 1.0 or n_top == C)
        gen = default_generator(generator)
        self.set_keep(torch.rand(C, generator=gen) < reserve_ratios(C, n_top, cfg.reserve_lambda))

    @classmethod
    def will_train_image_tower(cls, cfg: SkipTuningConfig) -> bool:
        return True

    # -- towers -------------------------------------------------------------
    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw features [B, D]: the frozen lower blocks without gradients, the tuned upper ones with them."""
        bb = self.backbone
        visual = self.model.visual
        blocks = list(visual.transformer.resblocks)
        k = self.start["vision"]
        with torch.no_grad():
            x = visual.ln_pre(vision_tokens(visual, pixels.to(bb.device, bb.dtype)))
            for blk in blocks[:k]:
                x = blk(x, attn_mask=None)
        T = x.shape[1]
        if self.training and self.cfg.drop_ratio > 0:
            x = self.drop_tokens(x)
            T = x.shape[1]
        for blk in blocks[k:]:
            x = _run_block(blk, x, None, False)
        return vision_pool(visual, x, T).float()

    def drop_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, W] without a random share in [0, drop_ratio) of its patch tokens (the same ones for
        the whole batch; the class token stays). Draws from torch's global RNG, which the training loop forks
        from the run's generator."""
        P = x.shape[1] - 1
        n_drop = math.ceil(P * float(torch.rand(())) * self.cfg.drop_ratio)
        kept = torch.randperm(P)[n_drop:].sort().values.to(x.device) + 1
        return torch.cat([x[:, :1], x[:, kept]], dim=1)

    def text_features(self, classes: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Raw text features [K*T, D] of the prompts of ``classes`` [K] (None: every class) through the tuned
        upper blocks, from the frozen lower blocks' fixed output."""
        h, tokens = self.text_mid, self.tokens
        if classes is not None:
            T = len(self.templates)
            rows = (classes.to(h.device)[:, None] * T + torch.arange(T, device=h.device)).reshape(-1)
            h, tokens = h[rows], tokens[rows]
        return text_upper_blocks(self.tower, h, tokens, self.start["text"])

    # -- training -------------------------------------------------------------
    def set_keep(self, keep: torch.Tensor) -> None:
        """Which rank positions [C] a step runs (drawn once at construction; on the host, not a buffer)."""
        self.keep = keep.detach().cpu().bool()
        self._ranks: dict[tuple[int, str], torch.Tensor] = {}  # (batch size, device) -> run_ranks on the device

    def step_ranks(self, batch: int, device: torch.device) -> torch.Tensor:
        key = (batch, str(device))
        if key not in self._ranks:
            self._ranks[key] = run_ranks(self.keep, batch).to(device)
        return self._ranks[key]

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Cross-entropy over the classes this step runs (module docstring)."""
        g = self.backbone.geometry
        if not self.skips_classes:
            return {"loss": F.cross_entropy(self(features).float(), labels)}
        with torch.no_grad():
            scores = g.image_logits(features.detach().float(), self.class_protos)
        classes, target = skip_classes(scores, labels, self.step_ranks(labels.shape[0], scores.device))
        emb = g.embed_text(self.text_features(classes))
        protos = g.prototype(emb.reshape(classes.shape[0], len(self.templates), -1))
        logits = g.image_logits(features, protos)
        return {"loss": F.cross_entropy(logits.float(), target)}

    def param_groups(self) -> list[dict]:
        """The text tower's tensors at the run's learning rate, the image tower's at ``image_lr_scale`` x it."""
        image, text = [], []
        for n, p in self.named_parameters():
            key = n.split(".", 1)[1]
            (image if key.startswith(self._image_keys) else text).append(p)
        return [{"params": text, "lr_scale": 1.0}, {"params": image, "lr_scale": float(self.cfg.image_lr_scale)}]

    def merged_state_dict(self) -> dict[str, torch.Tensor]:
        """The backbone's open_clip state dict with the tuned blocks, LayerNorms and projections (same keys)."""
        return self._check_merged(dict(self.model.state_dict()))


register_adapter("skiptuning", SkipTuningConfig, SkipTuning, export=TOWER)

SKIP = "Koorye/SkipTuning@8c4636e configs/trainers/SkipTuning"
register_presets(
    "skiptuning",
    Preset("authors", f"SkipTuning's base-to-novel config ({SKIP}/vit_b16_bs4.yaml): fewclip's defaults "
                      "(tests/test_skiptuning_parity.py)", not_expressed=(
        "batches of one class each from 4 shots up (their sampler); fewclip's batches mix classes",
        "fp16 weights (their default precision); fewclip trains float32 under autocast",
        "a quarter of the epochs on ImageNet, SUN397 and Food101 (their trainer): set train.epochs=5 there")),
    Preset("fewshot", f"SkipTuning's few-shot config ({SKIP}/vit_b16_bs4_few_shot.yaml)", settings=(
        Setting("train.lr", 1e-5, f"{SKIP}/vit_b16_bs4_few_shot.yaml:17", "their few-shot learning rate"),
        Setting("train.epochs", 40, f"{SKIP}/vit_b16_bs4_few_shot.yaml:18", "their few-shot epochs"),
        Setting("train.warmup_epochs", 0, f"{SKIP}/vit_b16_bs4_few_shot.yaml:20", "no warm-up"),
        Setting("adapter.image_lr_scale", 1.0, f"{SKIP}/vit_b16_bs4_few_shot.yaml:15-23",
                "no staged learning rate: both towers at train.lr"))),
    Preset("cross_dataset", f"SkipTuning's cross-dataset config ({SKIP}/vit_b16_bs4_cross_datasets.yaml)", settings=(
        Setting("train.lr", 1e-5, f"{SKIP}/vit_b16_bs4_cross_datasets.yaml:17", "their cross-dataset learning rate"),
        Setting("train.warmup_lr", 1e-8, f"{SKIP}/vit_b16_bs4_cross_datasets.yaml:22", "their warm-up rate"),
        Setting("adapter.image_lr_scale", 0.1, f"{SKIP}/vit_b16_bs4_cross_datasets.yaml:24-25",
                "their staged NEW_LR 1e-6 against LR 1e-5"))),
)

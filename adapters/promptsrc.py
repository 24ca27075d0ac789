"""PromptSRC: IVLP regularised towards the frozen model, with Gaussian prompt aggregation.

Khattak et al., "Self-regulating Prompts: Foundational Model Adaptation without Forgetting", ICCV 2023;
code ``trainers/promptsrc.py`` of ``muzairkhattak/PromptSRC``. The prompted model is IVLP
(``adapters/ivlp.py``: same prompts, same initialisation); training adds three consistency terms against
the frozen towers to the cross-entropy:

    L = CE(logits, y)
      + text_loss_weight  * mean |t - t0|      over classes x dimensions
      + image_loss_weight * mean |v - v0|      over the batch x dimensions
      + kl_weight * sum_bc p0 (log p0 - log p) / (B * C)

with t, v the prompted text and image points and t0, v0 the frozen model's, in the geometry's linear space
(``to_linear`` of the embedded points: for the cosine geometry the L2-normalised features, as in the
authors' code; tangent coordinates at the origin for the hyperbolic ones); p and p0 the softmax of the
prompted logits and of the frozen logits (image v0 against the text teacher t0) at temperature 1. The KL is
KL(teacher || student) summed and divided by B*C, as their ``F.kl_div(..., reduction="sum") / numel``.

* The text teacher: the frozen text tower's raw features averaged over templates *before* they are embedded
  (their ``fixed_embeddings``: the mean of unnormalised CLIP features, normalised afterwards), computed once,
  when first needed. Templates (``teacher_templates``): ``imagenet60`` is theirs for every dataset, the first
  60 of CLIP's 80 ImageNet templates with "a photo of a {}." first (``trainers/imagenet_templates.py``;
  open_clip's ``OPENAI_IMAGENET_TEMPLATES``); ``dataset`` is the run's templates; ``auto`` (default) takes
  ``imagenet60`` unless the backbone's tokenizer lacks words of them (the toy backbones' word vocabulary),
  then the run's templates.
* The image teacher: the frozen image tower's features of the same augmented view. They do not depend on
  the prompts, so the engine takes them from the sweep's feature cache, computed once per (image, view)
  and shared by every run asking for that view (``wants_frozen_features``); the authors' code recomputes
  them with a second copy of the image tower at every step.
* Gaussian prompt aggregation (GPA): after epoch e (1-based) of N, the prompts are added to a running sum
  with weight w_e = N(e; gpa_mean, gpa_std) / sum_k N(k; gpa_mean, gpa_std); training goes on with the
  un-averaged prompts, and after the last epoch the sum replaces them. Their code averages the whole
  ``state_dict`` (frozen weights included, which come back unchanged up to rounding); here only the
  prompts are averaged.

Defaults: ``configs/trainers/PromptSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml`` (base-to-novel: 4 + 4 tokens,
depth 9, "a photo of a", weights 25 / 10 / 1, SGD lr 0.0025, 20 epochs, batch 4, GPA mean 15 std 1). Their
few-shot config (``vit_b16_c2_ep50_batch4_4+4ctx_few_shot.yaml``): ``train.epochs=50 adapter.gpa_mean=30
adapter.gpa_std=30`` (ImageNet, Caltech101, OxfordPets, Food101, UCF101, SUN397) or ``gpa_mean=45
gpa_std=5`` (StanfordCars, Flowers102, FGVCAircraft, DTD, EuroSAT). Their learning-rate schedule steps once
per epoch with the cosine shifted by the warm-up epoch (the last of 20 epochs at lr 6e-5, not 0); fewclip's
engine steps its cosine per iteration.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from open_clip.zero_shot_metadata import OPENAI_IMAGENET_TEMPLATES

from fewclip.adapter.base import AdapterError, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._deep import gaussian_weights
from fewclip.adapters.ivlp import IVLP, IVLPConfig
from fewclip.config.presets import Preset, Setting, register_presets

log = logging.getLogger(__name__)

TEACHER_TEMPLATES = ("auto", "imagenet60", "dataset")


def imagenet60_templates() -> list[str]:
    """PromptSRC's text-teacher templates: the first 60 of CLIP's 80 ImageNet templates, with
    "a photo of a {}." (the 40th) moved to the front (``PromptSRC/trainers/imagenet_templates.py``)."""

    templates = [t("{}") for t in OPENAI_IMAGENET_TEMPLATES][:60]
    templates.insert(0, templates.pop(templates.index("a photo of a {}.")))
    return templates


@dataclass
class PromptSRCConfig(IVLPConfig):
    name: str = field(default="promptsrc", metadata={"help": "The method (`fewclip adapters` lists them)."})
    text_loss_weight: float = field(default=25.0, metadata={"help": (
        "Weight of the L1 pull of the prompted text features towards the frozen ones (PromptSRC: 25).")})
    image_loss_weight: float = field(default=10.0, metadata={"help": (
        "Weight of the L1 pull of the prompted image features towards the frozen ones (PromptSRC: 10).")})
    kl_weight: float = field(default=1.0, metadata={"help": (
        "Weight of the KL divergence between prompted and zero-shot logits (PromptSRC: 1).")})
    gpa: bool = field(default=True, metadata={"help": (
        'Gaussian prompt aggregation over epochs (1-based epoch numbers).')})
    gpa_mean: float = field(default=15.0, metadata={"help": (
        "Gaussian prompt aggregation: the epoch the weights peak at (PromptSRC: 15 of 20).")})
    gpa_std: float = field(default=1.0, metadata={"help": (
        "Gaussian prompt aggregation: standard deviation in epochs (PromptSRC: 1).")})
    teacher_templates: str = field(default="auto", metadata={"help": (
        '"auto", "imagenet60" (the authors\') or "dataset" (the run\'s templates): see the module docstring.')})

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("text_loss_weight", "image_loss_weight", "kl_weight"):
            if getattr(self, key) < 0:
                raise ValueError(f"adapter.{key} must be >= 0, got {getattr(self, key)}")
        if self.gpa_std <= 0:
            raise ValueError(f"adapter.gpa_std must be > 0, got {self.gpa_std}")
        if self.teacher_templates not in TEACHER_TEMPLATES:
            raise ValueError(f"adapter.teacher_templates must be one of {TEACHER_TEMPLATES}, "
                             f"got {self.teacher_templates!r}")


class PromptSRC(IVLP):
    name = "promptsrc"
    # training_loss needs the frozen image tower's features of the same pixels (``frozen=``).
    wants_frozen_features = True
    # configs/trainers/PromptSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml
    train_defaults = {"lr": 0.0025, "epochs": 20, "batch_size": 4}

    def __init__(self, cfg: PromptSRCConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        super().__init__(cfg, backbone, classnames, templates, generator=generator)
        self.teacher_template_list = self._choose_teacher_templates(cfg.teacher_templates)
        self._teacher: Optional[torch.Tensor] = None
        self._gpa_sum: Optional[dict[str, torch.Tensor]] = None

    def _choose_teacher_templates(self, choice: str) -> list[str]:
        run = [t for t in self.templates] or ["a photo of a {}."]
        bad = [t for t in run if t.count("{}") != 1]
        if bad:
            raise AdapterError(f"each prompt template needs exactly one '{{}}' for the class name; bad: {bad}")
        if choice == "dataset":
            return run
        ours = imagenet60_templates()
        unknown = getattr(self.backbone.tokenizer, "unknown_words", None)
        missing = sorted({w for t in ours for w in unknown(t.format(""))}) if unknown is not None else []
        if choice == "imagenet60":
            if missing:
                raise AdapterError(f"adapter.teacher_templates=imagenet60: the tokenizer of backbone "
                                   f"{self.backbone.name!r} has no token for {missing[:5]} (and "
                                   f"{max(0, len(missing) - 5)} more words of the 60 ImageNet templates); use "
                                   f"adapter.teacher_templates=dataset")
            return ours
        if missing:
            log.info("promptsrc: the text teacher uses the run's %d template(s): the tokenizer of %s lacks words "
                     "of the 60 ImageNet templates", len(run), self.backbone.name)
            return run
        return ours

    # -- the frozen model ------------------------------------------------------
    def teacher_text_points(self) -> torch.Tensor:
        """The text teacher [C, D]: the geometry's embedding of the frozen tower's raw features averaged
        over the teacher templates (computed once, in float32)."""
        device = self.fixed_embeddings.device
        if self._teacher is None or self._teacher.device != device:
            templates, C = self.teacher_template_list, len(self.classnames)
            texts = [t.format(c) for c in self.classnames for t in templates]
            with torch.no_grad(), torch.autocast(device.type, enabled=False):
                raw = self.backbone.encode_text(texts).reshape(C, len(templates), -1).mean(dim=1)
                self._teacher = self.backbone.geometry.embed_text(raw).float()
        return self._teacher

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor,
                      frozen: Optional[torch.Tensor] = None) -> dict[str, torch.Tensor]:
        """Loss terms of one batch: prompted image features [B, D], labels [B], and the frozen image tower's
        features of the same pixels [B, D] (without image prompts, the features are the frozen ones)."""
        cfg, g = self.cfg, self.backbone.geometry
        if frozen is None:
            if self.trains_image_tower:
                raise ValueError("promptsrc.training_loss needs the frozen image tower's features of the batch "
                                 "(frozen=); the engine's loop passes them")
            frozen = features
        protos = self.prototypes()  # C, D
        img = g.embed_image(features.to(protos.device))
        logits = g.logits(img, protos)  # B, C
        ce = F.cross_entropy(logits, labels)
        with torch.no_grad():
            text0 = self.teacher_text_points()
            img0 = g.embed_image(frozen.to(protos.device).float())
            logits0 = g.logits(img0, text0)
        l1_text = F.l1_loss(g.to_linear(protos), g.to_linear(text0))
        l1_image = F.l1_loss(g.to_linear(img), g.to_linear(img0))
        kl = F.kl_div(F.log_softmax(logits, dim=1), F.log_softmax(logits0, dim=1), reduction="sum",
                      log_target=True) / logits.numel()
        loss = ce + cfg.text_loss_weight * l1_text + cfg.image_loss_weight * l1_image + cfg.kl_weight * kl
        return {"loss": loss, "ce": ce.detach(), "l1_text": l1_text.detach(), "l1_image": l1_image.detach(),
                "kl": kl.detach()}

    # -- Gaussian prompt aggregation ---------------------------------------------
    def on_epoch_end(self, epoch: int, epochs: int) -> None:
        """Add the prompts of epoch ``epoch`` (0-based) to the weighted sum; after the last, load the sum."""
        if not self.cfg.gpa:
            return
        w = gaussian_weights(epochs, self.cfg.gpa_mean, self.cfg.gpa_std)[epoch]
        with torch.no_grad():
            params = dict(self.named_parameters())
            if self._gpa_sum is None or epoch == 0:
                self._gpa_sum = {k: p.detach() * w for k, p in params.items()}
            else:
                self._gpa_sum = {k: p.detach() * w + self._gpa_sum[k] for k, p in params.items()}
            if epoch == epochs - 1:
                for k, p in params.items():
                    p.copy_(self._gpa_sum[k])
                self._gpa_sum = None


register_adapter("promptsrc", PromptSRCConfig, PromptSRC, export=STATE)

SRC_FEW = "muzairkhattak/PromptSRC@bb95c77 configs/trainers/PromptSRC/vit_b16_c2_ep50_batch4_4+4ctx_few_shot.yaml"
register_presets(
    "promptsrc",
    Preset("authors", "PromptSRC's base-to-novel config (configs/trainers/PromptSRC/vit_b16_c2_ep20_batch4_4+4ctx.yaml): "
                      "fewclip's defaults (tests/parity/test_deep_parity.py)"),
    Preset("fewshot", "PromptSRC's few-shot config", settings=(
        Setting("train.epochs", 50, f"{SRC_FEW}:19", "their few-shot runs train 50 epochs"),
        Setting("adapter.gpa_mean", 30.0, f"{SRC_FEW}:43", "GPA centred on epoch 30 of 50"),
        Setting("adapter.gpa_std", 30.0, f"{SRC_FEW}:44", "a wide Gaussian for the few-shot runs"),),
        not_expressed=(f"GPA mean 45, std 5 for StanfordCars, Flowers102, FGVCAircraft, DTD, EuroSAT ({SRC_FEW}:46-47): "
                       f"set adapter.gpa_mean=45 adapter.gpa_std=5 there",)),
)

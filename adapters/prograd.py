"""ProGrad: CoOp updated only along directions that do not conflict with the zero-shot prediction.

Zhu et al., "Prompt-aligned Gradient for Prompt Tuning", ICCV 2023; the authors' code is
``ProGrad.public/trainers/prograd.py`` and ``Dassl.ProGrad.pytorch/dassl/engine/trainer.py``
(``prograd_backward_and_update``) of BeierZhu/Prompt-align. Each step computes two gradients of the
context: ``g`` of the cross-entropy and ``b`` of the distillation loss
``mean_b sum_c -softmax(z_zs / T) log_softmax(z / T) T^2`` towards the zero-shot logits ``z_zs`` of the run's
prompt templates. Per parameter tensor, where ``g . b < 0`` the step uses ``g - lambda (g . b / |b|^2) b``
(with lambda 1, the part of ``g`` orthogonal to ``b``), else ``g``; the distillation loss itself is never
minimised, only its direction is used.

Prompt: CoOp's, with 16 context vectors of which the last ones start as the words of ``adapter.ctx_init``
("a photo of a") and the first ones at zero (their base-to-novel script: N_CTX 16). With as many context
vectors as init tokens (``adapter.n_ctx=4``) the start is CoOp's word init, i.e. zero-shot where the
template is "a photo of a {}."; with 16 the twelve zero vectors change the prompt and it is not. The
authors count the init's *words*, fewclip its tokens: they differ only for punctuation (ProGrad's own
template "a type of pet, a photo of a" has 8 words and 9 tokens, and their last init token falls out of
the context). Defaults: lambda 1.0, T 1.0, batch 32, SGD at lr 0.002 and CoOp's epochs by shots (their
few-shot README: 50 / 100 / 100 / 200 / 200); their configs are for RN50 only.

With ``adapter.lam=0`` (or no conflict) ProGrad is CoOp with this init.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Optional

import torch
import torch.nn.functional as F

from fewclip.adapter.base import AdapterError, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._family import learned_for_classnames, zero_shot_points
from fewclip.adapters._text import TextTower
from fewclip.adapters.coop import CoOp, CoOpConfig
from fewclip.config.presets import Preset, register_presets


@dataclass
class ProGradConfig(CoOpConfig):
    name: str = field(default="prograd", metadata={"help": "The method (`fewclip adapters` lists them)."})
    n_ctx: int = field(default=16, metadata={"help": (
        "Context vectors; with ctx_init the last ones start as its words' embeddings and the rest at zero.")})
    ctx_init: Optional[str] = field(default="a photo of a", metadata={"help": (
        'Initial words of the context (ProGrad: "a photo of a"); null = random init.')})
    lam: float = field(default=1.0, metadata={"help": (
        'lambda: how much of the conflicting component is removed (1.0: all of it; 0: plain CoOp).')})
    temperature: float = field(default=1.0, metadata={"help": (
        'Temperature of the distillation loss towards the zero-shot logits.')})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n_ctx < 1:
            raise ValueError(f"adapter.n_ctx must be >= 1, got {self.n_ctx}")
        if not self.lam >= 0:
            raise ValueError(f"adapter.lam must be >= 0, got {self.lam}")
        if not self.temperature > 0:
            raise ValueError(f"adapter.temperature must be > 0, got {self.temperature}")


class ProGrad(CoOp):
    name = "prograd"
    supports_new_classes = True

    def __init__(self, cfg: ProGradConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        words = TextTower(backbone.model, backbone.tokenizer).encode_words(cfg.ctx_init) if cfg.ctx_init else []
        if cfg.ctx_init is not None and cfg.n_ctx < len(words):
            raise AdapterError(f"adapter.ctx_init={cfg.ctx_init!r} is {len(words)} tokens with this backbone's "
                               f"tokenizer, more than adapter.n_ctx={cfg.n_ctx}; raise adapter.n_ctx to at least "
                               f"{len(words)}")
        padded = bool(words) and cfg.n_ctx > len(words)
        # CoOp lays out n_ctx context slots; with more slots than words, the words go into the last ones below.
        super().__init__(replace(cfg, ctx_init=None) if padded else cfg, backbone, classnames, templates,
                         generator=generator)
        self.cfg = cfg
        if padded:
            with torch.no_grad():
                tail = self.tower.embed(torch.tensor(words, device=self.ctx.device)).float()  # k, W
                self.ctx.zero_()
                self.ctx[..., cfg.n_ctx - len(words):, :] = tail
        self.register_buffer("teacher", zero_shot_points(backbone, self.classnames, self.templates, self.name),
                             persistent=False)  # [C, D] geometry points

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        g = self.backbone.geometry
        logits = self(features).float()
        xe = F.cross_entropy(logits, labels)
        if self.cfg.lam == 0:
            return {"loss": xe}
        T = self.cfg.temperature
        with torch.no_grad():
            zs = g.image_logits(features, self.teacher).float()
        kl = (-F.softmax(zs / T, dim=1) * F.log_softmax(logits / T, dim=1)).sum(1).mean() * T * T
        return {"loss": xe, "kl": kl}

    def backward(self, terms: dict[str, torch.Tensor]) -> None:
        """The cross-entropy's gradient, with its component against the distillation gradient removed
        (per parameter tensor, where the two conflict)."""
        if "kl" not in terms:
            terms["loss"].backward()
            return
        params = self.trainable_parameters()
        toward_zs = torch.autograd.grad(terms["kl"], params, retain_graph=True, allow_unused=True)
        terms["loss"].backward()
        lam = self.cfg.lam
        with torch.no_grad():
            for p, b in zip(params, toward_zs):
                a = p.grad
                if a is None or b is None:
                    continue
                bb = (b * b).sum()
                ab = (a * b).sum()
                if bb > 0 and ab < 0:  # conflicting directions (a zero b gives no direction: a stays)
                    p.grad = a - lam * (ab / bb) * b

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> ProGrad:
        return learned_for_classnames(self, classnames, templates)


register_adapter("prograd", ProGradConfig, ProGrad, export=STATE)

register_presets(
    "prograd",
    Preset("authors", "ProGrad's base-to-novel script (16 context vectors): fewclip's defaults "
                      "(tests/parity/test_prompt_parity.py)"),
)

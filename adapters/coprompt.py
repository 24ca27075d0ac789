"""CoPrompt: MaPLe's prompts with feature adapters, kept consistent with the frozen model and LLM descriptions.

Roy and Etemad, "Consistency-guided Prompt Learning for Vision-Language Models", ICLR 2024; code
``trainers/coprompt.py`` of ``ShuvenduRoy/CoPrompt``. The prompted towers are MaPLe's, unchanged
(``adapters/maple.py``: text prompts in the first ``depth`` layers, image prompts coupled to them; their
``MultiModalPromptLearner`` is MaPLe's). On top:

* **adapters** (their ``Adapter``): a two-layer bottleneck without biases on each tower's raw features,
  ``A(x) = relu(W2 relu(W1 x))`` with W1 [D/r, D], W2 [D, D/r] (r = ``adapter_reduction``, 4), mixed in
  as ``v' = 0.1 A(v) + 0.9 v`` (image) and ``t' = 0.2 A(t) + 0.8 t`` (text);
* **consistency** with the frozen model: ``L = CE + distill_weight * (1 - mean cos(t', t_d) + 1 - mean
  cos(v', v0))`` (``distill=cosine``; ``mse``: the squared distances of the unit vectors), with t_d the frozen
  text tower's features of one LLM-generated description per class, description k drawn at random at each
  step (theirs: ``random.randint`` over the descriptions; here torch's RNG, which the engine's loop forks
  from the run's generator), and v0 the frozen image tower's features of the image. The cosines are taken
  in the geometry's linear space (for CLIP: the features, as theirs).

Scoring uses the prompts and adapters on any class names (nothing in them is per class).

**Descriptions** (``adapter.descriptions``): ``auto`` (default) takes the authors' published GPT-3
descriptions, shipped with fewclip in ``adapters/descriptions/coprompt_gpt.json.gz`` (their ``gpt_file/``
for Caltech101, DTD, EuroSAT, FGVCAircraft, Food101, OxfordFlowers, OxfordPets, StanfordCars, SUN397 and
UCF101, MIT License; their ImageNet files are not in the repository snapshot fewclip was built from), where
they hold every class name (matched without regard to case or underscores); a path to a JSON file
``{"class name": ["description", ...], ...}`` takes the user's; ``templates`` takes the run's templates as
the descriptions. Where ``auto`` finds no description for some class, the run's templates stand in and a
warning in the log says so: the text consistency term then pulls towards the hand-crafted prompts (with one
template, KgCoOp's teacher), not towards the LLM's descriptions. Classes with fewer descriptions than others
reuse theirs cyclically (the authors' code needs equal counts).

Defaults: ``configs/trainers/coprompt.yaml`` (2 tokens, depth 9, "a photo of a", W 1.0, cosine; SGD lr
0.0035, 8 epochs, batch 4). Differences: the frozen image features come from the feature cache for the
same augmented view as the batch (theirs: a second random view, ``K_TRANSFORMS 2``, through RandAugment);
fewclip's augmentation is its own (random resized crops and flips), not RandAugment.
"""
from __future__ import annotations

import functools
import gzip
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fewclip.adapter.base import AdapterError, default_generator, register_adapter
from fewclip.adapter.state_export import STATE
from fewclip.adapters._family import text_output_dim
from fewclip.adapters.maple import MaPLe, MaPLeConfig
from fewclip.config.presets import Preset, register_presets

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "descriptions" / "coprompt_gpt.json.gz"
DISTILL = ("cosine", "mse")


@dataclass
class CoPromptConfig(MaPLeConfig):
    name: str = field(default="coprompt", metadata={"help": "The method (`fewclip adapters` lists them)."})
    adapter_reduction: int = field(default=4, metadata={"help": "bottleneck reduction of the feature adapters"})
    image_adapter_ratio: float = field(default=0.1, metadata={"help": "weight of the image adapter's output"})
    text_adapter_ratio: float = field(default=0.2, metadata={"help": "weight of the text adapter's output"})
    distill_weight: float = field(default=1.0, metadata={"help": "weight of the consistency terms (their W)"})
    distill: str = field(default="cosine", metadata={"help": "consistency measure: cosine or mse (their DISTILL)"})
    descriptions: str = field(default="auto", metadata={"help": "text teacher: auto (the authors' LLM descriptions, "
                                                                "else templates), templates, or a JSON file"})

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.adapter_reduction < 1:
            raise ValueError(f"adapter.adapter_reduction must be >= 1, got {self.adapter_reduction}")
        for key in ("image_adapter_ratio", "text_adapter_ratio"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"adapter.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.distill_weight < 0:
            raise ValueError(f"adapter.distill_weight must be >= 0, got {self.distill_weight}")
        if self.distill not in DISTILL:
            raise ValueError(f"adapter.distill must be one of {DISTILL}, got {self.distill!r}")
        if not self.descriptions.strip():
            raise ValueError("adapter.descriptions must be auto, templates or the path of a JSON file")


def _key(name: str) -> str:
    return " ".join(name.replace("_", " ").lower().split())


@functools.lru_cache(maxsize=1)
def shipped_descriptions() -> dict[str, list[str]]:
    """The authors' published descriptions of every shipped dataset, by normalised class name."""
    with gzip.open(SHIPPED, "rt", encoding="utf-8") as f:
        data = json.load(f)
    out: dict[str, list[str]] = {}
    for per_class in data["datasets"].values():
        for name, texts in per_class.items():
            out.setdefault(_key(name), list(texts))
    return out


def read_descriptions(path: str) -> dict[str, list[str]]:
    """A user's descriptions file: a JSON object mapping class names to lists of sentences."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise AdapterError(f"adapter.descriptions={path!r}: no such file; give a JSON file of "
                           f'{{"class name": ["description", ...]}}, or auto / templates')
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"adapter.descriptions={path!r} is not a JSON file ({e}); give "
                           f'{{"class name": ["description", ...]}}') from None
    if not isinstance(data, dict) or not all(isinstance(v, list) and v and all(isinstance(t, str) for t in v)
                                             for v in data.values()):
        raise AdapterError(f"adapter.descriptions={path!r} must map each class name to a non-empty list of "
                           f"sentences")
    return {_key(k): list(v) for k, v in data.items()}


def class_descriptions(cfg: CoPromptConfig, classnames: Sequence[str], templates: Sequence[str]) -> list[list[str]]:
    """The sentences of each class for the text teacher (module docstring), with a log line on the fallback."""
    fallback = [[t.format(c) for t in templates] for c in classnames]
    if cfg.descriptions == "templates":
        return fallback
    table = shipped_descriptions() if cfg.descriptions == "auto" else read_descriptions(cfg.descriptions)
    missing = [c for c in classnames if _key(c) not in table]
    if cfg.descriptions != "auto" and missing:
        raise AdapterError(f"adapter.descriptions={cfg.descriptions!r} has no descriptions of {len(missing)} class(es) "
                           f"({', '.join(missing[:5])}); add them to the file")
    if missing:
        if not templates:
            raise AdapterError("adapter 'coprompt' found no LLM descriptions of these classes and has no templates to "
                               "stand in; give adapter.descriptions=FILE.json or the dataset's templates")
        log.warning("adapter coprompt: no LLM descriptions of %d of %d classes (e.g. %s); the text consistency term "
                    "uses the run's %d template(s) instead (give adapter.descriptions=FILE.json for the method as "
                    "published)", len(missing), len(classnames), ", ".join(missing[:3]), len(templates))
        return fallback
    return [table[_key(c)] for c in classnames]


class FeatureAdapter(nn.Module):
    """Their ``Adapter``: Linear(D, D/r) -> ReLU -> Linear(D/r, D) -> ReLU, no biases, PyTorch's default init
    drawn from a generator."""

    def __init__(self, dim: int, reduction: int, generator: torch.Generator, device=None):
        super().__init__()
        hidden = max(dim // reduction, 1)
        self.down = nn.Parameter(torch.empty(hidden, dim).uniform_(-dim ** -0.5, dim ** -0.5, generator=generator)
                                 .to(device))
        self.up = nn.Parameter(torch.empty(dim, hidden).uniform_(-hidden ** -0.5, hidden ** -0.5, generator=generator)
                               .to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(F.relu(x @ self.down.T) @ self.up.T)


class CoPrompt(MaPLe):
    name = "coprompt"
    wants_frozen_features = True
    # configs/trainers/coprompt.yaml (SGD, momentum 0.9, weight decay 5e-4, one warm-up epoch at 1e-5)
    train_defaults = {"lr": 0.0035, "epochs": 8, "batch_size": 4}

    def __init__(self, cfg: CoPromptConfig, backbone, classnames: Sequence[str], templates: Sequence[str] = (), *,
                 generator: Optional[torch.Generator] = None):
        generator = default_generator(generator)
        super().__init__(cfg, backbone, classnames, templates, generator=generator)
        D, device = text_output_dim(self.tower), backbone.device
        self.adapter_image = FeatureAdapter(D, cfg.adapter_reduction, generator, device)
        self.adapter_text = FeatureAdapter(D, cfg.adapter_reduction, generator, device)
        self._teacher: Optional[torch.Tensor] = None

    @classmethod
    def will_train_image_tower(cls, cfg: CoPromptConfig) -> bool:
        return True

    # -- features ----------------------------------------------------------------
    def text_features(self) -> torch.Tensor:
        """Prompted raw text features [C, D] with the text adapter mixed in."""
        t = super().text_features()
        r = self.cfg.text_adapter_ratio
        return r * self.adapter_text(t) + (1 - r) * t

    def adapted_images(self, features: torch.Tensor) -> torch.Tensor:
        """Raw image features [B, D] with the image adapter mixed in."""
        f = features.float()
        r = self.cfg.image_adapter_ratio
        return r * self.adapter_image(f) + (1 - r) * f

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.backbone.geometry.image_logits(self.adapted_images(features), self.prototypes())

    # -- the text teacher ------------------------------------------------------------
    def description_points(self) -> torch.Tensor:
        """The frozen text tower's points of the descriptions, [K, C, D] in the geometry's linear space: row k
        holds description k of every class (cyclically where a class has fewer); computed once."""
        if self._teacher is None:
            texts = class_descriptions(self.cfg, self.classnames, self.templates)
            K = max(len(t) for t in texts)
            g = self.backbone.geometry
            with torch.no_grad(), torch.autocast(self.backbone.device.type, enabled=False):
                per_class = [g.to_linear(g.embed_text(self.backbone.encode_text(t))) for t in texts]  # n_c, D
            self._teacher = torch.stack([torch.stack([p[k % len(p)] for p in per_class]) for k in range(K)]).float()
        return self._teacher

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor, frozen: Optional[torch.Tensor] = None,
                      description: Optional[int] = None) -> dict[str, torch.Tensor]:
        """Loss terms of a batch: prompted raw image features [B, D], labels, the frozen image tower's features
        [B, D] of the same pixels (the engine passes them) and, optionally, which description k to distil
        towards (None: drawn at random, as theirs)."""
        if frozen is None:
            raise ValueError("coprompt.training_loss needs the frozen image tower's features of the batch (frozen=); "
                             "the engine's loop passes them")
        g, cfg = self.backbone.geometry, self.cfg
        protos = self.prototypes()
        img = g.embed_image(self.adapted_images(features))
        ce = F.cross_entropy(g.logits(img, protos), labels)
        teacher = self.description_points()
        # a 0-dim draw on the host from the loop's forked RNG: no device tensor is read back
        k = int(torch.randint(teacher.shape[0], ()).item()) if description is None else int(description)
        with torch.no_grad():
            t0 = teacher[k].to(protos.device)
            v0 = g.to_linear(g.embed_image(frozen.to(protos.device).float()))
        t, v = g.to_linear(protos), g.to_linear(img)
        if cfg.distill == "cosine":
            text_term = 1 - F.cosine_similarity(t, t0, dim=1).mean()
            image_term = 1 - F.cosine_similarity(v, v0, dim=1).mean()
        else:
            text_term, image_term = F.mse_loss(t, t0), F.mse_loss(v, v0)
        loss = ce + cfg.distill_weight * (text_term + image_term)
        return {"loss": loss, "ce": ce.detach(), "distill_text": text_term.detach(),
                "distill_image": image_term.detach()}


register_adapter("coprompt", CoPromptConfig, CoPrompt, export=STATE)

register_presets(
    "coprompt",
    Preset("authors", "CoPrompt's configs/trainers/coprompt.yaml: fewclip's defaults "
                      "(tests/parity/test_dept_mmrl_coprompt_parity.py)", not_expressed=(
        "a second random view through RandAugment for the frozen image features (ShuvenduRoy/CoPrompt"
        " K_TRANSFORMS 2); fewclip uses the batch's cached view",
    )),
)

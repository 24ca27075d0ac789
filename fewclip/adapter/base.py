"""The adapter interface and registry.

An adapter is the trainable part of a few-shot method on top of a frozen
``Backbone``. It maps *raw image-tower features* ``[B, D]`` to class logits
``[B, C]`` in the backbone's geometry. All its trainable tensors live in the
adapter itself (the backbone is frozen and is not a registered submodule of the
adapter's state), so ``adapter_state_dict()`` holds adapter tensors only.

A method is one file: its config dataclass, its adapter class and one registry
line next to them::

    register_adapter("coop", CoOpConfig, CoOp, export=PROMPTS)

The constructor is ``Adapter(cfg, backbone, classnames, templates, *,
generator=None)``; any random draw comes from ``generator`` (None: a generator
seeded with 0), never from torch's global RNG (``fewclip.utils.rng`` for code that
gives no choice). ``build_adapter`` looks the name up.

How an adapter is trained (``trained_by``):

* ``"loop"``: by the engine's gradient loop (``fewclip.training.engine.train_loop``):
  ``forward(features) -> logits``, cross-entropy, the ``train`` section's
  optimiser, on the batches of the run's feature source (cached augmented
  views, un-augmented features, or fresh pixels through ``encode_images`` when
  ``trains_image_tower``). CoOp, LoRA.
* ``"fit"``: by its own ``fit(data)``, on features the engine encodes once
  (``fewclip.training.engine.FitData``: the un-augmented training images,
  ``fit_views()`` augmented views of them, the validation images, the run's
  ``train`` section, shots and generator). ``fit`` may run the engine's loop
  itself: ``train_loop(self, CachedFeatures(data.views, data.val), data.cfg,
  data.shots, data.generator)``. The linear probes, zs_probe.
* ``None``: nothing to train (zeroshot); its runs have ``shots=0`` and no split.

``export`` (optional) is the adapter's own ``ExportFormat``: how ``fewclip
export`` writes its runs and how ``fewclip predict`` / ``fewclip.load_prompts``
load them back (``fewclip.adapter.exports`` reads the run, checks checksums and calls
it).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from fewclip.config.sections import AdapterConfig
from fewclip.utils.errors import InputError
from fewclip.utils.registry import Registry

TRAINED_BY = ("loop", "fit", None)


def default_generator(generator: Optional[torch.Generator]) -> torch.Generator:
    """``generator``, or a CPU generator seeded with 0 where the caller gave none: an adapter's random draws are
    reproducible without touching torch's global RNG."""
    return generator if generator is not None else torch.Generator().manual_seed(0)


class AdapterError(InputError):
    """An adapter that cannot be built for these class names or this backbone; the message says what to change."""


class Adapter(nn.Module):
    """Base class. Subclasses set ``name`` and implement ``forward`` (and ``fit`` when trained by fit)."""

    name: str = ""
    # True when forward() runs the text tower (so logits change with the parameters).
    uses_text_tower: bool = False
    # "loop", "fit" or None (module docstring).
    trained_by: Optional[str] = "loop"
    # True when the image tower itself is adapted: the engine then encodes images through
    # ``encode_images(pixels)`` (with gradients in training) instead of using cached features.
    trains_image_tower: bool = False
    # True when ``training_loss`` also takes ``frozen=``: the frozen image tower's features [B, D] of the same
    # pixels as the batch (a regulariser towards the frozen model, PromptSRC). The engine takes them from the
    # run's feature cache, computed once per image and view.
    wants_frozen_features: bool = False
    # The name of the method that runs the text tower at every training step (``text_features``), which
    # ``train.compile`` compiles (``fewclip.training.compiled``); None: nothing to compile.
    text_step: Optional[str] = None
    # Overrides of the run's ``train`` section defaults for this adapter (e.g. its own optimiser).
    train_defaults: dict[str, object] = {}
    # How ``text_step`` runs the text tower, where a method has several ways (CoOp: "shared", "truncate",
    # "faithful"); part of what ``train.compile`` compiles, so a compiled step is never reused across modes.
    # None: one way only.
    text_mode: Optional[str] = None

    def __init__(self, cfg: AdapterConfig, backbone, classnames: Sequence[str], templates: Sequence[str]):
        super().__init__()
        self.cfg = cfg
        self.keep_outside("backbone", backbone)
        self.classnames = list(classnames)
        self.templates = list(templates)

    def keep_outside(self, name: str, value: Any) -> None:
        """Hold ``value`` as ``self.<name>`` without registering it: a frozen model, tower or tensor of the
        backbone's stays out of this adapter's parameters, state dict and ``.to()`` (its tensors are not ours)."""
        object.__setattr__(self, name, value)

    def param_groups(self) -> Optional[list[dict[str, Any]]]:
        """The optimiser's parameter groups (e.g. a learning rate of their own for some tensors, DePT's head);
        None (default): one group of ``trainable_parameters()`` at the run's ``train.lr``."""
        return None

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [B, D] raw -> [B, C]
        raise NotImplementedError

    @classmethod
    def will_train_image_tower(cls, cfg: AdapterConfig) -> bool:
        """Whether an adapter of config ``cfg`` will have ``trains_image_tower`` set, known before it is built: a
        sweep launcher gives such runs whole GPUs (a cached-feature run can share one). Override it where the
        config decides (LoRA's ``towers``)."""
        return bool(cls.trains_image_tower)

    # Whether ``for_classnames`` can score class names the adapter was not trained on (base-to-novel's new
    # classes, cross-dataset targets): text-side methods can; a per-class weight or cache cannot.
    supports_new_classes: bool = False

    def training_loss(self, features: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        """Loss terms of one training batch (raw image features [B, D], labels [B]), for the engine's loop.
        ``"loss"`` is what is minimised; other entries (e.g. a regulariser's value) are logged per epoch.
        Default: cross-entropy of ``forward``. Called under the run's autocast; an adapter with
        ``wants_frozen_features`` gets ``frozen=`` too."""
        return {"loss": F.cross_entropy(self(features).float(), labels)}

    def backward(self, terms: dict[str, torch.Tensor]) -> None:
        """Put the gradients of one batch on the trainable parameters (default: ``terms["loss"].backward()``);
        a method that combines the gradients of several terms (ProGrad) overrides this."""
        terms["loss"].backward()

    def learning_rate(self, step: int, total: int, base: float) -> Optional[float]:
        """The learning rate of optimiser step ``step`` (0-based) of ``total`` at the run's ``train.lr``
        ``base``, for a method with its own schedule (2SFS: a cosine per stage, and the switch between its
        stages); None (default): the engine's schedule. Called by the loop before every step."""
        return None

    def on_epoch_end(self, epoch: int, epochs: int) -> None:
        """Called by the engine's loop after training epoch ``epoch`` (0-based) of ``epochs`` (e.g. to
        aggregate prompts over epochs). Default: nothing."""

    def for_classnames(self, classnames: Sequence[str], templates: Sequence[str]) -> Adapter:
        """What this adapter learned, applied to other class names (base-to-novel's new classes, a
        cross-dataset target), as an adapter in eval mode whose ``forward`` scores those classes. The same
        names in the same order give this adapter itself; other names need ``supports_new_classes``."""
        if list(classnames) == self.classnames:
            return self
        raise AdapterError(f"adapter {self.name!r} learns one weight per trained class and cannot score other "
                           f"class names; use a method that adapts the text side (e.g. coop) for new classes")

    def for_target(self, classnames: Sequence[str], templates: Sequence[str],
                   class_map: Optional[Sequence[int]] = None) -> Adapter:
        """What scores a test set that is not the data this adapter was trained on (a domain-shift or
        cross-dataset target, new classes), even one whose class names are the trained ones (ImageNet-V2 has
        ImageNet's): the same class names are not the same task. ``class_map[i]``: the trained label of the
        target's class i where its classes are trained ones (a domain-shift target), else None. Default:
        ``for_classnames``. A method whose authors score their training data and other test sets by different
        heads overrides it (MMRL fuses its two logits only on the data it was trained on)."""
        return self.for_classnames(classnames, templates)

    def rebuilt_for(self, classnames: Sequence[str], templates: Sequence[str]) -> Adapter:
        """This adapter's class and config built for other class names and templates, holding this adapter's
        learned tensors, in eval mode: ``for_classnames`` of a method whose tensors do not depend on the class
        names (a shared context, low-rank updates of the towers, nothing at all)."""
        other = type(self)(self.cfg, self.backbone, classnames, templates)
        other.load_adapter_state_dict(self.adapter_state_dict())
        return other.to(self.backbone.device).eval()

    def fit_views(self) -> int:
        """How many augmented views of the training images ``fit`` wants (besides the un-augmented ones):
        Tip-Adapter builds its cache from 10, CLAP from 20. 0 by default."""
        return 0

    def fit(self, data) -> dict:
        """Train on ``data`` (a ``fewclip.training.engine.FitData``); returns what to record in metrics.json."""
        raise NotImplementedError(f"adapter {self.name!r} is trained by the loop, not fit()")

    def encode_images(self, pixels: torch.Tensor) -> torch.Tensor:
        """Raw image features [B, D]; adapters that train the image tower override this."""
        return self.feature_tower().encode_images(pixels)

    def feature_tower(self):
        """The frozen image tower whose features ``forward`` takes, as a backbone: the backbone itself, or one of
        its ``tower_variant``s (ProLIP: the features before the projection). The engine encodes, caches and stores
        every image through it."""
        return self.backbone

    def adapter_state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's own tensors (persistent buffers and parameters), detached, on CPU."""
        return {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}

    def load_adapter_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.load_state_dict(sd, strict=True)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]


@dataclass(frozen=True)
class ExportFormat:
    """How an adapter's runs are exported (``fewclip export``) and loaded back (``fewclip predict``,
    ``fewclip.load_prompts``). Every export carries fewclip's metadata (a JSON object) where the loader finds
    it: a ``.safetensors`` file under its ``"fewclip"`` metadata key, or a folder in ``fewclip.json``.

    ``write(adapter, path, meta, **options) -> meta``: write the export at ``path``. ``meta`` holds what every
    export carries (format, format_version, fewclip_version, backbone, geometry, preprocess, tokenizer,
    classnames, run); the format adds its own keys and returns the metadata it wrote.
    ``load(path, meta, backbone) -> fewclip.adapter.exports.Classifier``: a classifier from an export whose metadata
    and backbone the core has already read and checked; it must not change ``backbone`` (copy it first).
    ``summary(path, meta) -> str``: what ``fewclip export`` prints.
    """

    name: str  # the "format" value of the metadata; loaders are found by it
    version: int  # the newest format_version this fewclip writes and reads
    default_path: str  # file or folder inside the run directory when no path is given
    write: Callable[..., dict[str, Any]]
    load: Callable[..., Any]
    summary: Callable[[Any, dict[str, Any]], str]
    # Keyword options of ``write`` and their defaults (``fewclip export RUN key=value``).
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    config_cls: type[AdapterConfig]
    adapter_cls: type[Adapter]
    export: Optional[ExportFormat] = None

    @property
    def trains(self) -> bool:
        """Whether the method trains on images (False: zeroshot; its runs have 0 shots and no split)."""
        return self.adapter_cls.trained_by is not None


ADAPTERS: Registry[AdapterInfo] = Registry("adapter", "fewclip.adapters", key="adapter.name",
                                           listing="fewclip adapters")
# Export formats by the "format" value of an export's metadata (each registered by its adapter).
EXPORT_FORMATS: Registry[ExportFormat] = Registry("export format", "fewclip.adapters", key="format",
                                                  lowercase=False)


def register_adapter(name: str, config_cls: type[AdapterConfig], adapter_cls: type[Adapter],
                     export: Optional[ExportFormat] = None) -> None:
    """Register a method: its config dataclass, its adapter class and (optionally) its export format."""
    if adapter_cls.trained_by not in TRAINED_BY:
        raise ValueError(f"adapter {name!r}: trained_by must be one of {TRAINED_BY}, got {adapter_cls.trained_by!r}")
    ADAPTERS.register(name, AdapterInfo(name, config_cls, adapter_cls, export), source=adapter_cls.__module__)
    if export is not None:
        EXPORT_FORMATS.register(export.name, export, source=adapter_cls.__module__)


def adapter_info(name: str) -> AdapterInfo:
    return ADAPTERS.get(name)


def export_format(name: str) -> ExportFormat:
    return EXPORT_FORMATS.get(name)


def build_adapter(cfg: AdapterConfig, backbone, classnames: Sequence[str], templates: Sequence[str], *,
                  generator: Optional[torch.Generator] = None) -> Adapter:
    info = adapter_info(cfg.name)
    if not isinstance(cfg, info.config_cls):
        raise TypeError(f"adapter {cfg.name!r} needs a {info.config_cls.__name__}, got {type(cfg).__name__}")
    # In eval mode (no dropout) until the engine trains it.
    adapter = info.adapter_cls(cfg, backbone, classnames, templates, generator=generator)
    return adapter.to(backbone.device).eval()

"""Image preprocessing as data: how a backbone's evaluation images become pixels.

A ``PreprocessConfig`` says everything open_clip's evaluation transform depends on: the
size, how the image is brought to it (``resize_mode``), the interpolation, the mean and std,
and the colour that pads a ``longest``-side resize. Where it comes from:

- an open_clip architecture with a pretrained tag: open_clip's pretrained configuration of
  that tag (``open_clip.get_pretrained_cfg``) over open_clip's defaults, exactly as
  ``open_clip.create_model`` sets it (SigLIP's ``webli`` tags squash the image, some tags
  interpolate bilinearly);
- a card: its ``preprocess`` section (``fewclip import`` writes every field, with the values
  of the checkpoint's authors), open_clip's defaults for a field it does not give;
- random weights or a local file on the open_clip route: open_clip's defaults, after
  checking that no published tag of the architecture says otherwise
  (``published_preprocess``).

The transform itself is open_clip's ``image_transform`` (the one door to CLIP), given every
field, so the pixels are open_clip's for the same configuration. The configuration is part
of the feature store's address, and ``fewclip backbones NAME`` shows it.

The resize modes (open_clip's names):

- ``shortest``: the shorter side to ``size`` (aspect kept), then a centre crop to
  ``size`` x ``size``; OpenAI's CLIP, MERU, HyCoCLIP and open_clip's default;
- ``squash``: both sides to ``size`` (aspect not kept, nothing cropped); SigLIP, DFN, ...;
- ``longest``: the longer side to ``size`` (aspect kept), then padded with ``fill_color``
  to ``size`` x ``size`` (centred).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import open_clip

OPENAI_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_STD = (0.26862954, 0.26130258, 0.27577711)
RESIZE_MODES = ("shortest", "squash", "longest")
# open_clip's "random" interpolation is for training only (its evaluation transform uses bicubic for it).
INTERPOLATIONS = ("bicubic", "bilinear")
FIELDS = ("size", "resize_mode", "interpolation", "mean", "std", "fill_color")
# The fields a pretrained tag or a card may set (the size is always the image tower's).
SETTABLE = ("resize_mode", "interpolation", "mean", "std", "fill_color")


class PreprocessError(ValueError):
    """A preprocessing configuration that is not one fewclip (open_clip) can apply; the message names the field."""


def _triple(value: Any, name: str) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        value = (value,) * 3
    try:
        out = tuple(float(v) for v in value)
    except (TypeError, ValueError):
        out = ()
    if len(out) != 3:
        raise PreprocessError(f"preprocess.{name} must be three numbers (R, G, B), got {value!r}")
    return out  # type: ignore[return-value]


@dataclass(frozen=True)
class PreprocessConfig:
    """The evaluation preprocessing of a backbone (open_clip's ``PreprocessCfg`` fields, checked)."""

    size: int = field(default=224, metadata={"help": (
        "Input side in pixels: images are resized to it, then centre-cropped (or padded) to size x size.")})
    resize_mode: str = field(default="shortest", metadata={"help": (
        '"shortest": shorter side to size, centre crop; "longest": longer side to size, padded with fill_color; '
        '"squash": both sides to size (aspect ratio changed).')})
    interpolation: str = field(default="bicubic", metadata={"help": (
        'Resampling filter: "bicubic" (OpenAI CLIP) or "bilinear".')})
    mean: tuple[float, float, float] = field(default=OPENAI_MEAN, metadata={"help": (
        "Per-channel mean subtracted after scaling to [0, 1] (RGB).")})
    std: tuple[float, float, float] = field(default=OPENAI_STD, metadata={"help": (
        "Per-channel standard deviation divided by after the mean (RGB).")})
    fill_color: int = field(default=0, metadata={"help": (
        "Padding value (0-255) where resize_mode=longest pads the image to a square.")})

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size <= 0:
            raise PreprocessError(f"preprocess.size must be a positive integer, got {self.size!r}")
        if self.resize_mode not in RESIZE_MODES:
            raise PreprocessError(f"preprocess.resize_mode must be one of {RESIZE_MODES}, got {self.resize_mode!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise PreprocessError(f"preprocess.interpolation must be one of {INTERPOLATIONS}, got "
                                  f"{self.interpolation!r}")
        object.__setattr__(self, "mean", _triple(self.mean, "mean"))
        object.__setattr__(self, "std", _triple(self.std, "std"))
        if any(s <= 0 for s in self.std):
            raise PreprocessError(f"preprocess.std must be positive, got {list(self.std)}")
        if isinstance(self.fill_color, bool) or not isinstance(self.fill_color, int) or not 0 <= self.fill_color <= 255:
            raise PreprocessError(f"preprocess.fill_color must be an integer in [0, 255], got {self.fill_color!r}")

    # -- construction ------------------------------------------------------
    @classmethod
    def from_mapping(cls, values: Optional[Mapping[str, Any]], size: int, where: str = "preprocess") -> PreprocessConfig:
        """open_clip's defaults, overlaid with ``values`` (a card's ``preprocess`` section, a pretrained config);
        ``size`` is the image tower's, and a ``size`` in ``values`` must agree with it."""
        values = dict(values or {})
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise PreprocessError(f"{where} has unknown keys {unknown}; allowed: {list(FIELDS)}")
        given = values.pop("size", None)
        if given is not None:
            given = given[0] if isinstance(given, (list, tuple)) and len(set(given)) == 1 else given
            if given != size:
                raise PreprocessError(f"{where}.size is {given} but the image tower takes {size}px images; remove "
                                      f"size (fewclip uses the tower's)")
        try:
            return cls(size=int(size), **values)
        except PreprocessError as e:
            raise PreprocessError(f"{where}: {e}") from None

    @classmethod
    def for_open_clip_tag(cls, arch: str, tag: str, size: int) -> PreprocessConfig:
        """What ``open_clip.create_model(arch, pretrained=tag)`` sets: its defaults overlaid with the tag's
        pretrained configuration (``open_clip.get_pretrained_cfg``)."""

        pretrained = open_clip.get_pretrained_cfg(arch, tag)
        return cls.from_mapping({k: v for k, v in pretrained.items() if k in SETTABLE and v is not None}, size,
                                where=f"open_clip's pretrained configuration of {arch}/{tag}")

    # -- use ---------------------------------------------------------------
    def transform(self):
        """The evaluation transform, PIL image -> normalised tensor [3, size, size]: open_clip's ``image_transform``
        with every field given."""

        return open_clip.image_transform(self.size, is_train=False, mean=self.mean, std=self.std,
                                         resize_mode=self.resize_mode, interpolation=self.interpolation,
                                         fill_color=self.fill_color)

    def to_dict(self) -> dict[str, Any]:
        """Plain values (lists, not tuples): for a card, a run record and the feature store's address."""
        d = asdict(self)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        return d

    def card_section(self) -> dict[str, Any]:
        """The card's ``preprocess`` section (every field but the size, which is the image tower's)."""
        return {k: v for k, v in self.to_dict().items() if k != "size"}

    def describe(self) -> str:
        how = {"shortest": "shorter side to {s}, centre crop {s}x{s}", "squash": "squashed to {s}x{s}",
               "longest": "longer side to {s}, padded to {s}x{s} with {f}"}[self.resize_mode]
        return (f"{how.format(s=self.size, f=self.fill_color)} ({self.interpolation}); mean "
                f"{[round(m, 8) for m in self.mean]}, std {[round(s, 8) for s in self.std]}")

    def differences(self, other: PreprocessConfig) -> list[str]:
        """The fields (size excluded) where ``other`` differs, as ``field: self -> other``."""
        out = []
        for f in SETTABLE:
            a, b = getattr(self, f), getattr(other, f)
            if a != b:
                out.append(f"{f} {list(b) if isinstance(b, tuple) else b}")
        return out


def published_preprocess(arch: str, size: int) -> dict[str, PreprocessConfig]:
    """open_clip's published tags of ``arch`` -> the preprocessing each was trained (and is evaluated) with."""

    return {tag: PreprocessConfig.for_open_clip_tag(arch, tag, size)
            for tag in open_clip.list_pretrained_tags_by_model(arch)}


def disagreeing_tags(arch: str, size: int, chosen: PreprocessConfig) -> list[str]:
    """The published tags of ``arch`` whose preprocessing differs from ``chosen``, as "tag: what differs"."""
    return sorted(f"{tag}: {', '.join(chosen.differences(cfg))}"
                  for tag, cfg in published_preprocess(arch, size).items() if chosen.differences(cfg))


def parse_preprocess_options(options: Mapping[str, str], size: int, base: PreprocessConfig) -> PreprocessConfig:
    """``base`` with the command-line options of ``fewclip import`` applied (``mean=R,G,B``, ``std=R,G,B``,
    ``resize_mode=``, ``interpolation=``, ``fill_color=``)."""
    values: dict[str, Any] = {}
    for k in ("mean", "std"):
        if k in options:
            try:
                values[k] = [float(x) for x in options[k].split(",")]
            except ValueError:
                raise PreprocessError(f"{k}= takes three comma-separated numbers, got {options[k]!r}") from None
            if len(values[k]) != 3:
                raise PreprocessError(f"{k}= takes three comma-separated numbers, got {options[k]!r}")
    for k in ("resize_mode", "interpolation"):
        if k in options:
            values[k] = options[k]
    if "fill_color" in options:
        try:
            values["fill_color"] = int(options["fill_color"])
        except ValueError:
            raise PreprocessError(f"fill_color= takes an integer in [0, 255], got {options['fill_color']!r}") from None
    return PreprocessConfig.from_mapping({**base.card_section(), **values}, size)


PREPROCESS_OPTIONS = {
    "mean": "image mean R,G,B",
    "std": "image std R,G,B",
    "resize_mode": f"how images reach the model's size: {', '.join(RESIZE_MODES)}",
    "interpolation": f"resize interpolation: {', '.join(INTERPOLATIONS)}",
    "fill_color": "padding colour (0-255) of resize_mode=longest",
}


def options_given(options: Mapping[str, str]) -> Sequence[str]:
    return [k for k in PREPROCESS_OPTIONS if k in options]

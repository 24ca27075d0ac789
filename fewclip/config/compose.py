"""Run configuration: omegaconf structured dataclasses, YAML pieces, CLI dotlist.

Every command takes ``[file.yaml ...] [key=value ...]``: defaults come from the
dataclasses below, each YAML file is merged on top in order (a partial
override of the whole tree), and the ``key=value`` pairs last. The tree is in
struct mode, so an unknown key or a value of the wrong type fails with a
message naming the key.

Shorthands: ``backbone=NAME``, ``data=NAME``, ``adapter=NAME`` and (for sweeps)
``launcher=NAME`` set the section's ``name`` (``backbone=ViT-B-32-quickgelu backbone.pretrained=openai``);
``log=tensorboard`` or ``log=[tensorboard,wandb]`` sets ``log.backends`` (``fewclip.utils.explog``).

A YAML argument that is not an existing file is also looked up among the
config pieces shipped with fewclip (``configs/`` in the repository), so
``fewclip sweep sweep/demo.yaml`` works from any folder.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

import fewclip.configs as configs_pkg
from fewclip.config.help import describe_config, field_help  # noqa: F401  (re-exported: help as data)
from fewclip.config.presets import FEWCLIP
from fewclip.config.sections import AdapterConfig, BackboneConfig, TrainConfig
from fewclip.data.base import DataConfig
from fewclip.data.protocols import PROTOCOLS, TRANSFER_PROTOCOLS, default_targets
from fewclip.utils.errors import InputError
from fewclip.utils.explog import LogConfig

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
SHORTHANDS = ("backbone", "data", "adapter", "launcher")
LIST_SHORTHANDS = {"log": "backends"}  # `log=tensorboard`, `log=[tensorboard,wandb]` (fewclip.utils.explog)


class ConfigError(InputError):
    """A config that cannot be parsed or validated; the message names the key."""


@dataclass
class RunConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig, metadata={"help": (
        "The frozen backbone: name, weights, geometry, precision, device (fewclip backbones lists them).")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "The dataset: name, root folder, templates, test-set size (fewclip datasets lists them).")})
    out: Optional[str] = field(default=None, metadata={"help": (
        'Run directory: config.yaml, metrics.json and the rest go here.')})
    seed: int = field(default=1, metadata={"help": (
        "The run's seed: its few-shot split, initialisation and data order (seed 0 is a seed too).")})
    log_level: str = field(default="info", metadata={"help": (
        'Log verbosity of fewclip\'s lines: "debug", "info", "warning" or "error".')})
    overwrite: bool = field(default=False, metadata={"help": (
        'Replace a finished run of another config in `out` (its files are removed first); without it such a '
        'directory is refused. A finished run of the same config is kept and shown unless this is set.')})
    protocol: str = field(default="fewshot", metadata={"help": (
        "The generalisation protocol (fewclip.data.protocols): fewshot (train and test on the same classes, CoOp's), "
        'base2new (train on the first half of the classes, test on both halves), cross_dataset (train on `data`, '
        'test on other datasets with their own class names) or domain_shift (test on shifted versions of `data` '
        'with its classes or some of them).')})
    targets: list[str] = field(default_factory=list, metadata={"help": (
        'The test datasets of cross_dataset and domain_shift, by name, each read with this `data` section (its '
        "name changed, no split_file); empty: the protocol's default targets of `data.name`.")})
    transductive: str = field(default="none", metadata={"help": (
        "Score the test set(s) a second time with a transductive plug-in on top of the method's logits, using the "
        "whole test set's features (fewclip.training.transductive): none, or transclip (metrics.json: top1_transclip).")})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": (
        "Experiment logging (fewclip.utils.explog): log=tensorboard, log=wandb or log=[tensorboard,wandb]; default none.")})
    threads: int = field(default=0, metadata={"help": (
        "CPU threads this run computes with; 0: $OMP_NUM_THREADS when set, else the usable cores divided by the "
        "processes of a sweep (fewclip.utils.threads). Logged in the run's first line, kept in metrics.json.")})

    def __post_init__(self) -> None:
        if self.threads < 0:
            raise ValueError(f"threads must be >= 0 (0: chosen by fewclip), got {self.threads}")
        if self.transductive not in ("none", "transclip"):
            raise ValueError(f"transductive must be none or transclip, got {self.transductive!r}")
        if self.log_level not in ("debug", "info", "warning", "error"):
            raise ValueError(f"log_level must be debug, info, warning or error, got {self.log_level!r}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed} (Python's random.Random would silently use "
                             f"seed {abs(self.seed)})")
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        self.targets = list(self.targets)
        if self.protocol not in TRANSFER_PROTOCOLS:
            if self.targets:
                raise ValueError(f"targets={self.targets} apply to protocol=cross_dataset or domain_shift only, "
                                 f"not {self.protocol}; remove them")
        elif not self.targets:  # resolved here, so config.yaml names the datasets the run was tested on
            try:
                self.targets = list(default_targets(self.protocol, self.data.name))
            except ValueError as e:
                raise ValueError(f"{e}: targets=[NAME,...]") from None
        elif self.data.name in self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"targets={self.targets} must be distinct and differ from data.name={self.data.name!r}")


@dataclass
class TrainRunFields(RunConfig):
    """The fields of a training run's config. ``fewclip.runs.run.TrainRunConfig`` adds the checks that need the method
    registry; this one is torch-free, so ``fewclip train --help`` composes it without loading a method."""

    shots: int = field(default=16, metadata={"help": (
        "Training images per class (k of k-shot); a method that trains on nothing runs at 0.")})
    adapter: AdapterConfig = field(default_factory=AdapterConfig, metadata={"help": (
        "The method and its options: adapter=NAME, then adapter.OPTION=VALUE (fewclip adapters lists them).")})
    train: TrainConfig = field(default_factory=TrainConfig, metadata={"help": (
        "Optimisation: optimiser, learning rate, schedule, batch size, feature caching, model selection.")})
    preset: str = field(default=FEWCLIP, metadata={"help": (
        'A named preset of the method\'s adapter.* and train.* settings (fewclip.config.presets): fewclip (its own '
        'defaults), authors (the authors\' released procedure), paper, ...; `fewclip adapters NAME` lists them. '
        'Applied before the other arguments: an explicit adapter.X=... or train.X=... wins over the preset.')})
    preset_set: dict[str, Any] = field(default_factory=dict, metadata={"help": (
        "Written by fewclip: the preset's values in effect (those no explicit argument overrode).")})


@dataclass
class FeaturesConfig:
    backbone: BackboneConfig = field(default_factory=BackboneConfig, metadata={"help": (
        "The frozen backbone whose image and text towers make the features.")})
    data: DataConfig = field(default_factory=DataConfig, metadata={"help": (
        "The dataset whose images are encoded (train, val and test splits).")})
    # The feature file to write (.safetensors).
    out: Optional[str] = field(default=None, metadata={"help": "The feature file to write (.safetensors)."})
    # Augmented views of the training images to store (0: none; Tip-Adapter uses 10, Tip-Adapter-F and CLAP 20).
    views: int = field(default=0, metadata={"help": (
        "Augmented views of the training images to store (0: none; Tip-Adapter uses 10, Tip-Adapter-F and CLAP "
        "20).")})
    # The run seed the views are drawn for (view k of an image is the same pixels as in a run of this seed).
    seed: int = field(default=1, metadata={"help": (
        "The run seed the views are drawn for (view k of an image is the same pixels as in a run of this seed).")})
    log_level: str = field(default="info", metadata={"help": 'Log verbosity: "debug", "info", "warning" or "error".'})

    def __post_init__(self) -> None:
        if self.views < 0:
            raise ValueError(f"views must be >= 0, got {self.views}")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")


def train_base(schema: type, adapter: AdapterConfig, train_defaults: dict[str, Any], trains: bool,
               preset: Optional[dict[str, Any]] = None) -> DictConfig:
    """The defaults a train config's arguments are composed on (``schema``: ``TrainRunFields`` or a subclass):
    ``adapter`` is the method's section with its defaults, ``train_defaults`` its own ``train`` values, a method
    that trains on no images (``trains`` false) runs at 0 shots, and ``preset`` (``fewclip.config.presets``) is merged
    on top, under the arguments."""
    base = OmegaConf.structured(schema(adapter=adapter, train=TrainConfig(**train_defaults),
                                       shots=16 if trains else 0))
    if preset:
        base = OmegaConf.merge(base, preset)
    OmegaConf.set_struct(base.preset_set, False)  # a run's config.yaml given back holds what its preset set
    return base


def packaged_config_dirs() -> list[Path]:
    dirs = [CONFIG_DIR]
    dirs.append(Path(configs_pkg.__file__).resolve().parent)  # the installed copy of configs/
    return dirs


def find_yaml(arg: str) -> Path:
    p = Path(arg)
    if p.is_file():
        return p
    rel = Path(*p.parts[1:]) if p.parts and p.parts[0] == "configs" else p
    for d in packaged_config_dirs():
        if (d / rel).is_file():
            return d / rel
    raise ConfigError(f"config file not found: {arg} (looked here and in {CONFIG_DIR})")


def load_yaml(path: str | Path) -> DictConfig:
    """A YAML mapping as a DictConfig. A syntax error, a tag such as ``!!python/object`` (never
    constructed: the loader is yaml's safe loader) or a file that is not a mapping is a ConfigError
    naming the file and line."""

    try:
        node = OmegaConf.load(path)
    except yaml.constructor.ConstructorError as e:
        mark = e.problem_mark
        where = f", line {mark.line + 1}" if mark is not None else ""
        found = re.search(r"'([^']*)'", str(e.problem or ""))
        tag = found.group(1).replace("tag:yaml.org,2002:", "!!") if found else "?"
        raise ConfigError(f"{path}{where}: the tag {tag!r} is not allowed; config files hold plain values "
                          f"(numbers, strings, lists, mappings) and fewclip never constructs objects from YAML. "
                          f"Remove the tag") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"YAML syntax error in {path}{where}: {problem}; fix the file (an unclosed bracket or "
                          f"quote, a missing ':' or wrong indentation?)") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not a UTF-8 text file; give a YAML config file") from None
    except IsADirectoryError:
        raise ConfigError(f"{path} is a folder; give a YAML config file") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
    if not isinstance(node, DictConfig):
        raise ConfigError(f"{path} must be a YAML mapping (key: value lines), not a {type(node).__name__}")
    return node


def split_args(args: Sequence[str]) -> tuple[list[str], list[str]]:
    """Separate YAML files from key=value overrides; anything else is an error."""
    yamls, dotlist = [], []
    for a in args:
        if "=" in a:
            key, value = a.split("=", 1)
            if key in SHORTHANDS:
                key = f"{key}.name"
            elif key in LIST_SHORTHANDS:
                key = f"{key}.{LIST_SHORTHANDS[key]}"
                value = value if value.lstrip().startswith("[") else f"[{value}]"
            dotlist.append(f"{key}={value}")
        elif a.endswith((".yaml", ".yml")):
            yamls.append(a)
        else:
            raise ConfigError(f"argument {a!r} is neither a YAML file nor key=value")
    return yamls, dotlist


def section_name_of(args: Sequence[str], section: str, default: str) -> str:
    """The name a section is given by the arguments (``adapter=coop``, ``launcher: {name: ray}`` in a YAML
    piece, ``launcher.name=ray``; the last one wins): which config dataclass the section takes."""
    yamls, dotlist = split_args(args)
    name = default
    for y in yamls:
        value = load_yaml(find_yaml(y)).get(section, None)
        if isinstance(value, str):
            name = value
        elif isinstance(value, DictConfig) and "name" in value:
            name = value["name"]
    for d in dotlist:
        if d.startswith(f"{section}.name="):
            name = d.split("=", 1)[1]
    return name


def _friendly(e: OmegaConfBaseException) -> str:
    msg = str(e).split("\n")[0]
    key = getattr(e, "full_key", None)
    if key and key not in msg:
        msg = f"{key}: {msg}"
    return msg


def _from_dotlist(dotlist: Sequence[str]) -> DictConfig:
    """``OmegaConf.from_dotlist``, with a value that is not valid YAML a ConfigError naming it and the fix."""
    try:
        return OmegaConf.from_dotlist(list(dotlist))
    except yaml.YAMLError:
        for item in dotlist:
            try:
                OmegaConf.from_dotlist([item])
            except yaml.YAMLError as e:
                problem = getattr(e, "problem", None) or str(e).splitlines()[0]
                hint = "e.g. 'data.prompts=[\"a photo of a {}.\"]'"
                raise ConfigError(f"cannot read the value of {item!r} ({problem}); quote text that holds YAML's "
                                  f"special characters ({{}} [] : ,), {hint}") from None
        raise


def compose(schema: type, args: Sequence[str], base: Optional[DictConfig] = None) -> DictConfig:
    yamls, dotlist = split_args(args)
    cfg = base if base is not None else OmegaConf.structured(schema)
    OmegaConf.set_struct(cfg, True)
    try:
        for y in yamls:
            path = find_yaml(y)
            piece = load_yaml(path)
            for key in SHORTHANDS:  # allow `backbone: toy-clip` in YAML too
                if isinstance(piece.get(key, None), str):
                    piece[key] = {"name": piece[key]}
            for key, leaf in LIST_SHORTHANDS.items():  # `log: tensorboard`, `log: [tensorboard, wandb]`
                value = piece.get(key, None)
                if isinstance(value, (str, ListConfig)):
                    piece[key] = {leaf: [value] if isinstance(value, str) else value}
            cfg = OmegaConf.merge(cfg, piece)
        if dotlist:
            cfg = OmegaConf.merge(cfg, _from_dotlist(dotlist))
    except OmegaConfBaseException as e:
        raise ConfigError(f"bad config: {_friendly(e)}") from None
    return cfg


def to_object(cfg: DictConfig) -> Any:
    """Instantiate the dataclasses (running their ``__post_init__`` checks)."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        cause = e.__cause__ if isinstance(e.__cause__, ValueError) else None
        raise ConfigError(f"bad config: {cause or _friendly(e)}") from None
    except ValueError as e:
        raise ConfigError(f"bad config: {e}") from None


def load_config(args: Sequence[str], schema: type = RunConfig) -> Any:
    return to_object(compose(schema, args))


def to_yaml(obj: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(obj))


def as_dict(obj: Any) -> Any:
    if is_dataclass(obj):
        return {f.name: as_dict(getattr(obj, f.name)) for f in fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [as_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {k: as_dict(v) for k, v in obj.items()}
    return obj

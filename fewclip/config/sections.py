"""The config sections every command composes, as plain dataclasses without torch: the adapter section's base,
``backbone`` (with its local-attention windows), ``train`` and the built-in launchers' ``launcher`` sections.

They live here, not beside the code that uses them (``fewclip.backbones.backbone``, ``fewclip.backbones.attention``,
``fewclip.training.engine``, ``fewclip.runs.launch``, which import torch and re-export them), so that composing a config and
``fewclip COMMAND --help`` never load torch or open_clip (``fewclip.cli.quickhelp``). Each field's help is in its
``metadata={"help": ...}`` (``fewclip.config.help``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# ---------------------------------------------------------------------------
# adapter
# ---------------------------------------------------------------------------


@dataclass
class AdapterConfig:
    """Base of every adapter's config section; ``name`` selects the adapter."""

    name: str = field(default="coop", metadata={"help": "The method (`fewclip adapters` lists them)."})


# ---------------------------------------------------------------------------
# backbone.local_attention
# ---------------------------------------------------------------------------

IMPLS = ("auto", "mask", "flex")
SHAPES = ("band", "grid")
CLS_MODES = ("global", "local")


@dataclass
class TextWindowConfig:
    """``backbone.local_attention.text``: window k (null = global attention) and the layers it applies to."""

    window: Optional[int] = field(default=None, metadata={"help": (
        "Window k: each token attends to tokens at most k positions away; null = global attention.")})
    layers: str = field(default="all", metadata={"help": (
        '"all", "first:N", "last:N", or a comma list of layer indices ("0,2,-1").')})
    _tower = "text"

    def __post_init__(self) -> None:
        key = f"backbone.local_attention.{self._tower}"
        if self.window is not None and self.window < 0:
            raise ValueError(f"{key}.window must be >= 0 or null (global attention), got {self.window}")
        if self.window is None and str(self.layers).strip() != "all":
            raise ValueError(f"{key}.layers is set but window is null: set {key}.window=K as well")
        parse_layers(self.layers, None)


@dataclass
class VisionWindowConfig(TextWindowConfig):
    """``backbone.local_attention.vision``: also the window's shape and the class token's reach."""

    shape: str = field(default="band", metadata={"help": (
        '"band": |i-j| <= k over the patch sequence; "grid": a (2k+1) x (2k+1) neighbourhood on the patch grid.')})
    cls: str = field(default="global", metadata={"help": (
        '"global": the class token sees and is seen by every token; "local": it takes part in the window.')})
    _tower = "vision"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shape not in SHAPES:
            raise ValueError(f"local_attention.vision.shape must be one of {SHAPES}, got {self.shape!r}")
        if self.cls not in CLS_MODES:
            raise ValueError(f"local_attention.vision.cls must be one of {CLS_MODES}, got {self.cls!r}")


@dataclass
class LocalAttentionConfig:
    """``backbone.local_attention``: local-window self-attention in the frozen towers (off by default)."""

    text: TextWindowConfig = field(default_factory=TextWindowConfig, metadata={"help": (
        "Local-window attention in the text tower (window, layers).")})
    vision: VisionWindowConfig = field(default_factory=VisionWindowConfig, metadata={"help": (
        "Local-window attention in the image tower (window, layers, shape, cls).")})
    impl: str = field(default="auto", metadata={"help": (
        '"auto": compiled FlexAttention where its block mask skips at least half the blocks of a sequence of 128+'
        ' tokens (and, on the CPU, no gradient flows through the attention), additive masks otherwise; "mask" or '
        '"flex" to force one.')})
    flex_compile: bool = field(default=True, metadata={"help": (
        'impl=flex: compile it (true) or run it eagerly (false: every score is computed; for checking).')})

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            raise ValueError(f"local_attention.impl must be one of {IMPLS}, got {self.impl!r}")

    @property
    def active(self) -> bool:
        return self.text.window is not None or self.vision.window is not None


def parse_layers(spec: str, n: Optional[int]) -> list[int]:
    """Layer indices from "all", "first:N", "last:N" or "i,j,..." (negative = from the end).
    With ``n=None`` only the syntax is checked."""
    s = str(spec).strip().replace(" ", "")
    bad = (f"local_attention layers={spec!r}: use 'all', 'first:N', 'last:N' or a comma list of layer "
           f"indices such as '0,2,-1'")
    try:
        if s == "all":
            out = list(range(n)) if n is not None else []
        elif s.startswith(("first:", "last:")):
            k = int(s.split(":", 1)[1])
            if k < 1:
                raise ValueError(bad)
            if n is None:
                out = []
            else:
                k = min(k, n)
                out = list(range(k)) if s.startswith("first:") else list(range(n - k, n))
        else:
            idx = [int(t) for t in s.split(",") if t != ""]
            if not idx:
                raise ValueError(bad)
            out = []
            if n is not None:
                for i in idx:
                    j = i + n if i < 0 else i
                    if not 0 <= j < n:
                        raise ValueError(f"local_attention layers={spec!r}: layer {i} does not exist; "
                                         f"this tower has layers 0..{n - 1}")
                    out.append(j)
                out = sorted(set(out))
    except ValueError as e:
        raise ValueError(str(e) if "does not exist" in str(e) else bad) from None
    return out


# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# backbone
# ---------------------------------------------------------------------------

PRECISIONS = ("fp32", "bf16", "fp16")
DEVICE_PATTERN = re.compile(r"auto|cpu|mps|cuda(:\d+)?")


@dataclass
class BackboneConfig:
    """The ``backbone`` section of a run config."""

    name: str = field(default="toy-clip", metadata={"help": (
        'A card path, a shipped card name, or an open_clip architecture name.')})
    pretrained: Optional[str] = field(default=None, metadata={"help": (
        'For open_clip architectures: a pretrained tag, a local checkpoint file, or "none" (random init).')})
    geometry: Optional[str] = field(default=None, metadata={"help": (
        'Geometry override for open_clip architectures (default: clip, or sigmoid when the model has a logit '
        'bias).')})
    seed: int = field(default=0, metadata={"help": (
        'Seed of the random initialisation (backbone.pretrained=none): the same seed builds the same weights in '
        'every process, so a rerun or a sweep on random weights is the same run and reuses stored features.')})
    precision: str = field(default="fp32", metadata={"help": (
        'Weights\' precision: "fp32", "fp16" or "bf16" (the towers stay frozen in it).')})
    device: str = field(default="auto", metadata={"help": '"auto" picks CUDA when available, else the CPU.'})
    cache_dir: Optional[str] = field(default=None, metadata={"help": (
        "Where open_clip keeps downloaded weights; null = its default (~/.cache); nothing is fetched unless the "
        "tag needs it.")})
    tokenizer: Optional[str] = field(default=None, metadata={"help": (
        'A local folder holding the Hugging Face tokenizer that the model names (SigLIP and other open_clip '
        'models with text_cfg.hf_tokenizer_name). Unset: only the local Hugging Face cache is searched, never the'
        ' hub.')})
    local_attention: LocalAttentionConfig = field(default_factory=LocalAttentionConfig, metadata={"help": (
        'Local-window self-attention in the frozen towers (fewclip.backbones.attention), e.g. '
        'local_attention.text.window=8.')})

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"backbone.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not DEVICE_PATTERN.fullmatch(self.device):
            raise ValueError(f"backbone.device must be auto, cpu, cuda, cuda:N or mps, got {self.device!r}")


def backbone_config_from_dict(d: dict[str, Any]) -> BackboneConfig:
    """A ``BackboneConfig`` from a plain dict (nested sections included), checked like a config file."""

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(BackboneConfig), d))
    except OmegaConfBaseException as e:
        raise ValueError(str(e).splitlines()[0]) from None


# ---------------------------------------------------------------------------
# train
# ---------------------------------------------------------------------------

# The prompt methods' text step compiled or not (fewclip.training.compiled).
COMPILE_MODES = ("auto", "on", "off")
OPTIMIZERS = ("sgd", "adam", "adamw")
AMP_MODES = ("auto", "bf16", "fp16", "none")


@dataclass
class TrainConfig:
    """The ``train`` section: optimisation and feature caching."""

    optimizer: str = field(default="sgd", metadata={"help": (
        'Optimiser of the trainable parameters: "sgd" (CoOp), "adam" or "adamw".')})
    lr: float = field(default=0.002, metadata={"help": (
        "Peak learning rate (after warm-up; cosine decay to 0 over the run).")})
    momentum: float = field(default=0.9, metadata={"help": "SGD momentum (train.optimizer=sgd)."})
    weight_decay: float = field(default=5e-4, metadata={"help": (
        "Weight decay (L2 for sgd and adam, decoupled for adamw).")})
    eps: float = field(default=1e-8, metadata={"help": "Adam's and AdamW's epsilon (train.optimizer=adam|adamw)."})
    epochs: Optional[int] = field(default=None, metadata={"help": (
        "null = CoOp's schedule by shots (50/100/100/200/200 for 1/2/4/8/16).")})
    iterations: Optional[int] = field(default=None, metadata={"help": (
        'A number of optimiser steps instead of epochs: `iterations` in total, or `iterations_per_shot` x shots '
        '(CLIP-LoRA: 500 x shots). The first one set wins over `epochs`.')})
    iterations_per_shot: Optional[int] = field(default=None, metadata={"help": (
        "Optimiser steps per shot (CLIP-LoRA: 500): iterations = this x shots; null = use iterations or epochs.")})
    warmup_epochs: int = field(default=1, metadata={"help": (
        "Epochs at the constant warm-up rate warmup_lr before the schedule starts (CoOp: 1).")})
    warmup_lr: float = field(default=1e-5, metadata={"help": "The constant learning rate of the warm-up epochs."})
    batch_size: int = field(default=32, metadata={"help": "Training images per optimiser step."})
    augment_views: int = field(default=8, metadata={"help": (
        'Cached augmented views of the training images; 0 = encode every step (faithful, slow).')})
    augment: bool = field(default=True, metadata={"help": (
        'false: train on the un-augmented training features (no crops or flips).')})
    crop_scale_min: Optional[float] = field(default=None, metadata={"help": (
        "RandomResizedCrop's smallest area fraction; null = the dataset's recommendation (0.08 for photos).")})
    select: str = field(default="last", metadata={"help": (
        '"last": the last epoch\'s model (CoOp); "val": the epoch with the best few-shot validation accuracy.')})
    amp: str = field(default="auto", metadata={"help": (
        'Autocast: "auto" (bf16 on CUDA, none elsewhere), "bf16" or "fp16" (on any device, the CPU\'s autocast '
        'included), or "none".')})
    compile: str = field(default="auto", metadata={"help": (
        'The prompt methods\' text step compiled and the optimiser fused: "auto" (measured on the run\'s first '
        'steps, fewclip.training.compiled), "on" or "off".')})

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.select not in ("last", "val"):
            raise ValueError(f"train.select must be 'last' or 'val', got {self.select!r}")
        if self.amp not in AMP_MODES:
            raise ValueError(f"train.amp must be one of {', '.join(AMP_MODES)}, got {self.amp!r}")
        if self.compile not in COMPILE_MODES:
            raise ValueError(f"train.compile must be one of {', '.join(COMPILE_MODES)}, got {self.compile!r}")
        if self.augment_views < 0:
            raise ValueError(f"train.augment_views must be >= 0, got {self.augment_views}")
        if self.batch_size < 1:
            raise ValueError(f"train.batch_size must be >= 1, got {self.batch_size}")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"train.epochs must be >= 1 or null, got {self.epochs}")
        for key in ("iterations", "iterations_per_shot"):
            v = getattr(self, key)
            if v is not None and v < 1:
                raise ValueError(f"train.{key} must be >= 1 or null, got {v}")
        for key in ("lr", "momentum", "weight_decay", "warmup_lr"):
            if not math.isfinite(getattr(self, key)):
                raise ValueError(f"train.{key} must be a finite number, got {getattr(self, key)}")
        if self.lr <= 0:
            raise ValueError(f"train.lr must be > 0, got {self.lr}")
        if self.eps <= 0:
            raise ValueError(f"train.eps must be > 0, got {self.eps}")
        if self.crop_scale_min is not None and not 0 < self.crop_scale_min <= 1:
            raise ValueError(f"train.crop_scale_min must be in (0, 1], got {self.crop_scale_min}")


# ---------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------


@dataclass
class LauncherConfig:
    """The ``launcher`` section of a sweep config: each launcher has its own subclass (``launcher=ray`` picks
    ``RayConfig``), registered with the launcher."""

    name: str = field(default="local", metadata={"help": "where the runs execute: local, ray or slurm"})


def _positive(cfg, keys, low: float = 1) -> None:
    for key in keys:
        if getattr(cfg, key) < low:
            raise ValueError(f"launcher.{key} must be >= {low:g}, got {getattr(cfg, key)}")


@dataclass
class LocalConfig(LauncherConfig):
    """``launcher=local``: this process, or worker processes on this machine."""

    name: str = field(default="local", metadata={"help": "Where the runs execute: local, ray or slurm (or a plugin's launcher)."})
    workers: int = field(default=1, metadata={"help": (
        "worker processes (1: the runs execute in the launching process, one after another); with GPUs, worker i "
        "uses GPU i modulo their number, without, the CPU threads are split between workers")})

    def __post_init__(self) -> None:
        _positive(self, ("workers",))


@dataclass
class RayConfig(LauncherConfig):
    """``launcher=ray``: each run a Ray task (``pip install "fewclip[ray]"``)."""

    name: str = field(default="ray", metadata={"help": "Where the runs execute: local, ray or slurm (or a plugin's launcher)."})
    address: Optional[str] = field(default=None, metadata={"help": (
        '"auto" (the running cluster), a cluster address (ray://host:10001 or host:6379), or null: start a local '
        "cluster for this sweep, with `cpus` CPUs")})
    cpus: Optional[int] = field(default=None, metadata={"help": "CPUs of a local cluster started for the sweep (null: all)"})
    cpus_per_run: float = field(default=1.0, metadata={"help": "CPUs of one run"})
    gpus_per_run: float = field(default=0.0, metadata={"help": (
        "GPUs of one run; a fraction shares a GPU (0.25: four runs on cached features), rounded up to whole GPUs "
        "for a method that trains the image tower")})
    max_retries: int = field(default=0, metadata={"help": (
        "times a run is retried when its worker dies (0: it is listed as failed, and the next sweep reruns it)")})
    worker_niceness: int = field(default=0, metadata={"help": (
        "niceness of the worker processes of a local cluster started for the sweep (Ray's own default, 15, lets "
        "any other job on the machine starve them; a cluster joined by address keeps its own setting)")})

    def __post_init__(self) -> None:
        if not 0 <= self.worker_niceness <= 19:
            raise ValueError(f"launcher.worker_niceness must be 0-19, got {self.worker_niceness}")
        if self.cpus is not None and self.cpus < 1:
            raise ValueError(f"launcher.cpus must be >= 1 or null (all), got {self.cpus}")
        if not self.cpus_per_run > 0 or not math.isfinite(self.cpus_per_run):
            raise ValueError(f"launcher.cpus_per_run must be > 0, got {self.cpus_per_run}")
        if not self.gpus_per_run >= 0 or not math.isfinite(self.gpus_per_run):
            raise ValueError(f"launcher.gpus_per_run must be >= 0 (a fraction shares a GPU), got {self.gpus_per_run}")
        if self.gpus_per_run > 1 and self.gpus_per_run != int(self.gpus_per_run):
            raise ValueError(f"launcher.gpus_per_run above 1 must be a whole number, got {self.gpus_per_run}")
        _positive(self, ("max_retries",), 0)


@dataclass
class SlurmConfig(LauncherConfig):
    """``launcher=slurm``: SLURM job arrays through submitit (``pip install "fewclip[slurm]"``)."""

    name: str = field(default="slurm", metadata={"help": "Where the runs execute: local, ray or slurm (or a plugin's launcher)."})
    partition: Optional[str] = field(default=None, metadata={"help": "sbatch --partition of each array task"})
    gpus_per_task: int = field(default=1, metadata={"help": "GPUs of each array task"})
    cpus_per_task: int = field(default=4, metadata={"help": "CPUs of each array task"})
    mem_gb: int = field(default=32, metadata={"help": "memory of each array task, GB"})
    time_min: int = field(default=60, metadata={"help": "time limit of each array task, minutes"})
    array_parallelism: int = field(default=32, metadata={"help": "array tasks running at once (sbatch --array=0-N%P)"})
    runs_per_task: int = field(default=1, metadata={"help": (
        "runs executed one after another per array task (more than 1 loads the backbone once for several runs; "
        "time_min must cover them all)")})
    account: Optional[str] = field(default=None, metadata={"help": "sbatch --account"})
    qos: Optional[str] = field(default=None, metadata={"help": "sbatch --qos"})
    constraint: Optional[str] = field(default=None, metadata={"help": "sbatch --constraint"})
    job_name: str = field(default="fewclip", metadata={"help": "sbatch --job-name"})
    setup: list[str] = field(default_factory=list, metadata={"help": (
        "shell lines run before the task (module load ..., source venv/bin/activate)")})
    sbatch: dict[str, str] = field(default_factory=dict, metadata={"help": (
        "any other sbatch option as name: value (e.g. {exclude: node12})")})
    folder: Optional[str] = field(default=None, metadata={"help": (
        "submitit's folder (job scripts, pickles, task logs); null: OUT/.submitit")})
    cluster: str = field(default="slurm", metadata={"help": (
        '"slurm" submits with sbatch; "local" runs the same array tasks as processes on this machine')})
    dry_run: bool = field(default=False, metadata={"help": (
        "print the sbatch script and the runs of each array task; submit nothing")})

    def __post_init__(self) -> None:
        _positive(self, ("gpus_per_task",), 0)
        _positive(self, ("cpus_per_task", "mem_gb", "time_min", "array_parallelism", "runs_per_task"))
        if self.cluster not in ("slurm", "local"):
            raise ValueError(f"launcher.cluster must be 'slurm' or 'local', got {self.cluster!r}")


# The built-in launchers' sections by name (a plugin's launcher brings its own through fewclip.runs.launch's registry).
LAUNCHER_SECTIONS = {"local": LocalConfig, "ray": RayConfig, "slurm": SlurmConfig}

"""The ``fewclip sweep`` config: the ``sweep`` section (methods x datasets x shots x seeds) and the sweep's own
options, torch-free (``fewclip sweep --help`` composes it without loading a method or a launcher).
``fewclip.runs.sweep`` plans and runs it."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf

from fewclip.config.compose import compose, to_object
from fewclip.config.dataset_entries import sweep_datasets
from fewclip.config.sections import LauncherConfig, LocalConfig
from fewclip.data.protocols import PROTOCOLS, TRANSFER_PROTOCOLS
from fewclip.utils.explog import LogConfig


@dataclass
class SweepSpec:
    backbones: list[str] = field(default_factory=lambda: ["toy-clip"], metadata={"help": (
        "Backbones to run every method with (names, card paths or open_clip architectures).")})
    datasets: list[Any] = field(default_factory=lambda: ["toy-shapes"], metadata={"help": (
        "Each a registered dataset's name, a mapping of data keys ({name: folder, root: /data/pets}, named \"pets\" "
        "after its folder; {name: cars, reader: folder, root: PATH, templates: single}) or a YAML piece with a "
        "`data:` section (fewclip.config.dataset_entries). Runs, tables and folders know each by its dataset's name.")})
    methods: list[str] = field(default_factory=lambda: ["zeroshot", "coop"], metadata={"help": (
        'A registered adapter name ("zeroshot", "coop", ...), one with a preset ("tip_adapter[authors]": '
        'adapter=tip_adapter preset=authors; folder tip_adapter-authors) or a label defined in `variants`.')})
    shots: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16], metadata={"help": (
        "Shots per class; methods that train on nothing run once at 0 shots.")})
    seeds: list[int] = field(default_factory=lambda: [1, 2, 3], metadata={"help": (
        "Seeds: each (dataset, shots, seed) is one few-shot split shared by every method.")})
    args: list[str] = field(default_factory=list, metadata={"help": (
        'key=value overrides applied to every run (e.g. train.epochs=10, data.max_test=400).')})
    variants: dict[str, list[str]] = field(default_factory=dict, metadata={"help": (
        'Named method variants: label -> key=value list including adapter=NAME, e.g. coop_n4: [adapter=coop, '
        'adapter.n_ctx=4] zeroshot_single: [adapter=zeroshot, data.templates=single] An adapter that trains on '
        'nothing (zeroshot) runs once per backbone and dataset, at 0 shots.')})
    backbone_args: dict[str, list[str]] = field(default_factory=dict, metadata={"help": (
        "key=value overrides per backbone (e.g. for an open_clip backbone's pretrained tag).")})
    protocol: str = field(default="fewshot", metadata={"help": (
        'The generalisation protocol of every run (fewclip.data.protocols): fewshot, base2new (`datasets` are split '
        'into base and new classes), cross_dataset or domain_shift (`datasets` are the sources). Runs of a '
        'protocol other than fewshot go under OUT/<protocol>/, so one out directory can hold several protocols.')})
    targets: dict[str, list[str]] = field(default_factory=dict, metadata={"help": (
        'cross_dataset / domain_shift: the targets of each source ({toy-shapes: [toy-sketch, toy-shapes-faded]});'
        " a source left out gets the protocol's default targets (fewclip.data.protocols.default_targets).")})

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"sweep.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.targets and self.protocol not in TRANSFER_PROTOCOLS:
            raise ValueError(f"sweep.targets apply to protocol cross_dataset or domain_shift only, not "
                             f"{self.protocol!r}; remove them")
        # (only with targets: naming the datasets reads the dataset registry, which `sweep --help` does not need)
        names = [d.name for d in sweep_datasets(self.datasets, self.args)] if self.targets else []
        unknown = sorted(set(self.targets) - set(names))
        if unknown:
            raise ValueError(f"sweep.targets names source(s) {', '.join(unknown)} that are not in sweep.datasets "
                             f"({', '.join(names)}); the keys of sweep.targets are source datasets")


@dataclass
class SweepConfig:
    sweep: SweepSpec = field(default_factory=SweepSpec, metadata={"help": (
        "The grid: backbones, datasets, methods, shots, seeds and the arguments every run gets.")})
    out: Optional[str] = field(default=None, metadata={"help": (
        "The sweep's folder: one run folder per cell, the report beside them; default runs/sweep.")})
    log_level: str = field(default="info", metadata={"help": 'Log verbosity: "debug", "info", "warning" or "error".'})
    report: bool = field(default=True, metadata={"help": 'Print the report at the end (fewclip report OUT).'})
    lock_timeout_s: Optional[float] = field(default=None, metadata={"help": (
        "Seconds without a heartbeat after which another host's run lock counts as abandoned (null: the "
        'FEWCLIP_LOCK_TIMEOUT_S environment variable, else 600). Locks of this host are judged by their pid.')})
    launcher: LauncherConfig = field(default_factory=LocalConfig, metadata={"help": (
        'Where the runs execute (fewclip.runs.launch): launcher=local (launcher.workers=N processes), ray or slurm.')})
    feature_store: Optional[str] = field(default=None, metadata={"help": (
        'The on-disk feature store shared by runs, workers and sweeps (fewclip.features.store): a folder, or "off"; null: '
        'the FEWCLIP_CACHE environment variable, else ~/.cache/fewclip/features.')})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": (
        "Experiment logging of every run (fewclip.utils.explog): log=tensorboard, log=wandb or log=[tensorboard,wandb]; "
        "one run per cell, TensorBoard's under OUT/tensorboard/<cell>, W&B's grouped by the sweep's name.")})

    def __post_init__(self) -> None:
        if self.lock_timeout_s is not None and not 0 < self.lock_timeout_s < float("inf"):
            raise ValueError(f"lock_timeout_s must be a number of seconds > 0 or null, got {self.lock_timeout_s}")


def compose_sweep_config(args: Sequence[str], launcher_cls: type[LauncherConfig]) -> SweepConfig:
    """A sweep config from the arguments, its ``launcher`` section of ``launcher_cls``. ``sweep.variants`` and
    ``sweep.backbone_args`` are maps whose keys the user chooses (method labels, backbone names), so they accept
    new keys; everything else stays in struct mode."""
    base = OmegaConf.structured(SweepConfig(launcher=launcher_cls()))
    open_maps = [base.sweep.variants, base.sweep.backbone_args, base.sweep.targets]
    open_maps += [base.launcher.sbatch] if "sbatch" in base.launcher else []
    for node in open_maps:
        OmegaConf.set_struct(node, False)  # values keep their type (a list of strings)
    return to_object(compose(SweepConfig, args, base=base))

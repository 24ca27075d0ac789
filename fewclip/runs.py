"""Runs and sweeps: one run directory per (backbone, dataset, method, shots, seed).

A run directory holds ``config.yaml`` (the resolved config), ``split.json``
(the few-shot image ids), ``adapter.safetensors`` (adapter tensors only) and
``metrics.json`` (accuracy and cost: ``fewclip.cost``); an adapter that trains
on nothing (zeroshot) has no split and no tensors. Every file is written
atomically and ``metrics.json`` last,
so a directory with ``metrics.json`` is a finished run. ``fewclip sweep`` skips
finished runs, so an interrupted sweep resumes where it stopped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
from omegaconf import OmegaConf

from fewclip.adapters import AdapterConfig, adapter_info, build_adapter
from fewclip.datasets import build_dataset, make_few_shot_split, write_split

from .backbones import Backbone, load_backbone
from .config import ConfigError, RunConfig, compose, split_args, to_object, to_yaml
from .cost import RunCost
from .engine import RunFeatures, TrainConfig, evaluate, fit_adapter
from .features import FeatureCache
from .io import atomic_write, atomic_write_json
from .zeroshot import test_items

log = logging.getLogger(__name__)


@dataclass
class TrainRunConfig(RunConfig):
    shots: int = 16
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        untrained = adapter_info(self.adapter.name).adapter_cls.trained_by is None
        if untrained and self.shots != 0:
            raise ValueError(f"adapter {self.adapter.name!r} trains on no images: shots must be 0, got {self.shots}")
        if not untrained and self.shots < 1:
            raise ValueError(f"shots must be >= 1, got {self.shots}")


def _adapter_name(args: Sequence[str]) -> str:
    """The adapter named by the arguments (last one wins), default coop."""
    yamls, dotlist = split_args(args)
    name = "coop"
    from .config import find_yaml

    for y in yamls:
        piece = OmegaConf.load(find_yaml(y))
        a = piece.get("adapter", None)
        if isinstance(a, str):
            name = a
        elif a is not None and "name" in a:
            name = a["name"]
    for d in dotlist:
        if d.startswith("adapter.name="):
            name = d.split("=", 1)[1]
    return name


def load_train_config(args: Sequence[str]) -> TrainRunConfig:
    """Compose a train config; the ``adapter`` section takes the named adapter's dataclass."""
    name = _adapter_name(args)
    try:
        info = adapter_info(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    train = TrainConfig(**getattr(info.adapter_cls, "train_defaults", {}))
    shots = 0 if info.adapter_cls.trained_by is None else 16
    base = OmegaConf.structured(TrainRunConfig(adapter=info.config_cls(), train=train, shots=shots))
    return to_object(compose(TrainRunConfig, args, base=base))


def as_train_config(cfg: RunConfig, adapter: AdapterConfig, shots: int = 0) -> TrainRunConfig:
    """A run config of ``cfg``'s backbone, data and seed with ``adapter`` (``fewclip zeroshot``: the zeroshot
    adapter)."""
    common = {f.name: getattr(cfg, f.name) for f in fields(RunConfig)}
    train = TrainConfig(**getattr(adapter_info(adapter.name).adapter_cls, "train_defaults", {}))
    return TrainRunConfig(**common, adapter=adapter, train=train, shots=shots)


# ---------------------------------------------------------------------------
# single runs
# ---------------------------------------------------------------------------


def run_train(cfg: TrainRunConfig, out: Path, *, backbone: Optional[Backbone] = None, dataset=None,
              cache: Optional[FeatureCache] = None, method: Optional[str] = None) -> Dict:
    """Train one adapter on one few-shot split (none for an adapter that trains on nothing) and test it;
    ``method`` labels it in metrics.json. ``cache`` shares frozen-tower features between the runs of a sweep."""
    from safetensors.torch import save_file

    from .io import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    dataset = dataset or build_dataset(cfg.data)
    backbone = backbone or load_backbone(cfg.backbone)
    cost = RunCost(backbone.device)  # from here: the backbone and dataset are shared by a sweep's runs
    split = None
    if adapter_info(cfg.adapter.name).adapter_cls.trained_by is not None:
        split = make_few_shot_split(dataset, cfg.shots, cfg.seed, allow_fewer=cfg.data.allow_fewer_shots)
        write_split(split, out / "split.json")
    generator = torch.Generator().manual_seed(cfg.seed)
    adapter = build_adapter(cfg.adapter, backbone, dataset.classnames, dataset.prompts(cfg.data.templates),
                            generator=generator)
    features = RunFeatures(adapter, dataset, split, cfg.train, seed=cfg.seed, cache=cache, cost=cost,
                           batch_size=cfg.data.batch_size, workers=cfg.data.workers)
    info = fit_adapter(adapter, features, cfg.train, shots=cfg.shots, generator=generator)
    feats, labels = features.test(test_items(dataset, cfg.data.max_test))
    metrics = evaluate(adapter, feats, labels, dataset.classnames, amp=cfg.train.amp)
    sd = adapter.adapter_state_dict()
    if sd:
        meta = {"adapter": cfg.adapter.name, "backbone": backbone.name, "dataset": dataset.name,
                "weights_sha256": backbone.weights_sha256 or ""}
        atomic_write(out / "adapter.safetensors", lambda tmp: save_file(sd, tmp, metadata=meta))
    metrics.update({
        "method": method or cfg.adapter.name,
        "adapter": cfg.adapter.name,
        "dataset": dataset.name,
        "backbone": backbone.name,
        "geometry": backbone.geometry.name,
        "shots": cfg.shots,
        "seed": cfg.seed,
        "templates": list(adapter.templates),
        **info,
        **cost.record(sum(p.numel() for p in adapter.trainable_parameters())),
        "backbone_info": backbone.describe(),
    })
    atomic_write_json(out / "metrics.json", metrics)
    log.info("%s %d-shot seed %d on %s with %s: top1 %.2f%% (%.1f s)", metrics["method"], cfg.shots, cfg.seed,
             dataset.name, backbone.name, metrics["top1"], metrics["wall_time_s"])
    return metrics


# ---------------------------------------------------------------------------
# sweeps
# ---------------------------------------------------------------------------


@dataclass
class SweepSpec:
    backbones: List[str] = field(default_factory=lambda: ["toy-clip"])
    datasets: List[str] = field(default_factory=lambda: ["toy-shapes"])
    # A registered adapter name ("zeroshot", "coop", ...) or a label defined in `variants`.
    methods: List[str] = field(default_factory=lambda: ["zeroshot", "coop"])
    shots: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    # key=value overrides applied to every run (e.g. train.epochs=10, data.max_test=400).
    args: List[str] = field(default_factory=list)
    # Named method variants: label -> key=value list including adapter=NAME, e.g.
    #   coop_n4: [adapter=coop, adapter.n_ctx=4]
    #   zeroshot_single: [adapter=zeroshot, data.templates=single]
    # An adapter that trains on nothing (zeroshot) runs once per backbone and dataset, at 0 shots.
    variants: Dict[str, List[str]] = field(default_factory=dict)
    # key=value overrides per backbone (e.g. for an open_clip backbone's pretrained tag).
    backbone_args: Dict[str, List[str]] = field(default_factory=dict)


@dataclass
class SweepConfig:
    sweep: SweepSpec = field(default_factory=SweepSpec)
    out: Optional[str] = None
    log_level: str = "info"
    # Print the report at the end (fewclip report OUT).
    report: bool = True


def load_sweep_config(args: Sequence[str]) -> SweepConfig:
    """Compose a sweep config. ``sweep.variants`` and ``sweep.backbone_args`` are maps whose keys the user
    chooses (method labels, backbone names), so they accept new keys; everything else stays in struct mode,
    and each run's own arguments are checked by ``run_sweep`` before the first run starts."""
    base = OmegaConf.structured(SweepConfig)
    for node in (base.sweep.variants, base.sweep.backbone_args):
        OmegaConf.set_struct(node, False)  # values keep their type (a list of strings)
    return to_object(compose(SweepConfig, args, base=base))


def _safe(name: str) -> str:
    """A folder name for a backbone: a card path becomes its file stem."""
    import re

    base = Path(name).stem if name.endswith((".yaml", ".yml")) else name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)


def plan_sweep(spec: SweepSpec) -> List[Dict[str, Any]]:
    """Every run of the sweep as {backbone, dataset, method, shots, seed, args, dir}."""
    runs = []
    for bb in spec.backbones:
        for ds in spec.datasets:
            for method in spec.methods:
                base = [f"backbone={bb}", f"data={ds}", *spec.backbone_args.get(bb, []), *spec.args]
                margs = spec.variants.get(method, [f"adapter={method}"])
                try:
                    untrained = adapter_info(_adapter_name(margs)).adapter_cls.trained_by is None
                except ValueError as e:
                    raise ConfigError(f"sweep method {method!r}: {e}") from None
                if untrained:  # nothing to train: one run, at 0 shots
                    runs.append({"backbone": bb, "dataset": ds, "method": method, "shots": 0, "seed": 1,
                                 "args": [*base, *margs, "shots=0"], "dir": Path(_safe(bb)) / ds / method})
                    continue
                for k in spec.shots:
                    for s in spec.seeds:
                        runs.append({"backbone": bb, "dataset": ds, "method": method,
                                     "shots": k, "seed": s,
                                     "args": [*base, *margs, f"shots={k}", f"seed={s}"],
                                     "dir": Path(_safe(bb)) / ds / method / f"{k}shot" / f"seed{s}"})
    return runs


def run_sweep(cfg: SweepConfig, out: Path) -> Dict[str, int]:
    """Run every planned run whose directory has no metrics.json yet; returns counts."""
    from .features import progress
    from .io import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "sweep.yaml", to_yaml(cfg))
    runs = plan_sweep(cfg.sweep)
    # Validate every run's config before the first one starts: a typo fails now, not after an hour.
    parsed = []
    for r in runs:
        try:
            c = load_train_config(r["args"])
        except ConfigError as e:
            raise ConfigError(f"sweep run {r['dir']}: {e}") from None
        c.out = str(out / r["dir"])
        c.log_level = cfg.log_level
        parsed.append(c)
    todo = [(r, c) for r, c in zip(runs, parsed) if not (out / r["dir"] / "metrics.json").is_file()]
    counts = {"planned": len(runs), "done_before": len(runs) - len(todo), "ran": 0, "failed": 0}
    log.info("sweep: %d runs planned, %d already finished, %d to run", len(runs), counts["done_before"], len(todo))
    cache = FeatureCache()
    backbones: Dict[str, Backbone] = {}
    datasets: Dict[str, Any] = {}
    bar = progress(todo, desc="sweep", unit="run")
    for r, c in bar:
        bar.set_postfix_str(f"{r['method']} {r['dataset']} {r['shots']}-shot seed {r['seed']}")
        bkey = to_yaml(c.backbone)
        if bkey not in backbones:
            backbones[bkey] = load_backbone(c.backbone)
        dkey = to_yaml(c.data)
        if dkey not in datasets:
            datasets[dkey] = build_dataset(c.data)
        run_train(c, out / r["dir"], backbone=backbones[bkey], dataset=datasets[dkey], cache=cache,
                  method=r["method"])
        counts["ran"] += 1
    return counts


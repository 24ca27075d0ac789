"""Runs and sweeps: one run directory per (backbone, dataset, method, shots, seed).

A run directory holds ``config.yaml`` (the resolved config), ``split.json``
(the few-shot image ids), ``adapter.safetensors`` (adapter tensors only) and
``metrics.json``; every file is written atomically and ``metrics.json`` last,
so a directory with ``metrics.json`` is a finished run. ``fewclip sweep`` skips
finished runs, so an interrupted sweep resumes where it stopped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from omegaconf import OmegaConf

from fewclip.adapters import AdapterConfig, adapter_info, build_adapter
from fewclip.datasets import build_dataset, make_few_shot_split, write_split

from .backbones import Backbone, load_backbone
from .config import ConfigError, RunConfig, compose, load_config, split_args, to_object, to_yaml
from .engine import TrainConfig, _autocast, evaluate, fit_adapter
from .features import extract_features
from .io import atomic_write, atomic_write_json
from .zeroshot import evaluate_zeroshot, test_items

log = logging.getLogger(__name__)


@dataclass
class TrainRunConfig(RunConfig):
    shots: int = 16
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shots < 1:
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
    base = OmegaConf.structured(TrainRunConfig(adapter=info.config_cls(), train=train))
    return to_object(compose(TrainRunConfig, args, base=base))


# ---------------------------------------------------------------------------
# single runs
# ---------------------------------------------------------------------------


class FeatureCache:
    """Test features per (backbone, dataset, subset) kept in memory across the runs of a sweep."""

    def __init__(self):
        self._store: Dict[Tuple, Tuple[torch.Tensor, torch.Tensor]] = {}

    def test(self, backbone: Backbone, dataset, max_test: Optional[int], seed: int, batch_size: int, workers: int):
        key = (backbone.name, backbone.weights_sha256, backbone.variant, dataset.name, max_test, seed if max_test else None)
        if key not in self._store:
            items = test_items(dataset, max_test, seed)
            self._store[key] = extract_features(backbone, dataset, items, batch_size=batch_size, workers=workers,
                                                desc=f"{dataset.name} test")
        return self._store[key]


def run_zeroshot(cfg: RunConfig, out: Path, *, backbone: Optional[Backbone] = None, dataset=None,
                 cache: Optional[FeatureCache] = None, method: str = "zeroshot") -> Dict:
    from .io import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    dataset = dataset or build_dataset(cfg.data)
    backbone = backbone or load_backbone(cfg.backbone)
    cache = cache or FeatureCache()
    # Zero-shot always uses the full test set (or the configured subset) with subset seed 1 so every
    # method of a sweep is tested on the same images.
    feats = cache.test(backbone, dataset, cfg.data.max_test, 1, cfg.data.batch_size, cfg.data.workers)
    metrics = evaluate_zeroshot(backbone, dataset, templates=cfg.data.templates, seed=cfg.seed, features=feats)
    metrics["method"] = method
    metrics["backbone_info"] = backbone.describe()
    atomic_write_json(out / "metrics.json", metrics)
    return metrics


def run_train(cfg: TrainRunConfig, out: Path, *, backbone: Optional[Backbone] = None, dataset=None,
              cache: Optional[FeatureCache] = None, method: Optional[str] = None) -> Dict:
    """Train one adapter on one few-shot split and test it; ``method`` labels it in metrics.json."""
    from safetensors.torch import save_file

    from .io import atomic_write_text

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    dataset = dataset or build_dataset(cfg.data)
    backbone = backbone or load_backbone(cfg.backbone)
    cache = cache or FeatureCache()
    split = make_few_shot_split(dataset, cfg.shots, cfg.seed, allow_fewer=cfg.data.allow_fewer_shots)
    write_split(split, out / "split.json")
    torch.manual_seed(cfg.seed)
    adapter = build_adapter(cfg.adapter, backbone, dataset.classnames, dataset.prompts(cfg.data.templates))
    info = fit_adapter(adapter, backbone, dataset, split, cfg.train, seed=cfg.seed,
                       batch_size=cfg.data.batch_size, workers=cfg.data.workers)
    if adapter.trains_image_tower:  # test features from the adapted image tower
        with torch.no_grad(), _autocast(backbone.device, cfg.train.amp):
            feats, labels = extract_features(backbone, dataset, test_items(dataset, cfg.data.max_test, 1),
                                             batch_size=cfg.data.batch_size, workers=cfg.data.workers,
                                             desc=f"{dataset.name} test", encode=adapter.encode_images)
    else:
        feats, labels = cache.test(backbone, dataset, cfg.data.max_test, 1, cfg.data.batch_size,
                                   cfg.data.workers)
    metrics = evaluate(adapter, feats, labels, dataset.classnames, amp=cfg.train.amp)
    sd = adapter.adapter_state_dict()
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
        "trainable_parameters": int(sum(v.numel() for v in sd.values())),
        "templates": list(adapter.templates),
        **info,
    })
    atomic_write_json(out / "metrics.json", metrics)
    log.info("%s %d-shot seed %d on %s with %s: top1 %.2f%% (%.1f s)", metrics["method"], cfg.shots, cfg.seed,
             dataset.name, backbone.name, metrics["top1"], info.get("train_time_s", 0.0))
    return metrics


# ---------------------------------------------------------------------------
# sweeps
# ---------------------------------------------------------------------------


@dataclass
class SweepSpec:
    backbones: List[str] = field(default_factory=lambda: ["toy-clip"])
    datasets: List[str] = field(default_factory=lambda: ["toy-shapes"])
    # "zeroshot", a registered adapter name, or a label defined in `variants`.
    methods: List[str] = field(default_factory=lambda: ["zeroshot", "coop"])
    shots: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    # key=value overrides applied to every run (e.g. train.epochs=10, data.max_test=400).
    args: List[str] = field(default_factory=list)
    # Named method variants: label -> key=value list including adapter=NAME, e.g.
    #   coop_n4: [adapter=coop, adapter.n_ctx=4]
    # adapter=zeroshot makes a zero-shot variant: zeroshot_single: [adapter=zeroshot, data.templates=single]
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


def _zeroshot_args(args: Sequence[str]) -> List[str]:
    """``args`` without the keys only training runs have (``train.*``, ``adapter.*``, ``shots``): a sweep's
    shared ``args`` such as ``train.epochs=10`` would not parse as a zero-shot run's config. The training
    runs of the same sweep still check those keys."""
    train_only = {f.name for f in fields(TrainRunConfig)} - {f.name for f in fields(RunConfig)}
    return [a for a in args if a.split("=", 1)[0].split(".", 1)[0] not in train_only]


def plan_sweep(spec: SweepSpec) -> List[Dict[str, Any]]:
    """Every run of the sweep as {backbone, dataset, method, shots, seed, args, dir}."""
    runs = []
    for bb in spec.backbones:
        for ds in spec.datasets:
            for method in spec.methods:
                base = [f"backbone={bb}", f"data={ds}", *spec.backbone_args.get(bb, []), *spec.args]
                margs = spec.variants.get(method, [f"adapter={method}"])
                if method == "zeroshot" and method not in spec.variants:
                    margs = ["adapter=zeroshot"]
                # A zero-shot run: "zeroshot" itself, or a variant that says adapter=zeroshot.
                if "adapter=zeroshot" in margs:
                    zargs = [a for a in margs if a != "adapter=zeroshot"]
                    runs.append({"backbone": bb, "dataset": ds, "method": method, "kind": "zeroshot", "shots": 0,
                                 "seed": 1, "args": _zeroshot_args([*base, *zargs]),
                                 "dir": Path(_safe(bb)) / ds / method})
                    continue
                for k in spec.shots:
                    for s in spec.seeds:
                        runs.append({"backbone": bb, "dataset": ds, "method": method, "kind": "train",
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
            c = load_config(r["args"], RunConfig) if r["kind"] == "zeroshot" else load_train_config(r["args"])
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
        d = out / r["dir"]
        if r["kind"] == "zeroshot":
            run_zeroshot(c, d, backbone=backbones[bkey], dataset=datasets[dkey], cache=cache, method=r["method"])
        else:
            run_train(c, d, backbone=backbones[bkey], dataset=datasets[dkey], cache=cache, method=r["method"])
        counts["ran"] += 1
    return counts


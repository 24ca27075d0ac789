"""One run: one run directory per (protocol, backbone, dataset, method, shots, seed).

A run directory holds ``config.yaml`` (the resolved config), ``split.json``
(the few-shot image ids), ``adapter.safetensors`` (adapter tensors only) and
``metrics.json`` (accuracy and cost: ``fewclip.training.cost``); an adapter that trains
on nothing (zeroshot) has no split and no tensors. Under a generalisation
protocol (``protocol=base2new``, ``cross_dataset``, ``domain_shift``: see
``fewclip.data.protocols``) a run trains on its plan's training dataset
(the base classes, or the source), is scored on every test set of the plan
(``fewclip.training.evals``), keeps ``top1`` on its training classes and adds ``evals``
per test set to ``metrics.json``, and writes the plan with its split as data in
``protocol.json``. Every file is written
atomically and fsynced, and ``metrics.json`` last, with a record of the run's
identity and of its files' checksums (``fewclip.runs.records``): a run is finished
only if that record is valid. ``fewclip sweep`` skips finished runs of the same
identity and reruns those whose config, backbone weights or data changed, so an
interrupted sweep resumes where it stopped; a lock per run directory lets several
sweeps share one out directory. Sweeps are planned by ``fewclip.runs.sweep`` and executed
by ``fewclip.runs.launch``, whose workers call ``run_train`` here.

The zero-shot baseline is a run like any other (the ``zeroshot`` adapter, found through
the registry); ``score_zeroshot`` scores it without a run directory, on the same test
images (``fewclip.data.splits.test_items``) and through the same evaluation.
"""
from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf.errors import OmegaConfBaseException
from safetensors.torch import save_file

from fewclip.adapter.base import AdapterConfig, adapter_info, build_adapter
from fewclip.backbones.backbone import Backbone, BackboneConfig, load_backbone
from fewclip.config.compose import (
    ConfigError,
    RunConfig,
    TrainRunFields,
    compose,
    find_yaml,
    load_yaml,
    section_name_of,
    split_args,
    to_object,
    to_yaml,
    train_base,
)
from fewclip.config.presets import check_test_choice, get_preset, in_effect, method_label, preset_name_of, preset_overrides
from fewclip.data.base import DataConfig, Dataset, build_dataset, dataset_name
from fewclip.data.class_names import class_keys, plan_identical_prompts, warn_records
from fewclip.data.coop_sampler import draw_split
from fewclip.data.protocols import ProtocolPlan, harmonic_mean, make_plan, write_protocol_split
from fewclip.data.split_files import split_from_file
from fewclip.data.splits import TEST_SUBSET_SEED, FewShotSplit, check_val_apart, test_items, write_split
from fewclip.features.encode import FeatureCache, extract_features
from fewclip.runs.records import Identity, Run, RunLock, config_dict, data_part, mark_failed, open_run, run_identity, weights_checksum
from fewclip.training.cost import RunCost
from fewclip.training.engine import RunFeatures, TrainConfig, evaluate, fit_adapter
from fewclip.training.evals import score_plan
from fewclip.training.on_features import backbone_of
from fewclip.training.transductive import rescore_plan
from fewclip.utils.errors import describe
from fewclip.utils.explog import check as check_log
from fewclip.utils.explog import logging_run
from fewclip.utils.heartbeat import step
from fewclip.utils.io import atomic_write, atomic_write_text
from fewclip.utils.threads import record as thread_record
from fewclip.utils.threads import settle as settle_threads
from fewclip.utils.threads import words as thread_words

log = logging.getLogger(__name__)

@dataclass
class TrainRunConfig(TrainRunFields):
    """A training run's config (fields in ``fewclip.config.compose.TrainRunFields``), checked against its method."""

    def __post_init__(self) -> None:
        super().__post_init__()
        untrained = not adapter_info(self.adapter.name).trains
        if untrained and self.shots != 0:
            raise ValueError(f"adapter {self.adapter.name!r} trains on no images: shots must be 0, got {self.shots}")
        if not untrained and self.shots < 1:
            raise ValueError(f"shots must be >= 1, got {self.shots}")
        get_preset(self.adapter.name, self.preset)  # a known name (load_train_config applies its values)


def adapter_name_of(args: Sequence[str]) -> str:
    """The adapter named by the arguments (last one wins), default coop."""
    return section_name_of(args, "adapter", "coop")


def load_train_config(args: Sequence[str]) -> TrainRunConfig:
    """Compose a train config; the ``adapter`` section takes the named adapter's dataclass. A ``preset`` is
    applied on top of the method's defaults and under the arguments (explicit values win over it)."""
    name = adapter_name_of(args)
    try:
        info = adapter_info(name)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    yamls, dotlist = split_args(args)
    preset = get_preset(name, preset_name_of(dotlist, [load_yaml(find_yaml(y)) for y in yamls]))
    try:
        base = train_base(TrainRunConfig, info.config_cls(), info.adapter_cls.train_defaults,
                          info.trains, preset_overrides(preset))
    except OmegaConfBaseException as e:
        raise ConfigError(f"preset {preset.name!r} of adapter {name!r} does not fit its config ({e}); fix the "
                          f"preset's register_presets line") from None
    composed = compose(TrainRunConfig, args, base=base)
    check_test_choice(name, composed.train.select)
    cfg = to_object(composed)
    cfg.preset_set = in_effect(preset, {key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
                                        for key in preset.values()})
    return cfg


def preset_defaults(info) -> dict[str, Any]:
    """fewclip's default of every ``adapter.*`` and ``train.*`` field of a method (``info``: its AdapterInfo):
    what its presets are compared with."""
    adapter, train = info.config_cls(), TrainConfig(**info.adapter_cls.train_defaults)
    return {**{f"adapter.{f.name}": getattr(adapter, f.name) for f in fields(adapter)},
            **{f"train.{f.name}": getattr(train, f.name) for f in fields(train)}}


def as_train_config(cfg: RunConfig, adapter: AdapterConfig, shots: int = 0) -> TrainRunConfig:
    """A run config of ``cfg``'s backbone, data and seed with ``adapter`` (``fewclip zeroshot``: the zeroshot
    adapter)."""
    common = {f.name: getattr(cfg, f.name) for f in fields(RunConfig)}
    train = TrainConfig(**adapter_info(adapter.name).adapter_cls.train_defaults)
    return TrainRunConfig(**common, adapter=adapter, train=train, shots=shots)


def target_data(data: DataConfig, name: str) -> DataConfig:
    """The data section of a protocol's target dataset ``name``: the run's, renamed, without the source's split
    file, reader and prompts (CoOp's layouts keep every dataset under one ``data.root``)."""
    return dataclasses.replace(data, name=name, split_file=None, reader=None, prompts=[])


def build_plan(cfg: RunConfig, dataset: Optional[Dataset] = None) -> ProtocolPlan:
    """The run's protocol plan: ``dataset`` (default: built from ``cfg.data``) as the source, and the datasets of
    ``cfg.targets``."""
    source = dataset if dataset is not None else build_dataset(cfg.data)
    return make_plan(cfg.protocol, source, [build_dataset(target_data(cfg.data, t)) for t in cfg.targets])


class RunResources:
    """Backbones, datasets and protocol plans, each built once per config and shared by the runs of a sweep:
    ``resources(cfg) -> (backbone, plan)``. Features are cached per dataset object (``FeatureCache``), so runs
    share features only if they share the dataset objects: a plan's class views are built once, and a dataset
    that is a source in one plan and a target in another is one object."""

    def __init__(self):
        self._backbones: dict[str, Backbone] = {}
        self._datasets: dict[str, Dataset] = {}
        self._plans: dict[tuple, ProtocolPlan] = {}

    def backbone(self, cfg: BackboneConfig) -> Backbone:
        key = to_yaml(cfg)
        if key not in self._backbones:
            self._backbones[key] = load_backbone(cfg)
        return self._backbones[key]

    # DataConfig fields that say how a dataset is used, not what build_dataset returns: runs that differ only in
    # them share one dataset object (and so its rendered images and cached features).
    USE_ONLY = ("templates", "allow_fewer_shots", "batch_size", "workers", "max_test", "fewshot_file", "sampler")

    def dataset(self, cfg: DataConfig) -> Dataset:
        key = to_yaml(dataclasses.replace(cfg, **{f: getattr(DataConfig(), f) for f in self.USE_ONLY}))
        if key not in self._datasets:
            self._datasets[key] = build_dataset(cfg)
        return self._datasets[key]

    def plan(self, cfg: RunConfig) -> ProtocolPlan:
        key = (id(self.dataset(cfg.data)), cfg.protocol, tuple(cfg.targets))  # targets: built from cfg.data
        if key not in self._plans:
            self._plans[key] = make_plan(cfg.protocol, self.dataset(cfg.data),
                                         [self.dataset(target_data(cfg.data, t)) for t in cfg.targets])
        return self._plans[key]

    def __call__(self, cfg: RunConfig) -> tuple[Backbone, ProtocolPlan]:
        plan = self.plan(cfg)
        return backbone_of(plan.source, cfg, self.backbone), plan  # a feature file brings its own


def few_shot_split(cfg: TrainRunConfig, plan: ProtocolPlan) -> Optional[FewShotSplit]:
    """The run's few-shot split, drawn from the plan's training dataset or read from ``data.fewshot_file``; None
    for an adapter that trains on nothing."""
    if not adapter_info(cfg.adapter.name).trains:
        return None
    if cfg.data.fewshot_file:
        return check_val_apart(split_from_file(cfg.data.fewshot_file, plan.source, plan.train, shots=cfg.shots,
                                               seed=cfg.seed, allow_fewer=cfg.data.allow_fewer_shots))
    return draw_split(plan.train, cfg.shots, cfg.seed, allow_fewer=cfg.data.allow_fewer_shots,
                      sampler=cfg.data.sampler)


def shots_per_class(split: FewShotSplit, classnames: Sequence[str]) -> dict[str, int]:
    """The training images each class got in ``split`` (fewer than the shots asked where a class has fewer and
    ``data.allow_fewer_shots`` is set)."""
    keys = class_keys(classnames)  # a repeated name gets its label: no class is merged
    counts = {c: 0 for c in keys}
    for it in split.train:
        counts[keys[it.label]] += 1
    return counts


def run_identity_of(cfg: RunConfig, backbone: Backbone, plan, split=None) -> Identity:
    """The run's identity (``fewclip.runs.records``): its config, the backbone's weights checksum, and the class
    names, templates, few-shot split and test images it uses; under a protocol other than fewshot also each
    test set's dataset, class names, templates, class map and test images. ``plan`` is the run's
    ``ProtocolPlan`` (a ``Dataset`` is taken as the source of ``build_plan``).

    The ``train`` section (and ``data.fewshot_file``) of an adapter that trains on nothing (zeroshot) is no part of
    it: a sweep's ``train.*`` arguments do not change its numbers. (Nor are ``protocol`` and ``targets`` at their
    defaults: ``records.LATER_KEY_DEFAULTS``.)"""
    if not isinstance(plan, ProtocolPlan):
        plan = build_plan(cfg, plan)
    conf = config_dict(cfg)
    if not adapter_info(conf["adapter"]["name"]).trains:
        conf.pop("train", None)
        conf.get("data", {}).pop("fewshot_file", None)  # it trains on no images: no split file either
        conf.get("data", {}).pop("sampler", None)  # nor a draw
    mode, max_test = cfg.data.templates, cfg.data.max_test
    evals = None
    if plan.protocol != "fewshot":
        evals = [{"name": e.name, "dataset": e.dataset.name, "classnames": list(e.dataset.classnames),
                  "templates": e.dataset.prompts(mode), "class_map": e.class_map,
                  "test": test_items(e.dataset, max_test)} for e in plan.evals]
    train = plan.train
    data = data_part(dataset=train.name, classnames=train.classnames, templates=train.prompts(mode),
                     test=test_items(train, max_test), split=split.to_json() if split else None, evals=evals)
    return run_identity(conf, weights_checksum(backbone), data)


def _load_backbone(cfg: BackboneConfig) -> Backbone:
    with step(f"loading the backbone {cfg.name}", logger=log):
        return load_backbone(cfg)


def _skipped_images(plan: ProtocolPlan) -> dict[str, Any]:
    """``{"skipped_images": {dataset: [ids]}}`` for the datasets that left out unreadable files, else {}."""
    seen = {}
    for d in (plan.source, plan.train, *(e.dataset for e in plan.evals)):
        ids = getattr(d, "skipped_images", None)
        if ids:
            seen[d.name] = list(ids)
    return {"skipped_images": seen} if seen else {}


def run_train(cfg: TrainRunConfig, out: Path, *, backbone: Optional[Backbone] = None, dataset=None,
              plan: Optional[ProtocolPlan] = None, cache: Optional[FeatureCache] = None, method: Optional[str] = None,
              lock: Optional[RunLock] = None, overwrite: Optional[bool] = None, report_prompts: bool = True) -> dict:
    """Train one adapter on one few-shot split (none for an adapter that trains on nothing) of the protocol
    plan's training dataset and score it on every test set of the plan; ``method`` labels it in metrics.json.
    ``plan`` (or ``dataset``, its source) and ``backbone`` are built from ``cfg`` when not given; ``cache``
    shares frozen-tower features between the runs of a sweep. An existing run in ``out`` is handled by
    ``records.open_run``; ``lock``: the directory's lock, already held by the caller. ``cfg.log``: where the run
    is also logged (``fewclip.utils.explog``). Classes with identical prompts are a warning before the run
    (``report_prompts``; a sweep warns once for all its runs and passes False) and ``identical_prompts`` in
    metrics.json."""
    check_log(cfg.log)  # a missing logging library fails before any work, and before any line
    settle_threads(setting=cfg.threads)  # a sweep's worker has chosen already; a lone run chooses here
    log.info("run %s: %s", out, thread_words())
    with step(f"run {out}", announce=False, logger=log):  # the heartbeat covers every phase of the run
        return _run_train(cfg, out, backbone=backbone, dataset=dataset, plan=plan, cache=cache, method=method,
                          lock=lock, overwrite=overwrite, report_prompts=report_prompts)


def _run_train(cfg: TrainRunConfig, out: Path, *, backbone, dataset, plan, cache, method, lock, overwrite,
               report_prompts) -> dict:
    check_log(cfg.log)  # a missing logging library fails before any work
    if plan is None:
        log.info("reading the dataset %s (%s protocol)", dataset_name(cfg.data), cfg.protocol)
        plan = build_plan(cfg, dataset)
    if backbone is None:
        backbone = backbone_of(plan.source, cfg, _load_backbone)  # a feature file brings its own
    split = few_shot_split(cfg, plan)
    same_prompts = plan_identical_prompts(backbone, plan, cfg.data.templates)
    if report_prompts:
        warn_records(same_prompts, backbone=backbone.name)
    elif same_prompts:
        log.info("identical prompts (reported by the sweep): %s", same_prompts)
    identity = run_identity_of(cfg, backbone, plan, split)
    with open_run(out, identity, overwrite=cfg.overwrite if overwrite is None else overwrite, lock=lock) as run:
        if run.done:
            log.info("%s: already finished with this config; overwrite=true runs it again", out)
            return run.metrics
        try:
            with logging_run(cfg.log, out, config_dict(cfg), to_yaml(cfg)) as xlog:
                metrics = _train(run, cfg, out, backbone, plan, cache, split, method, same_prompts)
                xlog.final(metrics)
        except BaseException as e:  # Ctrl-C too: no half-written run is left behind
            message, _ = describe(e) if isinstance(e, Exception) else ("interrupted", 130)
            try:
                where = mark_failed(out, e, message)
                log.info("%s: the run failed; its results are removed, %s says why", out, where.name)
            except OSError as marking:  # the run's own error is the one to report
                log.warning("%s: the failed run could not be marked failed: %s", out, marking)
            raise
        return metrics


def _train(run: Run, cfg: TrainRunConfig, out: Path, backbone: Backbone, plan: ProtocolPlan,
           cache: Optional[FeatureCache], split, method: Optional[str], same_prompts=()) -> dict:
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    cost = RunCost(backbone.device)  # from here: the backbone and datasets are shared by a sweep's runs
    files = ["config.yaml"]
    if split is not None:
        write_split(split, out / "split.json")
        files.append("split.json")
    if plan.protocol != "fewshot":
        write_protocol_split(plan, split, out / "protocol.json", max_test=cfg.data.max_test,
                             test_seed=TEST_SUBSET_SEED)
        files.append("protocol.json")
    dataset = plan.train
    prompts = dataset.prompts(cfg.data.templates)
    log.info("%s: %d prompt template(s) (data.templates=%s): %s", dataset.name, len(prompts), cfg.data.templates,
             " | ".join(prompts))
    shots_got = shots_per_class(split, dataset.classnames) if split is not None else None
    if shots_got and min(shots_got.values()) < cfg.shots:
        short = {c: n for c, n in shots_got.items() if n < cfg.shots}
        log.warning("%s: %d class(es) have fewer than shots=%d training images and use all they have "
                    "(data.allow_fewer_shots): %s", dataset.name, len(short), cfg.shots,
                    ", ".join(f"{c} ({n})" for c, n in list(short.items())[:5]) + (" ..." if len(short) > 5 else ""))
    generator = torch.Generator().manual_seed(cfg.seed)
    adapter = build_adapter(cfg.adapter, backbone, dataset.classnames, prompts, generator=generator)
    features = RunFeatures(adapter, dataset, split, cfg.train, seed=cfg.seed, cache=cache, cost=cost,
                           batch_size=cfg.data.batch_size, workers=cfg.data.workers)
    info = fit_adapter(adapter, features, cfg.train, shots=cfg.shots, generator=generator)
    evals = score_plan(adapter, plan, templates=cfg.data.templates, max_test=cfg.data.max_test, train_cfg=cfg.train,
                       seed=cfg.seed, cache=features.cache, cost=cost, batch_size=cfg.data.batch_size,
                       workers=cfg.data.workers, amp=cfg.train.amp)
    extra = rescore_plan(cfg.transductive, adapter, plan, evals, templates=cfg.data.templates,
                         max_test=cfg.data.max_test, train_cfg=cfg.train, seed=cfg.seed, cache=features.cache,
                         cost=cost, batch_size=cfg.data.batch_size, workers=cfg.data.workers, amp=cfg.train.amp)
    own = evals[plan.evals[0].name]  # the training classes: "all", "base" or "source"
    metrics = {k: own[k] for k in ("top1", "per_class", "n_test")}
    metrics.update({k: own[k] for k in ("mean_per_class", "n_test_per_class") if own.get(k) is not None})
    if extra:  # the plug-in's accuracy beside the method's own, and what it was
        metrics[f"top1_{cfg.transductive}"] = own[f"top1_{cfg.transductive}"]
        if own.get(f"mean_per_class_{cfg.transductive}") is not None:
            metrics[f"mean_per_class_{cfg.transductive}"] = own[f"mean_per_class_{cfg.transductive}"]
        metrics.update(extra)
    if plan.protocol != "fewshot":
        metrics["evals"] = evals
        if plan.protocol == "base2new" and None not in (evals["base"]["top1"], evals["new"]["top1"]):
            metrics["hm"] = round(harmonic_mean(evals["base"]["top1"], evals["new"]["top1"]), 4)
    sd = adapter.adapter_state_dict()
    if sd:
        meta = {"adapter": cfg.adapter.name, "backbone": backbone.name, "dataset": dataset.name,
                "weights_sha256": backbone.weights_sha256 or ""}
        atomic_write(out / "adapter.safetensors", lambda tmp: save_file(sd, tmp, metadata=meta))
        files.append("adapter.safetensors")
    metrics.update({
        "method": method or (method_label(cfg.adapter.name, cfg.preset) if split is not None else cfg.adapter.name),
        "adapter": cfg.adapter.name,
        "preset": cfg.preset,
        "protocol": plan.protocol,
        "dataset": plan.source.name,
        "backbone": backbone.name,
        "geometry": backbone.geometry.name,
        "shots": cfg.shots,
        **({"shots_per_class": shots_got} if shots_got is not None else {}),
        **({"split_file": split.source} if split is not None and split.source else {}),
        "seed": cfg.seed,
        "templates": list(adapter.templates),
        "templates_mode": cfg.data.templates,
        "identical_prompts": list(same_prompts),  # classes sharing a prompt (fewclip.data.class_names), per dataset
        **info,
        **cost.record(sum(p.numel() for p in adapter.trainable_parameters())),
        **thread_record(),
        **_skipped_images(plan),
        "backbone_info": backbone.describe(),
    })
    run.finish(metrics, files=files, tensors=sd)
    fewer = (f", fewest {min(shots_got.values())} per class" if shots_got and min(shots_got.values()) < cfg.shots
             else "")
    log.info("%s %d-shot%s seed %d on %s with %s (%s): top1 %.2f%% (%.1f s)", metrics["method"], cfg.shots, fewer,
             cfg.seed, dataset.name, backbone.name, plan.protocol, metrics["top1"], metrics["wall_time_s"])
    return metrics


def score_zeroshot(backbone: Backbone, dataset: Dataset, *, templates: str = "single", batch_size: int = 256,
                   workers: int = 0, max_test: Optional[int] = None) -> dict:
    """Zero-shot top-1 without a run directory: the registered ``zeroshot`` adapter scored on the test images
    every run is scored on (``test_items``), by the engine's ``evaluate``, as in ``run_train``."""
    info = adapter_info("zeroshot")
    prompts = dataset.prompts(templates)
    adapter = build_adapter(info.config_cls(), backbone, dataset.classnames, prompts)
    feats, labels = extract_features(backbone, dataset, test_items(dataset, max_test), batch_size=batch_size,
                                     workers=workers, desc=f"{dataset.name} test")
    metrics = evaluate(adapter, feats, labels, dataset.classnames)
    metrics.update({"method": "zeroshot", "dataset": dataset.name, "backbone": backbone.name, "shots": 0,
                    "templates": prompts, "geometry": backbone.geometry.name})
    log.info("zero-shot %s on %s: top1 %.2f%% (%d test images)", backbone.name, dataset.name, metrics["top1"],
             metrics["n_test"])
    return metrics

"""Sweeps: methods x backbones x datasets x shots x seeds (x protocols), planned here and executed by a
launcher (``fewclip.launch``), each run by ``fewclip.run.run_train``.

``plan_sweep`` expands a ``SweepSpec`` into run arguments; ``run_sweep`` computes every run's identity,
skips the finished ones (``fewclip.records``), hands the rest to the configured launcher, and writes the
report. A sweep holds a lock on its out directory while it plans, so two sweeps on one out directory do
each run once.
"""
from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from omegaconf import OmegaConf

from .adapter import adapter_info
from .config import ConfigError, compose, section_name_of, to_object, to_yaml
from .dataset_entries import sweep_datasets
from .errors import FewclipError
from .explog import LogConfig, check as check_log
from .io import atomic_write_text
from .launch import LAUNCHERS, LauncherConfig, LocalConfig, check_launcher, launch
from .launch.worker import RunSpec, WorkerContext
from .locks import RunLock
from .progress import progress
from .protocols import PROTOCOLS, TRANSFER_PROTOCOLS
from .records import Identity, RunState, prepare_dir, remove_leftovers, run_state, tidy
from .run import adapter_name_of, few_shot_split, load_train_config, run_identity_of
from .store import store_setting

log = logging.getLogger(__name__)

SWEEP_LOCK_FILE = ".fewclip.sweep.lock"


@dataclass
class SweepSpec:
    backbones: List[str] = field(default_factory=lambda: ["toy-clip"])
    datasets: List[Any] = field(default_factory=lambda: ["toy-shapes"], metadata={"help": (
        "Each a registered dataset's name, a mapping of data keys ({name: folder, root: /data/pets}, named \"pets\" "
        "after its folder; {name: cars, reader: folder, root: PATH, templates: single}) or a YAML piece with a "
        "`data:` section (fewclip.dataset_entries). Runs, tables and folders know each by its dataset's name.")})
    methods: List[str] = field(default_factory=lambda: ["zeroshot", "coop"], metadata={"help": (
        'A registered adapter name ("zeroshot", "coop", ...) or a label defined in `variants`.')})
    shots: List[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    seeds: List[int] = field(default_factory=lambda: [1, 2, 3])
    args: List[str] = field(default_factory=list, metadata={"help": (
        'key=value overrides applied to every run (e.g. train.epochs=10, data.max_test=400).')})
    variants: Dict[str, List[str]] = field(default_factory=dict, metadata={"help": (
        'Named method variants: label -> key=value list including adapter=NAME, e.g. coop_n4: [adapter=coop, '
        'adapter.n_ctx=4] zeroshot_single: [adapter=zeroshot, data.templates=single] An adapter that trains on '
        'nothing (zeroshot) runs once per backbone and dataset, at 0 shots.')})
    backbone_args: Dict[str, List[str]] = field(default_factory=dict, metadata={"help": (
        "key=value overrides per backbone (e.g. for an open_clip backbone's pretrained tag).")})
    protocol: str = field(default="fewshot", metadata={"help": (
        'The generalisation protocol of every run (fewclip.protocols): fewshot, base2new (`datasets` are split '
        'into base and new classes), cross_dataset or domain_shift (`datasets` are the sources). Runs of a '
        'protocol other than fewshot go under OUT/<protocol>/, so one out directory can hold several protocols.')})
    targets: Dict[str, List[str]] = field(default_factory=dict, metadata={"help": (
        'cross_dataset / domain_shift: the targets of each source ({toy-shapes: [toy-sketch, toy-shapes-faded]});'
        " a source left out gets the protocol's default targets (fewclip.protocols.default_targets).")})

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"sweep.protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if self.targets and self.protocol not in TRANSFER_PROTOCOLS:
            raise ValueError(f"sweep.targets apply to protocol cross_dataset or domain_shift only, not "
                             f"{self.protocol!r}; remove them")
        names = [d.name for d in sweep_datasets(self.datasets, self.args)]
        unknown = sorted(set(self.targets) - set(names))
        if unknown:
            raise ValueError(f"sweep.targets names source(s) {', '.join(unknown)} that are not in sweep.datasets "
                             f"({', '.join(names)}); the keys of sweep.targets are source datasets")


@dataclass
class SweepConfig:
    sweep: SweepSpec = field(default_factory=SweepSpec)
    out: Optional[str] = None
    log_level: str = "info"
    report: bool = field(default=True, metadata={"help": 'Print the report at the end (fewclip report OUT).'})
    lock_timeout_s: Optional[float] = field(default=None, metadata={"help": (
        "Seconds without a heartbeat after which another host's run lock counts as abandoned (null: the "
        'FEWCLIP_LOCK_TIMEOUT_S environment variable, else 600). Locks of this host are judged by their pid.')})
    launcher: LauncherConfig = field(default_factory=LocalConfig, metadata={"help": (
        'Where the runs execute (fewclip.launch): launcher=local (launcher.workers=N processes), ray or slurm.')})
    feature_store: Optional[str] = field(default=None, metadata={"help": (
        'The on-disk feature store shared by runs, workers and sweeps (fewclip.store): a folder, or "off"; null: '
        'the FEWCLIP_CACHE environment variable, else ~/.cache/fewclip/features.')})
    log: LogConfig = field(default_factory=LogConfig, metadata={"help": (
        "Experiment logging of every run (fewclip.explog): log=tensorboard, log=wandb or log=[tensorboard,wandb]; "
        "one run per cell, TensorBoard's under OUT/tensorboard/<cell>, W&B's grouped by the sweep's name.")})

    def __post_init__(self) -> None:
        if self.lock_timeout_s is not None and not 0 < self.lock_timeout_s < float("inf"):
            raise ValueError(f"lock_timeout_s must be a number of seconds > 0 or null, got {self.lock_timeout_s}")


def load_sweep_config(args: Sequence[str]) -> SweepConfig:
    """Compose a sweep config. ``sweep.variants`` and ``sweep.backbone_args`` are maps whose keys the user
    chooses (method labels, backbone names), so they accept new keys; everything else stays in struct mode,
    and each run's own arguments are checked by ``run_sweep`` before the first run starts."""
    name = section_name_of(args, "launcher", "local")
    if name not in LAUNCHERS:
        raise ConfigError(LAUNCHERS.unknown(name))
    base = OmegaConf.structured(SweepConfig(launcher=LAUNCHERS.get(name).config_cls()))
    open_maps = [base.sweep.variants, base.sweep.backbone_args, base.sweep.targets]
    open_maps += [base.launcher.sbatch] if "sbatch" in base.launcher else []
    for node in open_maps:
        OmegaConf.set_struct(node, False)  # values keep their type (a list of strings)
    return to_object(compose(SweepConfig, args, base=base))


def _safe(name: str) -> str:
    """A folder name for a backbone: a card path becomes its file stem."""
    base = Path(name).stem if name.endswith((".yaml", ".yml")) else name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)


def plan_sweep(spec: SweepSpec) -> List[Dict[str, Any]]:
    """Every run of the sweep as {protocol, backbone, dataset, method, shots, seed, args, dir}. A few-shot run's
    dir is ``<backbone>/<dataset>/<method>/<k>shot/seed<s>``; another protocol's is the same under
    ``<protocol>/``."""
    runs = []
    protocol = spec.protocol
    root = Path() if protocol == "fewshot" else Path(protocol)
    datasets = sweep_datasets(spec.datasets, spec.args)
    for bb in spec.backbones:
        for entry in datasets:
            ds = entry.name
            proto = [] if protocol == "fewshot" else [f"protocol={protocol}"]
            if ds in spec.targets:
                proto.append(f"targets=[{','.join(spec.targets[ds])}]")
            # A registered name goes first, as data=NAME; an entry's own data keys after the sweep's args (they win)
            named, own = (entry.args, ()) if entry.args[0].startswith("data=") else ((), entry.args)
            for method in spec.methods:
                base = [f"backbone={bb}", *named, *proto, *spec.backbone_args.get(bb, []), *spec.args, *own]
                margs = spec.variants.get(method, [f"adapter={method}"])
                try:
                    untrained = not adapter_info(adapter_name_of(margs)).trains
                except ValueError as e:
                    raise ConfigError(f"sweep method {method!r}: {e}") from None
                if untrained:  # nothing to train: one run, at 0 shots
                    runs.append({"protocol": protocol, "backbone": bb, "dataset": ds, "method": method, "shots": 0,
                                 "seed": 1, "args": [*base, *margs, "shots=0"],
                                 "dir": root / _safe(bb) / ds / method})
                    continue
                for k in spec.shots:
                    for s in spec.seeds:
                        runs.append({"protocol": protocol, "backbone": bb, "dataset": ds, "method": method,
                                     "shots": k, "seed": s,
                                     "args": [*base, *margs, f"shots={k}", f"seed={s}"],
                                     "dir": root / _safe(bb) / ds / method / f"{k}shot" / f"seed{s}"})
    return runs


@dataclass
class _Planned:
    """One run of a sweep with its parsed config, identity and what its directory held when planned."""

    run: Dict[str, Any]
    cfg: Any
    identity: Identity
    state: RunState


def run_sweep(cfg: SweepConfig, out: Path, poll_s: float = 1.0) -> Dict[str, Any]:
    """Run every planned run that is not finished with its current identity; returns counts (and
    ``failures``: the ``fewclip.launch.worker.RunResult`` of each failed run).

    Finished runs whose identity changed (config, backbone weights, data) run again and the log says
    how many and why. The runs execute where ``cfg.launcher`` says (``fewclip.launch``); each is claimed
    with its directory's lock, so any number of sweeps or workers can share ``out``: a run held by another
    live process is left to it and checked again later (``poll_s`` seconds between checks); one whose
    holder is gone is taken over. A failed run does not stop the others; the next sweep runs it again.
    """
    check_launcher(cfg.launcher)  # a missing optional dependency fails now, not after the planning
    check_log(cfg.log)
    out = prepare_dir(out)
    with sweep_lock(out, cfg.lock_timeout_s):  # the sweep's own files: one writer at a time
        remove_leftovers(out)
        atomic_write_text(out / "sweep.yaml", to_yaml(cfg))
    runs = plan_sweep(cfg.sweep)
    log.info("sweep: %d runs in the plan; checking their configs, then loading their backbones and datasets",
             len(runs))
    # Validate every run's config before the first one starts: a typo fails now, not after an hour.
    parsed = []
    for r in runs:
        try:
            c = load_train_config(r["args"])
        except ConfigError as e:
            raise ConfigError(f"sweep run {r['dir']}: {e}") from None
        c.out = str(out / r["dir"])
        c.log_level = cfg.log_level
        check_log(c.log)  # log=... in sweep.args
        parsed.append(c)
    # Load what the runs need and work out each run's identity: a finished run counts only if it is this one.
    context = WorkerContext(store_setting(cfg.feature_store))  # also the in-process launcher's
    resources = context.resources

    plans = []
    for r, c in progress(list(zip(runs, parsed)), desc="sweep: planning", unit="run", leave=False):
        try:
            bb, plan = resources(c)
            identity = run_identity_of(c, bb, plan, few_shot_split(c, plan))
        except FewclipError as e:
            raise _in_run(e, r) from e
        plans.append(_Planned(r, c, identity, run_state(out / r["dir"], identity)))
    for p in plans:
        if p.state.finished:  # a lock or temporary file left by a process killed after it finished the run
            tidy(out / p.run["dir"], stale_after_s=cfg.lock_timeout_s)
    todo = [p for p in plans if not p.state.finished]
    counts = {"planned": len(runs), "done_before": len(runs) - len(todo), "ran": 0, "rerun": 0, "by_others": 0,
              "failed": 0, "replaced": 0}
    log.info("sweep: %d runs planned, %d already finished, %d to run", len(runs), counts["done_before"], len(todo))
    reasons: Dict[str, int] = {}
    for p in todo:
        if p.state.holds_results:
            reasons[p.state.reason] = reasons.get(p.state.reason, 0) + 1
    for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1]):
        log.warning("sweep: %d finished run(s) do not match this sweep and run again: %s", n, reason)

    specs = [_spec(p, out, cfg, context.store_root) for p in todo]
    outcome = launch(cfg.launcher, specs, out=out, context=context, poll_s=poll_s)
    if outcome.dry_run:
        return {**counts, "dry_run": True}
    counts.update(outcome.counts)
    counts["failures"] = outcome.failures
    # A concurrent sweep with other settings may have replaced runs since: say so rather than report them silently.
    failed = {r.spec.dir for r in outcome.failures}
    replaced = [p for p in plans if str(p.run["dir"]) not in failed and not run_state(out / p.run["dir"],
                                                                                     p.identity).finished]
    counts["replaced"] = len(replaced)
    if replaced:
        log.warning("sweep: %d run(s) in %s now hold results of another config (another sweep with other settings "
                    "shares this out directory), e.g. %s: %s", len(replaced), out, replaced[0].run["dir"],
                    run_state(out / replaced[0].run["dir"], replaced[0].identity).reason)
    return counts


def _spec(p: _Planned, out: Path, cfg: SweepConfig, store: Optional[str]):
    """A planned run as the launchers hand it to the run function (``fewclip.launch.worker.execute_run``)."""
    r = p.run
    trains = adapter_info(p.cfg.adapter.name).adapter_cls.will_train_image_tower(p.cfg.adapter)
    return RunSpec(out=str(Path(out).resolve()), dir=str(r["dir"]), args=tuple(r["args"]), identity=p.identity,
                   method=r["method"], backbone=r["backbone"], dataset=r["dataset"], shots=int(r["shots"]),
                   seed=int(r["seed"]), log_level=cfg.log_level, lock_timeout_s=cfg.lock_timeout_s, store=store,
                   trains_image_tower=bool(trains), log=cfg.log)


def _in_run(e: Exception, r: Dict[str, Any]) -> Exception:
    """The same error with the run named in its message."""
    try:
        return type(e)(f"sweep run {r['dir']}: {e}")
    except Exception:
        return e


@contextmanager
def sweep_lock(out: Path, stale_after_s: Optional[float] = None):
    """Hold the sweep-level lock of ``out`` (its sweep.yaml and report files), waiting for it."""
    lock = RunLock(out, stale_after_s=stale_after_s, name=SWEEP_LOCK_FILE)
    lock.acquire()
    try:
        yield lock
    finally:
        lock.release()

"""Sweeps: methods x backbones x datasets x shots x seeds (x protocols), planned here and executed by a
launcher (``fewclip.runs.launch``), each run by ``fewclip.runs.run.run_train``.

``plan_sweep`` expands a ``SweepSpec`` into run arguments; ``run_sweep`` computes every run's identity,
skips the finished ones (``fewclip.runs.records``), hands the rest to the configured launcher, and writes the
report. A sweep holds a lock on its out directory while it plans, so two sweeps on one out directory do
each run once.
"""
from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from fewclip.adapter.base import adapter_info
from fewclip.config.compose import ConfigError, section_name_of, to_yaml
from fewclip.config.dataset_entries import sweep_datasets
from fewclip.config.presets import FEWCLIP, method_label, parse_label, preset_name_of
from fewclip.config.sweep import SweepConfig, SweepSpec, compose_sweep_config  # noqa: F401  (re-exported)
from fewclip.data.base import DatasetError
from fewclip.data.class_names import plan_identical_prompts, warn_records
from fewclip.data.image_check import SWEEP_CHECK_MAX, describe_bad, find_bad_images, n_images
from fewclip.features.store import store_setting
from fewclip.runs.launch import LAUNCHERS, check_launcher, launch
from fewclip.runs.launch.worker import RunSpec, WorkerContext
from fewclip.runs.plan import new_plan, plan_folder, record_failures, write_plan
from fewclip.runs.records import Identity, RunState, prepare_dir, remove_leftovers, run_state, tidy
from fewclip.runs.run import adapter_name_of, few_shot_split, load_train_config, run_identity_of
from fewclip.utils.errors import FewclipError
from fewclip.utils.explog import check as check_log
from fewclip.utils.io import atomic_write_text
from fewclip.utils.locks import RunLock
from fewclip.utils.progress import progress

log = logging.getLogger(__name__)

SWEEP_LOCK_FILE = ".fewclip.sweep.lock"


def load_sweep_config(args: Sequence[str]) -> SweepConfig:
    """Compose a sweep config (``fewclip.config.sweep``) with the launcher's section the arguments name; each
    run's own arguments are checked by ``run_sweep`` before the first run starts."""
    name = section_name_of(args, "launcher", "local")
    if name not in LAUNCHERS:
        raise ConfigError(LAUNCHERS.unknown(name))
    return compose_sweep_config(args, LAUNCHERS.get(name).config_cls)


def _safe(name: str) -> str:
    """A folder name for a backbone: a card path becomes its file stem."""
    base = Path(name).stem if name.endswith((".yaml", ".yml")) else name
    return re.sub(r"[^A-Za-z0-9._-]", "_", base)


def plan_sweep(spec: SweepSpec) -> list[dict[str, Any]]:
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
                margs, label = _method_args(spec, method, base)
                try:
                    untrained = not adapter_info(adapter_name_of(margs)).trains
                except ValueError as e:
                    raise ConfigError(f"sweep method {method!r}: {e}") from None
                label = method if untrained else label  # zero-shot stays the report's baseline under any preset
                method_dir = label.replace("[", "-").replace("]", "")
                if untrained:  # nothing to train: one run, at 0 shots
                    runs.append({"protocol": protocol, "backbone": bb, "dataset": ds, "method": label, "shots": 0,
                                 "seed": 1, "args": [*base, *margs, "shots=0"],
                                 "dir": root / _safe(bb) / ds / method_dir})
                    continue
                for k in spec.shots:
                    for s in spec.seeds:
                        runs.append({"protocol": protocol, "backbone": bb, "dataset": ds, "method": label,
                                     "shots": k, "seed": s,
                                     "args": [*base, *margs, f"shots={k}", f"seed={s}"],
                                     "dir": root / _safe(bb) / ds / method_dir / f"{k}shot" / f"seed{s}"})
    return runs


def _method_args(spec: SweepSpec, method: str, base: Sequence[str]):
    """A sweep method's arguments and its label: a variant's own list, ``NAME[PRESET]`` -> adapter=NAME
    preset=PRESET, else adapter=NAME. A preset from the sweep's args or a variant's list shows in the label
    (``coop[authors]``), so tables and folders tell runs of different presets apart."""
    if method in spec.variants:
        margs = list(spec.variants[method])
    else:
        name, preset = parse_label(method)
        margs = [f"adapter={name}"] + ([f"preset={preset}"] if method.endswith("]") else [])
    preset = preset_name_of([*base, *margs])
    label = method if preset == FEWCLIP or method.endswith("]") else method_label(method, preset)
    return margs, label


@dataclass
class _Planned:
    """One run of a sweep with its parsed config, identity and what its directory held when planned."""

    run: dict[str, Any]
    cfg: Any
    identity: Identity
    state: RunState


def run_sweep(cfg: SweepConfig, out: Path, poll_s: float = 1.0) -> dict[str, Any]:
    """Run every planned run that is not finished with its current identity; returns counts (and
    ``failures``: the ``fewclip.runs.launch.worker.RunResult`` of each failed run).

    Finished runs whose identity changed (config, backbone weights, data) run again and the log says
    how many and why. The runs execute where ``cfg.launcher`` says (``fewclip.runs.launch``); each is claimed
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

    plans, protocol_plans = [], {}
    same_prompts: dict[str, list[str]] = {}  # classes sharing a prompt -> the backbones they do with
    checked = set()  # (backbone, test sets, templates) already checked: once each, not once per run
    for r, c in progress(list(zip(runs, parsed)), desc="sweep: planning", unit="run", leave=False):
        try:
            bb, plan = resources(c)
            identity = run_identity_of(c, bb, plan, few_shot_split(c, plan))
        except FewclipError as e:
            raise _in_run(e, r) from e
        plans.append(_Planned(r, c, identity, run_state(out / r["dir"], identity)))
        protocol_plans[r["dir"]] = plan
        key = (bb.name, plan.train.name, tuple(e.dataset.name for e in plan.evals), c.data.templates)
        if key in checked:
            continue
        checked.add(key)
        records = plan_identical_prompts(bb, plan, c.data.templates)
        if records:
            seen = same_prompts.setdefault(json.dumps(records), [])
            if bb.name not in seen:
                seen.append(bb.name)
    for records, backbones in same_prompts.items():  # once for the sweep, before any run; each run records it
        warn_records(json.loads(records), backbone=", ".join(backbones), where="sweep")
    check_images([protocol_plans[p.run["dir"]] for p in plans if not p.state.finished])
    # What the report accounts for: every planned run and its identity, in the folder of the sweep's protocol
    # (sweeps of several protocols share an out folder, each under OUT/<protocol>/, and keep their own plans).
    plan_root = plan_folder(out, cfg.sweep.protocol)
    plan_file = new_plan([p.run for p in plans], [p.identity.digest for p in plans], cfg.sweep.protocol)
    with sweep_lock(out, cfg.lock_timeout_s):
        write_plan(plan_root, plan_file)
    for p in plans:
        if p.state.finished:  # a lock or temporary file left by a process killed after it finished the run
            tidy(out / p.run["dir"], stale_after_s=cfg.lock_timeout_s)
    todo = [p for p in plans if not p.state.finished]
    counts = {"planned": len(runs), "done_before": len(runs) - len(todo), "ran": 0, "rerun": 0, "by_others": 0,
              "failed": 0, "replaced": 0}
    log.info("sweep: %d runs planned, %d already finished, %d to run", len(runs), counts["done_before"], len(todo))
    reasons: dict[str, int] = {}
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
    with sweep_lock(out, cfg.lock_timeout_s):  # the report names each failed run with its error's first line
        record_failures(plan_root, plan_file, [(str(r.spec.dir), r.error) for r in outcome.failures])
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


def check_images(plans: Sequence[Any]) -> None:
    """Before the first run: every image file of the datasets the runs to do read, each dataset once; an
    unreadable one stops the sweep here, listed with the setting that leaves it out (``fewclip.data.image_check``)."""
    datasets = {}
    for plan in plans:  # fewclip.data.protocols.ProtocolPlan
        for d in (plan.source, plan.train, *(e.dataset for e in plan.evals)):
            if getattr(d, "root", None) is not None and getattr(d, "skipped_images", None) is None:
                datasets.setdefault(id(d), d)
    bad_lines = []
    for d in datasets.values():
        total = n_images(d)
        if total > SWEEP_CHECK_MAX:
            log.info("sweep: %s has %d images, more than are checked up front; `fewclip datasets check` checks them",
                     d.name, total)
            continue
        bad = find_bad_images(d, desc=f"sweep: checking the images of {d.name}")
        if bad:
            bad_lines.append(describe_bad(d, bad, total))
    if bad_lines:
        raise DatasetError("\n".join(bad_lines) + "\nno run started: data.skip_bad_images=true (in sweep.args) leaves "
                           "them out of every run, and metrics.json records which; or fix or remove the files")


def _spec(p: _Planned, out: Path, cfg: SweepConfig, store: Optional[str]):
    """A planned run as the launchers hand it to the run function (``fewclip.runs.launch.worker.execute_run``)."""
    r = p.run
    trains = adapter_info(p.cfg.adapter.name).adapter_cls.will_train_image_tower(p.cfg.adapter)
    return RunSpec(out=str(Path(out).resolve()), dir=str(r["dir"]), args=tuple(r["args"]), identity=p.identity,
                   method=r["method"], backbone=r["backbone"], dataset=r["dataset"], shots=int(r["shots"]),
                   seed=int(r["seed"]), log_level=cfg.log_level, lock_timeout_s=cfg.lock_timeout_s, store=store,
                   trains_image_tower=bool(trains), log=cfg.log)


def _in_run(e: Exception, r: dict[str, Any]) -> Exception:
    """The same error with the run named in its message."""
    try:
        return type(e)(f"sweep run {r['dir']}: {e}")
    except Exception:  # an error type whose constructor takes other arguments: keep it as it was
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

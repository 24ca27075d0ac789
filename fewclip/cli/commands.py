"""The commands behind ``fewclip COMMAND``: each turns its arguments into config objects and calls plain library
functions. ``fewclip.cli.main`` imports this module only when a command runs (``fewclip --help`` stays light)."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from fewclip import api
from fewclip.adapter.base import ADAPTERS, adapter_info
from fewclip.adapter.exports import load_prompts
from fewclip.adapter.index import summary_of
from fewclip.backbones.backbone import describe_backbone_source, list_backbones
from fewclip.backbones.importer import formats_usage, import_from_args
from fewclip.cli.features import cmd_features as features_command
from fewclip.cli.light import NoOptions, method_lines, parse_command, presets_line
from fewclip.cli.predict_files import check_out, expand_images, write_predictions
from fewclip.cli.quickhelp import HEADER
from fewclip.cli.table import BY_NAME  # each command's usage line
from fewclip.config.compose import ConfigError, FeaturesConfig, RunConfig, describe_config, load_config
from fewclip.config.presets import describe_presets, presets_of
from fewclip.data.base import build_dataset
from fewclip.data.split_files import SplitOptions, export_split, import_split
from fewclip.features.store import FeatureStore, matches_dataset, store_setting, under_root
from fewclip.runs.export import export_run
from fewclip.runs.records import prepare_dir
from fewclip.runs.run import as_train_config, load_train_config, preset_defaults
from fewclip.runs.sweep import load_sweep_config
from fewclip.training.evals import describe_evals
from fewclip.utils.logs import setup_logging  # fewclip's lines at the chosen level, other libraries' from WARNING up
from fewclip.utils.progress import progress

log = logging.getLogger("fewclip")


def _table(rows: list[dict[str, str]], cols: Sequence[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def run_dir(out: str | None, default: str) -> Path:
    return prepare_dir(Path(out or default), "out")


# ---------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------


def cmd_backbones(args: Sequence[str]) -> int:
    names = [a for a in args if not a.startswith("-")]
    if names:  # one backbone in detail: where its weights, geometry and preprocessing come from
        print("\n\n".join(describe_backbone_source(n) for n in names))
        return 0
    show_all = "--all" in args
    rows = list_backbones()
    cards = [r for r in rows if r["kind"] == "card"]
    oc = [r for r in rows if r["kind"] == "open_clip"]
    print("Reference backbones shipped with fewclip (backbone=NAME):")
    print(_table(cards, ["name", "geometry", "description"]))
    print()
    print("open_clip architectures (backbone=ARCH backbone.pretrained=TAG|FILE|none); weights need a download or a local file:")
    shown = oc if show_all else [r for r in oc if r["weights"] != "none"][:25]
    print(_table(shown, ["name", "geometry", "weights"]))
    if not show_all:
        print(f"... {len(oc)} architectures in all; `fewclip backbones --all` lists every one.")
    print("\nA backbone card (a YAML file) describes any other checkpoint: backbone=path/to/card.yaml;\n"
          "`fewclip import` makes a card folder from MERU, HyCoCLIP, EuCLIP, OpenAI and open_clip checkpoints: "
          "backbone=DIR")
    return 0


def _balanced_words(m: dict[str, Any]) -> str:
    """`` (mean per-class 33.33%)``: beside top-1, which an imbalanced test set inflates; empty where not recorded."""
    return f" (mean per-class {m['mean_per_class']:.2f}%)" if m.get("mean_per_class") is not None else ""


def cmd_zeroshot(args: Sequence[str]) -> int:
    cfg: RunConfig = load_config(args, RunConfig)
    setup_logging(cfg.log_level)
    run = api.run_config(as_train_config(cfg, adapter_info("zeroshot").config_cls()),
                         default=api.default_zeroshot_dir(cfg))
    metrics, out = run.metrics, run.dir
    if "evals" in metrics:
        print(f"zero-shot, {_protocol_words(metrics)}: {_evals_line(metrics)} with {metrics['backbone']} "
              f"[{metrics['geometry']}] -> {out / 'metrics.json'}")
        return 0
    print(f"zero-shot top-1 {metrics['top1']:.2f}%{_balanced_words(metrics)} on {metrics['dataset']} ({metrics['n_test']} test images, "
          f"{_templates_words(metrics)}) with {metrics['backbone']} [{metrics['geometry']}] -> {out / 'metrics.json'}")
    return 0


def _templates_words(m) -> str:
    t = m.get("templates") or []
    return f"template {t[0]!r}" if len(t) == 1 else f"{len(t)} templates (data.templates={m.get('templates_mode')})"


def _fewer_words(m) -> str:
    """" (fewest 15 per class)" for a run whose classes had fewer training images than shots, else ""."""
    got = m.get("shots_per_class") or {}
    return f" (fewest {min(got.values())} per class)" if got and min(got.values()) < m.get("shots", 0) else ""


def _protocol_words(m) -> str:
    where = "on" if m["protocol"] == "base2new" else "from"
    return f"{m['protocol']} {where} {m['dataset']}"


def _evals_line(m) -> str:
    n = " + ".join(str(e["n_test"]) for e in m["evals"].values())
    return f"{describe_evals(m['protocol'], m['evals'])} ({n} test images)"


def cmd_train(args: Sequence[str]) -> int:
    cfg = load_train_config(args)
    setup_logging(cfg.log_level)
    run = api.run_config(cfg)
    m, out = run.metrics, run.dir
    if "evals" in m:
        print(f"{m['method']} {cfg.shots}-shot{_fewer_words(m)} seed {cfg.seed}, {_protocol_words(m)}: "
              f"{_evals_line(m)}, trained in {m['train_time_s']:.1f} s -> {out}")
        return 0
    print(f"{m['method']} {cfg.shots}-shot{_fewer_words(m)} seed {cfg.seed}: top-1 {m['top1']:.2f}%{_balanced_words(m)} "
          f"on {m['dataset']} ({m['n_test']} test images, {_templates_words(m)}, trained in {m['train_time_s']:.1f} s) "
          f"-> {out}")
    return 0


def cmd_sweep(args: Sequence[str]) -> int:
    cfg = load_sweep_config(args)
    setup_logging(cfg.log_level)
    result = api.sweep(args=args)
    counts, out = result.counts, result.out
    if counts.get("dry_run"):
        return 0
    extra = "".join(f", {counts[k]} {what}" for k, what in (("rerun", "of them rerun (identity changed)"),
                                                            ("by_others", "done by another worker"),
                                                            ("failed", "failed"),
                                                            ("replaced", "since replaced by another config"))
                    if counts.get(k))
    print(f"sweep: {counts['planned']} runs, {counts['done_before']} already done, {counts['ran']} ran{extra} -> {out}")
    if result.report is not None:
        print(result.report.markdown)
        print("report: " + ", ".join(str(p) for p in result.report.paths.values()))
    if result.failures:
        print(f"\nsweep: {len(result.failures)} run(s) failed; the next `fewclip sweep` with this config runs them again:")
        for r in result.failures:
            print(f"  {r.spec.dir}: {r.error}\n    log: {r.log}")
        return 1
    return 0


@dataclass
class CacheArgs:
    dir: Optional[str] = field(default=None, metadata={
        "help": "the feature store's folder (default: $FEWCLIP_CACHE, or ~/.cache/fewclip/features)"})
    backbone: Optional[str] = field(default=None, metadata={"help": "only the groups of this backbone"})
    dataset: Optional[str] = field(default=None, metadata={"help": "only the groups of this dataset (its name)"})
    root: Optional[str] = field(default=None, metadata={"help": "only the groups of datasets under this folder"})


def cmd_cache(args: Sequence[str]) -> int:
    opts, words = parse_command("cache", args, CacheArgs)
    action = words.pop(0) if words and words[0] in ("list", "clear") else "list"
    if len(words) > 1:
        raise ConfigError(f"fewclip cache takes one dataset name or root, got {' '.join(words)}; "
                          f"{BY_NAME['cache'].usage}")
    for word in words:  # a bare word: a dataset root if it is a folder, else a dataset name
        if Path(word).expanduser().is_dir():
            opts.root = word
        else:
            opts.dataset = word
    root = store_setting(opts.dir)
    if root is None:
        print("the feature store is off (FEWCLIP_CACHE=off); nothing is kept on disk")
        return 0
    store = FeatureStore(root)
    if action == "clear":
        cleared = store.clear(backbone=opts.backbone, dataset=opts.dataset, root=opts.root)
        if cleared.removed_bytes or not cleared.kept:  # what it did; then, if anything is left, the error
            print(cleared.summary(root))
        cleared.check(root)
        return 0
    groups = [g for g in store.groups() if opts.backbone in (None, g.address.get("backbone"))
              and (opts.dataset is None or matches_dataset(g.address.get("dataset"), opts.dataset))
              and (opts.root is None or under_root(g.address.get("data_root"), opts.root))]
    rows = [{"backbone": g.address.get("backbone", "?"), "dataset": g.address.get("dataset", "?"),
             "root": g.address.get("data_root") or "(generated)",
             "images": g.transform, "variant": "local attention" if g.address.get("variant") else "",
             "precision": g.address.get("precision", "?"), "requests": g.requests, "features": g.images,
             "MiB": f"{g.bytes / 2**20:.1f}", "last used": time.strftime("%Y-%m-%d %H:%M", time.localtime(g.last_used))
             if g.last_used else "-", "group": g.digest[:12]} for g in groups]
    total = sum(g.bytes for g in groups) / 2**20
    print(f"feature store {root}: {len(groups)} group(s), {sum(g.images for g in groups)} feature rows, {total:.1f} MiB")
    if rows:
        print(_table(rows, ["backbone", "dataset", "root", "images", "variant", "precision", "requests", "features",
                            "MiB", "last used", "group"]))
        print("`fewclip cache clear [DATASET|ROOT] [backbone=NAME]` removes them (no sweep should be running)")
    old = store.old_formats()
    if old:
        print(f"{', '.join(d.name for d in old)}: features in an older store format, never read; `fewclip cache "
              f"clear` removes them")
    return 0


def cmd_adapters(args: Sequence[str]) -> int:
    """Every registered method (or those named), its options with their help, and its own training defaults."""
    _, names = parse_command("adapters", args, NoOptions)
    for name in names or ADAPTERS.names():
        info = adapter_info(name)
        source = ADAPTERS.source(name)
        head = summary_of(info.adapter_cls) + ("" if source.startswith("fewclip.") else f"  [from {source}]")
        if names:  # one method in detail: its presets, field by field with their sources
            tail = ["  " + line for line in describe_presets(name, preset_defaults(info))]
        else:
            tail = [presets_line(name, list(presets_of(name)))]
        print("\n".join(method_lines(name, head, info.config_cls(), dict(info.adapter_cls.train_defaults), tail)))
    return 0


def cmd_export(args: Sequence[str]) -> int:
    rest, out = list(args), None
    if "-o" in rest or "--out" in rest:  # `-o PATH` as README shows it, the same as out=PATH
        i = rest.index("-o") if "-o" in rest else rest.index("--out")
        if i + 1 >= len(rest):
            raise ConfigError(f"{rest[i]} needs a path; {BY_NAME['export'].usage}")
        out = rest[i + 1]
        del rest[i:i + 2]
    paths = [a for a in rest if "=" not in a]
    # The options of the run's export format are checked and converted by the format itself.
    options = dict(a.split("=", 1) for a in rest if "=" in a)
    out = options.pop("out", out)
    device = options.pop("backbone.device", None)
    if len(paths) != 1:
        raise ConfigError(BY_NAME["export"].usage)
    if out is not None and not str(out).strip():
        raise ConfigError(f"-o (out=) is empty; give the path to write, or leave it out; {BY_NAME['export'].usage}")
    done = export_run(paths[0], out, device=device, **options)
    print(f"exported {done.adapter} run {paths[0]}\n" + done.summary())
    return 0


@dataclass
class PredictBackbone:
    device: str = field(default="auto", metadata={"help": "auto, cpu or cuda"})
    name: Optional[str] = field(default=None, metadata={"help": "load the export's backbone from another name"})
    pretrained: Optional[str] = field(default=None, metadata={"help": "... or from another weights file or tag"})
    precision: Optional[str] = field(default=None, metadata={"help": "fp32, bf16 or fp16"})


@dataclass
class PredictArgs:
    prompts: Optional[str] = field(default=None, metadata={"help": "what `fewclip export` wrote (file or folder)"})
    top_k: int = field(default=5, metadata={"help": "classes shown per image"})
    out: Optional[str] = field(default=None, metadata={"help": (
        "write the predictions to this file, CSV (.csv) or JSON (.json), instead of listing them")})
    batch_size: int = field(default=64, metadata={"help": "images classified at once"})
    backbone: PredictBackbone = field(default_factory=PredictBackbone)


def cmd_predict(args: Sequence[str]) -> int:
    opts, images = parse_command("predict", args, PredictArgs)
    if not opts.prompts or not images:
        raise ConfigError(BY_NAME["predict"].usage)
    if opts.top_k < 1:
        raise ConfigError(f"top_k must be >= 1, got {opts.top_k}")
    overrides = {k: v for k in ("name", "pretrained", "precision")
                 if (v := getattr(opts.backbone, k)) is not None}
    if opts.batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {opts.batch_size}")
    if opts.out:
        check_out(opts.out)  # before loading anything
    images = expand_images(images)  # a folder: the image files under it
    clf = load_prompts(opts.prompts, device=opts.backbone.device, backbone_overrides=overrides)
    preds = []
    batches = range(0, len(images), opts.batch_size)
    for i in progress(batches, desc="predict", unit="batch", total=len(batches), leave=False):
        preds.extend(clf.predict(images[i:i + opts.batch_size], top_k=opts.top_k))
    print(f"{type(clf).__name__} {opts.prompts}: {len(clf.classnames)} classes on {clf.backbone.name} "
          f"[{clf.geometry.name}]; probabilities are a softmax over the classes")
    if opts.out:
        print(f"{len(images)} image(s) -> {write_predictions(opts.out, images, preds)}")
        return 0
    for path, top in zip(images, preds):
        print(path)
        for name, prob in top:
            print(f"  {prob:6.3f}  {name}")
    return 0


def cmd_import(args: Sequence[str]) -> int:
    if not args:
        print("usage: fewclip import FORMAT CHECKPOINT out=DIR [key=value ...]\n\nformats:\n" + formats_usage())
        return 0
    print(import_from_args(args))
    return 0


def cmd_split(args: Sequence[str]) -> int:
    opts, words = parse_command("split", args, SplitOptions)
    action = words.pop(0) if words else None
    if len(words) != {"export": 0, "import": 1}.get(action, -1):  # export takes no FILE, import one
        raise ConfigError(BY_NAME["split"].usage)
    dataset = build_dataset(opts.data)
    print(export_split(opts, dataset) if action == "export" else import_split(opts, words[0], dataset))
    return 0


def cmd_features(args: Sequence[str]) -> int:
    return features_command(args, setup_logging)  # methods on your own features: fewclip.cli.features


def _train_defaults(args: Sequence[str] = ()):
    """The train config with the given arguments (`fewclip train adapter=lora --help` shows LoRA's
    defaults, including its own `train` section)."""
    return load_train_config([a for a in args if a not in ("--help", "-h")])


def _sweep_defaults(args: Sequence[str] = ()):
    """The sweep config with the given arguments (`fewclip sweep launcher=slurm --help` shows SLURM's options)."""
    return load_sweep_config([a for a in args if a not in ("--help", "-h")])


# `fewclip COMMAND --help` prints these configs, each option with its help from the dataclass field's metadata.
CONFIG_SCHEMAS: dict[str, Callable[[Sequence[str]], object]] = {"zeroshot": lambda args: RunConfig(),
                                                                "train": _train_defaults,
                                                                "sweep": _sweep_defaults,
                                                                "features": lambda args: FeaturesConfig()}


def config_help(command: str, args: Sequence[str]) -> int:
    """``fewclip COMMAND --help`` of a command whose options are a run config: every option with its default and
    help, the config composed with the registries (a plugin's method or launcher included)."""
    print(HEADER.format(command=command))
    print("\n".join(describe_config(CONFIG_SCHEMAS[command](args))))
    return 0

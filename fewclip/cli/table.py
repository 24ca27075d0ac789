"""The ``fewclip`` commands: one record per command, the only place a command is declared.

A record says what ``fewclip --help`` lists for it (``summary``), what ``fewclip NAME --help`` prints for a command
without a run config (``usage``), the light dataclass of its options (``options``, printed with their help without
loading torch), whether its options are a run config that ``fewclip.cli.quickhelp`` composes (``run_config``), and
the function that runs it (``run``, ``"module:function"``, imported only when the command runs, so ``fewclip --help``
stays light). Adding a command is adding a record here and writing its function.

Light: nothing here imports torch, open_clip or any fewclip module above ``fewclip.utils``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Command:
    name: str
    summary: tuple[str, ...]  # `fewclip --help`: the first line beside the name, the rest indented under it
    run: str  # "module:function" taking the arguments (after the command's name) and returning the exit code
    usage: Optional[str] = None  # `fewclip NAME --help` of a command without a run config
    options: Optional[str] = None  # "module:Class": a torch-free options dataclass that --help prints with its help
    run_config: bool = False  # its options are a run config (--help: fewclip.cli.quickhelp, else the command module)

    def function(self) -> Callable[[Sequence[str]], int]:
        module, name = self.run.split(":")
        return getattr(importlib.import_module(module), name)

    def options_class(self):
        module, name = self.options.split(":")
        return getattr(importlib.import_module(module), name)


HEAVY = "fewclip.cli.commands"  # the commands that load models (torch, open_clip: seconds to import)
LIGHT = "fewclip.cli.light"  # the commands that load none (report, datasets, adapters): a fraction of a second

COMMANDS: tuple[Command, ...] = (
    Command("backbones", (
        "list the backbones fewclip can load, with their geometry; fewclip backbones NAME shows one",
        "(its weights, geometry and image preprocessing; an open_clip architecture: every tag's)"),
        f"{HEAVY}:cmd_backbones",
        usage=("usage: fewclip backbones [--all] [NAME ...]: the backbones fewclip can load, with their geometry; "
               "NAME: one in detail (weights, geometry, image preprocessing)")),
    Command("datasets", (
        "list the registered datasets and where each expects its files; fewclip datasets check",
        "data=folder data.root=PATH lists the image files that cannot be read"),
        f"{LIGHT}:cmd_datasets",
        usage=("usage: fewclip datasets: the registered datasets and where each expects its files | fewclip "
               "datasets check data=NAME [data.root=PATH]: every image file read once, the unreadable ones listed "
               "(data.skip_bad_images=true leaves them out)")),
    Command("zeroshot", ("zero-shot evaluation: fewclip zeroshot backbone=toy-clip data=toy-shapes out=runs/zs",),
            f"{HEAVY}:cmd_zeroshot", run_config=True),
    Command("train", (
        "one few-shot run: fewclip train adapter=coop data=toy-shapes shots=16 seed=1 out=runs/coop",
        "(protocol=base2new|cross_dataset|domain_shift [targets=[A,B]]: the generalisation protocols)"),
        f"{HEAVY}:cmd_train", run_config=True),
    Command("sweep", (
        "methods x datasets x shots x seeds, resumable: fewclip sweep sweep/demo.yaml out=runs/demo",
        "on worker processes, Ray or SLURM: launcher=local launcher.workers=4 | launcher=ray | launcher=slurm"),
        f"{HEAVY}:cmd_sweep", run_config=True),
    Command("cache", ("the on-disk feature store shared by runs and sweeps: fewclip cache [list|clear]",),
            f"{HEAVY}:cmd_cache",
            usage=("usage: fewclip cache [list|clear] [DATASET|ROOT] [dir=PATH] [backbone=NAME] [dataset=NAME] "
                   "[root=PATH]: the on-disk feature store (dir= or $FEWCLIP_CACHE, default "
                   "~/.cache/fewclip/features)")),
    Command("split", (
        "few-shot split files in published formats: fewclip split export data=toy-shapes shots=16 seed=1",
        "format=zhou out=split.json; fewclip split import split.json data=toy-shapes; data.fewshot_file=FILE"),
        f"{HEAVY}:cmd_split", options="fewclip.data.split_files:SplitOptions",
        usage=("usage: fewclip split export data=NAME [data.root=PATH] [shots=16] [seed=1] format=zhou|2sfs|manifest|"
               "fewclip out=FILE | fewclip split import FILE data=NAME [data.root=PATH] [shots=K] [seed=S]: few-shot "
               "split files (CoOp's split_zhou JSON and split_fewshot pickles, 2SFS JSON lines, manifests); a run "
               "trains on one with data.fewshot_file=FILE")),
    Command("report", ("seed-averaged tables and the accuracy-vs-shots plot: fewclip report runs/demo",),
            f"{LIGHT}:cmd_report", options="fewclip.config.report:ReportOptions",
            usage=("usage: fewclip report RUN_DIR [RUN_DIR ...] [key=value ...]: seed-averaged tables (Markdown, "
                   "CSV, JSON, LaTeX) and figures of the runs under the folders, merged")),
    Command("adapters", (
        "list the registered adapters (few-shot methods); fewclip adapters NAME adds its presets",
        "(fewclip train adapter=NAME preset=authors: the authors' settings, each with its source)"),
        f"{LIGHT}:cmd_adapters",
        usage=("usage: fewclip adapters [NAME ...]: the registered methods, each option with its help; NAME: also "
               "its presets (train preset=NAME), each field they set with its source")),
    Command("published", (
        "the published results of fewclip's methods, with sources: fewclip published method=coop",
        "protocol=base2new (`fewclip report` sets them beside your runs where the setting matches)"),
        "fewclip.published:command", options="fewclip.published:PublishedOptions",
        usage=("usage: fewclip published [method=NAME] [dataset=NAME] [protocol=NAME] [backbone=ARCH/TAG] [shots=N] "
               "[metric=NAME]: the published results shipped with fewclip, each with its source")),
    Command("export", (
        "a run in its method's export format: fewclip export runs/coop -o prompts.safetensors [nearest=3]",
        "(CoOp: one prompt file; LoRA: a peft folder, fewclip export runs/lora [merge=true];",
        "the other methods: one adapter file, fewclip export runs/tip -o tip.safetensors)"),
        f"{HEAVY}:cmd_export",
        usage=("usage: fewclip export RUN_DIR [-o PATH] [backbone.device=cpu] [OPTION=VALUE ...]: a run in its "
               "method's export format (options by format: `fewclip adapters` lists the methods)")),
    Command("predict", (
        "classify images with an export: fewclip predict prompts=prompts.safetensors a.jpg",
        "(a folder: every image under it; out=predictions.csv or .json writes them to a file)"),
        f"{HEAVY}:cmd_predict",
        usage=("usage: fewclip predict prompts=FILE IMAGE|FOLDER [...] [top_k=5] [out=FILE.csv|FILE.json] "
               "[backbone.device=cpu]: a folder stands for the image files under it")),
    Command("features", (
        "a feature file from a dataset and a backbone, for methods on features:",
        "fewclip features backbone=toy-clip data=toy-colours out=colours.safetensors [views=20], then",
        "fewclip train adapter=tip_adapter_f data=features data.path=colours.safetensors"),
        f"{HEAVY}:cmd_features", run_config=True),
    Command("import", (
        "an authors' checkpoint as a backbone card folder: fewclip import meru meru_vit_s.pth",
        "arch=vit_small_mocov3_patch16_224 out=cards/meru-s, then backbone=cards/meru-s",
        "(formats meru, hycoclip, euclip, openai, open_clip; `fewclip import` alone lists their options)"),
        f"{HEAVY}:cmd_import",
        usage="usage: fewclip import FORMAT CHECKPOINT out=DIR [key=value ...] (`fewclip import` lists the formats)"),
)
BY_NAME: dict[str, Command] = {c.name: c for c in COMMANDS}
assert len(BY_NAME) == len(COMMANDS), "a command is declared twice"

"""The ``fewclip`` command line: ``fewclip COMMAND [file.yaml ...] [key=value ...]``.

The CLI turns arguments into config objects and calls plain library functions.
"""
from __future__ import annotations

import importlib
import sys
import traceback
from typing import Sequence

from fewclip.utils.errors import describe, take_debug_flag
from fewclip.version import __version__

# What `fewclip COMMAND --help` prints for the commands without a run config (theirs come from the dataclasses).
COMMAND_HELP = {
    "backbones": ("usage: fewclip backbones [--all] [NAME ...]: the backbones fewclip can load, with their geometry; "
                  "NAME: one in detail (weights, geometry, image preprocessing)"),
    "datasets": "usage: fewclip datasets: the registered datasets and where each expects its files",
    "adapters": ("usage: fewclip adapters [NAME ...]: the registered methods, each option with its help; NAME: also "
                 "its presets (train preset=NAME), each field they set with its source"),
    "cache": ("usage: fewclip cache [list|clear] [DATASET|ROOT] [dir=PATH] [backbone=NAME] [dataset=NAME] [root=PATH]: "
              "the on-disk feature store (dir= or $FEWCLIP_CACHE, default ~/.cache/fewclip/features)"),
    "report": ("usage: fewclip report RUN_DIR [RUN_DIR ...] [key=value ...]: seed-averaged tables (Markdown, CSV, "
               "JSON, LaTeX) and figures of the runs under the folders, merged"),
    "export": ("usage: fewclip export RUN_DIR [-o PATH] [backbone.device=cpu] [OPTION=VALUE ...]: a run in its "
               "method's export format (options by format: `fewclip adapters` lists the methods)"),
    "predict": "usage: fewclip predict prompts=FILE IMAGE [IMAGE ...] [top_k=5] [backbone.device=cpu]",
    "import": "usage: fewclip import FORMAT CHECKPOINT out=DIR [key=value ...] (`fewclip import` lists the formats)",
    "published": ("usage: fewclip published [method=NAME] [dataset=NAME] [protocol=NAME] [backbone=ARCH/TAG] [shots=N] "
                  "[metric=NAME]: the published results shipped with fewclip, each with its source"),
    "split": ("usage: fewclip split export data=NAME [data.root=PATH] [shots=16] [seed=1] format=zhou|2sfs|manifest|"
              "fewclip out=FILE | fewclip split import FILE data=NAME [data.root=PATH] [shots=K] [seed=S]: few-shot "
              "split files (CoOp's split_zhou JSON, 2SFS JSON lines, manifests); a run trains on one with "
              "data.fewshot_file=FILE"),
}


# Commands whose options live in a light dataclass: their --help lists them without loading the commands.
LIGHT_OPTIONS = {"report": ("fewclip.config.report", "ReportOptions"),
                 "published": ("fewclip.published", "PublishedOptions"),
                 "split": ("fewclip.data.split_files", "SplitOptions")}
# Commands that need no torch: run from their own light module (its ``run(command, args)``), not fewclip.cli.commands.
LIGHT_COMMANDS = {"published": "fewclip.published"}

# Commands whose --help prints a run config: fewclip.cli.quickhelp composes it without torch where it can.
QUICK_HELP = ("train", "zeroshot", "sweep", "features")

COMMAND_NAMES = ("backbones", "datasets", "adapters", "zeroshot", "train", "sweep", "report", "export", "predict",
                 "import", "cache", "features", "published", "split")

USAGE = """usage: fewclip COMMAND [file.yaml ...] [key=value ...]

commands:
  backbones    list the backbones fewclip can load, with their geometry; fewclip backbones NAME shows one
               (its weights, geometry and image preprocessing; an open_clip architecture: every tag's)
  datasets     list the registered datasets and where each expects its files
  zeroshot     zero-shot evaluation: fewclip zeroshot backbone=toy-clip data=toy-shapes out=runs/zs
  train        one few-shot run: fewclip train adapter=coop data=toy-shapes shots=16 seed=1 out=runs/coop
               (protocol=base2new|cross_dataset|domain_shift [targets=[A,B]]: the generalisation protocols)
  sweep        methods x datasets x shots x seeds, resumable: fewclip sweep sweep/demo.yaml out=runs/demo
               on worker processes, Ray or SLURM: launcher=local launcher.workers=4 | launcher=ray | launcher=slurm
  cache        the on-disk feature store shared by runs and sweeps: fewclip cache [list|clear]
  split        few-shot split files in published formats: fewclip split export data=toy-shapes shots=16 seed=1
               format=zhou out=split.json; fewclip split import split.json data=toy-shapes; data.fewshot_file=FILE
  report       seed-averaged tables and the accuracy-vs-shots plot: fewclip report runs/demo
  adapters     list the registered adapters (few-shot methods); fewclip adapters NAME adds its presets
               (fewclip train adapter=NAME preset=authors: the authors' settings, each with its source)
  published    the published results of fewclip's methods, with sources: fewclip published method=coop
               protocol=base2new (`fewclip report` sets them beside your runs where the setting matches)
  export       a run in its method's export format: fewclip export runs/coop -o prompts.safetensors [nearest=3]
               (CoOp: one prompt file; LoRA: a peft folder, fewclip export runs/lora [merge=true];
               the other methods: one adapter file, fewclip export runs/tip -o tip.safetensors)
  predict      classify images with an export: fewclip predict prompts=prompts.safetensors a.jpg
  features     a feature file from a dataset and a backbone, for methods on features:
               fewclip features backbone=toy-clip data=toy-colours out=colours.safetensors [views=20], then
               fewclip train adapter=tip_adapter_f data=features data.path=colours.safetensors
  import       an authors' checkpoint as a backbone card folder: fewclip import meru meru_vit_s.pth
               arch=vit_small_mocov3_patch16_224 out=cards/meru-s, then backbone=cards/meru-s
               (formats meru, hycoclip, euclip, openai, open_clip; `fewclip import` alone lists their options)

Overrides use omegaconf dotlist syntax (data.templates=single); backbone=NAME,
data=NAME and adapter=NAME set that section's name. `fewclip COMMAND --help`
prints the command's full config with its defaults. An error prints one line
(exit code 2: bad input, 1: the run failed); --debug or FEWCLIP_DEBUG=1 adds the trace.
"""


def main(argv: Sequence[str] | None = None) -> int:
    debug, argv = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"fewclip {__version__}")
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMAND_NAMES:
        print(f"fewclip: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if ("--help" in args or "-h" in args) and command in COMMAND_HELP:  # no model needed: answered here
        print(COMMAND_HELP[command])
        if command in LIGHT_OPTIONS:  # the options, with their help, from their dataclass (no torch)
            module, cls = LIGHT_OPTIONS[command]
            options = getattr(importlib.import_module(module), cls)()
            lines = importlib.import_module("fewclip.config.help").describe_config(options)
            print("\noptions (key=value; defaults shown):\n" + "\n".join("  " + line for line in lines))
        return 0
    try:
        if ("--help" in args or "-h" in args) and command in QUICK_HELP:  # a run config's options, torch-free
            lines = importlib.import_module("fewclip.cli.quickhelp").help_lines(command, args)
            if lines is not None:
                print("\n".join(lines))
                return 0
        # The commands import torch and open_clip (seconds): loaded here, so `fewclip --help` does not pay it.
        commands = importlib.import_module(LIGHT_COMMANDS.get(command, "fewclip.cli.commands"))
        return commands.run(command, args)
    except KeyboardInterrupt:
        print(f"fewclip {command}: interrupted; finished results are kept", file=sys.stderr)
        return 130
    except Exception as e:  # every error ends in one message (fewclip.utils.errors); --debug shows the trace
        if debug:
            traceback.print_exc()
        message, code = describe(e)
        print(f"fewclip {command}: error: {message}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())

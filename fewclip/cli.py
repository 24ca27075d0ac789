"""The ``fewclip`` command line: ``fewclip COMMAND [file.yaml ...] [key=value ...]``.

The CLI turns arguments into config objects and calls plain library functions.
"""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Callable, Dict, List, Sequence

from . import __version__
from .config import ConfigError, RunConfig, load_config, to_yaml
from .io import atomic_write_json, atomic_write_text

log = logging.getLogger("fewclip")

USAGE = """usage: fewclip COMMAND [file.yaml ...] [key=value ...]

commands:
  backbones    list the backbones fewclip can load, with their geometry
  datasets     list the registered datasets and where each expects its files
  zeroshot     zero-shot evaluation: fewclip zeroshot backbone=toy-clip data=toy-shapes out=runs/zs

Overrides use omegaconf dotlist syntax (data.templates=single); backbone=NAME,
data=NAME and adapter=NAME set that section's name. `fewclip COMMAND --help`
prints the command's full config with its defaults.
"""


def setup_logging(level: str = "info") -> None:
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=getattr(logging, level.upper()), force=True)
    logging.getLogger("fewclip").setLevel(getattr(logging, level.upper()))


def _table(rows: List[Dict[str, str]], cols: Sequence[str]) -> str:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) if rows else len(c) for c in cols}
    lines = ["  ".join(c.ljust(widths[c]) for c in cols), "  ".join("-" * widths[c] for c in cols)]
    lines += ["  ".join(str(r.get(c, "")).ljust(widths[c]) for c in cols) for r in rows]
    return "\n".join(lines)


def run_dir(out: str | None, default: str) -> Path:
    path = Path(out or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------
# commands
# ---------------------------------------------------------------------------


def cmd_backbones(args: Sequence[str]) -> int:
    from .backbones import list_backbones

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
    print("\nA backbone card (a YAML file) describes any other checkpoint: backbone=path/to/card.yaml")
    return 0


def cmd_datasets(args: Sequence[str]) -> int:
    from fewclip.datasets import DATASETS

    for info in sorted(DATASETS.values(), key=lambda i: (i.needs_root, i.name)):
        print(f"{info.name}\n  {info.description}")
        where = "  no files needed" if not info.needs_root else "  data.root=PATH, expected layout:\n" + "\n".join(
            "    " + line for line in info.layout.splitlines())
        print(where)
    return 0


def cmd_zeroshot(args: Sequence[str]) -> int:
    from fewclip.datasets import build_dataset

    from .backbones import load_backbone
    from .zeroshot import evaluate_zeroshot

    cfg: RunConfig = load_config(args, RunConfig)
    setup_logging(cfg.log_level)
    out = run_dir(cfg.out, f"runs/zeroshot/{Path(cfg.backbone.name).stem}_{cfg.data.name}")
    atomic_write_text(out / "config.yaml", to_yaml(cfg))
    dataset = build_dataset(cfg.data)
    backbone = load_backbone(cfg.backbone)
    metrics = evaluate_zeroshot(backbone, dataset, templates=cfg.data.templates, batch_size=cfg.data.batch_size,
                                workers=cfg.data.workers, max_test=cfg.data.max_test, seed=cfg.seed)
    metrics["backbone_info"] = backbone.describe()
    atomic_write_json(out / "metrics.json", metrics)
    print(f"zero-shot top-1 {metrics['top1']:.2f}% on {dataset.name} ({metrics['n_test']} test images) "
          f"with {backbone.name} [{backbone.geometry.name}] -> {out / 'metrics.json'}")
    return 0


COMMANDS: Dict[str, Callable[[Sequence[str]], int]] = {
    "backbones": cmd_backbones,
    "datasets": cmd_datasets,
    "zeroshot": cmd_zeroshot,
}
CONFIG_SCHEMAS: Dict[str, type] = {"zeroshot": RunConfig}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"fewclip {__version__}")
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"fewclip: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    if "--help" in args or "-h" in args:
        schema = CONFIG_SCHEMAS.get(command)
        print(USAGE if schema is None else f"fewclip {command} config (defaults):\n\n" + to_yaml(schema()))
        return 0
    setup_logging("info")
    from fewclip.datasets import DatasetError

    from .backbones import BackboneError

    try:
        return COMMANDS[command](args)
    except (ConfigError, BackboneError, DatasetError) as e:
        print(f"fewclip {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fewclip {command}: interrupted; finished results are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

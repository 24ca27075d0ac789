"""``fewclip export RUN_DIR``: a finished run written in its adapter's export format (``fewclip.adapter.exports``).

The run's config, split, templates and adapter tensors are read back, the backbone is checked against the weights
the run was trained on, and the adapter's registered ``ExportFormat`` writes the file or folder.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from safetensors import safe_open
from safetensors.torch import load_file

from fewclip.adapter.base import ADAPTERS, adapter_info, build_adapter
from fewclip.adapter.exports import ExportError, export_metadata, format_of
from fewclip.backbones.backbone import load_backbone
from fewclip.config.compose import ConfigError
from fewclip.data.base import DatasetError
from fewclip.data.splits import read_split
from fewclip.features.feature_file import export_backbone
from fewclip.runs.records import run_state
from fewclip.runs.run import load_train_config
from fewclip.utils.io import read_json
from fewclip.utils.tensor_checks import check_state_tensors


@dataclass
class Exported:
    path: Path
    meta: dict[str, Any]
    adapter: str = ""

    def summary(self) -> str:
        """What the export holds, in the words of its format."""
        return format_of(self.meta, self.path).summary(self.path, self.meta)


def _option(fmt, key: str, value: Any) -> Any:
    """An option of ``fmt``'s writer, converted from the command line's string to the type of its default."""
    default = fmt.options[key]
    if not isinstance(value, str) or isinstance(default, str):
        return value
    if isinstance(default, bool):
        if value not in ("true", "false"):
            raise ExportError(f"{key} must be true or false, got {value!r}")
        return value == "true"
    try:
        return type(default)(value)
    except ValueError:
        raise ExportError(f"{key} must be a{'n' if isinstance(default, int) else ''} "
                          f"{type(default).__name__}, got {value!r}") from None


def export_run(run_dir: Union[str, Path], out: Union[str, Path, None] = None, *, device: Optional[str] = None,
               backbone=None, **options) -> Exported:
    """Export a finished run directory in its adapter's format (at ``out``, default inside the run directory).

    The adapter is rebuilt from ``config.yaml``, the class names of ``split.json``, the templates in
    ``metrics.json`` and ``adapter.safetensors``; no dataset files are read. ``options`` go to the format's
    writer (e.g. CoOp: ``nearest=3``; LoRA: ``merge=True``); strings are converted to the option's type.
    """


    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise ExportError(f"{run_dir} is not a run directory (no config.yaml); pass the folder `fewclip train` wrote")
    try:
        cfg = load_train_config([str(run_dir / "config.yaml")])
    except ConfigError as e:
        raise ExportError(f"cannot read the config of run {run_dir}: {e}") from None
    name = cfg.adapter.name
    fmt = adapter_info(name).export
    if fmt is None:
        have = ", ".join(f"adapter={n}" for n, i in sorted(ADAPTERS.items()) if i.export is not None)
        raise ExportError(f"run {run_dir} was trained with adapter {name!r}, which has no export format; "
                          f"fewclip export supports runs of {have}")
    unknown = sorted(set(options) - set(fmt.options))
    if unknown:
        takes = ", ".join(f"{k}={v}" for k, v in fmt.options.items()) or "no options"
        raise ExportError(f"option(s) {', '.join(unknown)} do not apply to {name} runs; their export takes {takes}")
    options = {k: _option(fmt, k, v) for k, v in options.items()}
    for f in ("adapter.safetensors", "split.json", "metrics.json"):
        if not (run_dir / f).is_file():
            raise ExportError(f"run {run_dir} is not finished: it has no {f}")
    state = run_state(run_dir)
    if not state.finished and state.kind != "legacy":  # runs of an older fewclip have no record to check
        raise ExportError(f"run {run_dir} is not a valid finished run: {state.reason}; run it again")
    try:
        split = read_split(run_dir / "split.json")
    except DatasetError as e:
        raise ExportError(str(e)) from None
    metrics = read_json(run_dir / "metrics.json")
    templates = metrics.get("templates")
    if not isinstance(templates, list):
        raise ExportError(f"run {run_dir}: metrics.json does not list the prompt templates the run used; "
                          f"re-run it with this version of fewclip")
    if device is not None:
        cfg.backbone.device = device
    backbone = backbone or export_backbone(cfg) or load_backbone(cfg.backbone)

    weights = run_dir / "adapter.safetensors"
    try:
        with safe_open(str(weights), "pt") as f:
            trained_on = (f.metadata() or {}).get("weights_sha256")
        sd = load_file(str(weights))
    except Exception as e:  # safetensors' own error types for a damaged file (SafetensorError, ...)
        raise ExportError(f"cannot read {weights}: {e}") from None
    if trained_on and backbone.weights_sha256 and trained_on != backbone.weights_sha256:
        raise ExportError(f"run {run_dir} was trained on backbone weights with sha256 {trained_on[:16]}... but "
                          f"{backbone.name!r} now loads {backbone.weights_sha256[:16]}...; what it learned fits the "
                          f"old weights only")
    adapter = build_adapter(cfg.adapter, backbone, split.classnames, templates)
    check_state_tensors(sd, adapter.adapter_state_dict(), str(weights), ExportError, "; run it again")
    try:
        adapter.load_adapter_state_dict(sd)
    except RuntimeError as e:
        raise ExportError(f"{weights} does not match the run's {name} config: {e}") from None

    run = {"dir": str(run_dir), "dataset": split.dataset or cfg.data.name, "shots": cfg.shots, "seed": cfg.seed,
           "top1": metrics.get("top1")}
    out = Path(out) if out is not None else run_dir / fmt.default_path
    try:
        meta = fmt.write(adapter, out, export_metadata(adapter, fmt, backbone_cfg=cfg.backbone, run=run), **options)
    except IsADirectoryError as e:  # -o FOLDER for a format that writes one file
        if e.filename is None or Path(e.filename) != out:
            raise
        raise ExportError(f"-o {out} is a folder; a {name} export is one file: give a file path, e.g. "
                          f"{out / Path(fmt.default_path).name}") from None
    return Exported(out, meta, name)

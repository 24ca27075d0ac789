"""What ``fewclip report`` shows and writes: which runs (methods, backbones, datasets, shots), under which names,
in which figure formats, with or without the LaTeX tables. Light (no torch), so ``fewclip report --help`` is
printed from these fields without loading any model code."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

FIGURE_FORMATS = ("png", "pdf", "svg")


@dataclass
class ReportOptions:
    methods: list[str] = field(default_factory=list, metadata={
        "help": "only these methods, by their run names (empty: every method); zeroshot is kept only if named"})
    rename: dict[str, str] = field(default_factory=dict, metadata={
        "help": "method -> the name the tables and figures show, e.g. {coop: CoOp, tip_adapter_f: Tip-Adapter-F}"})
    backbones: list[str] = field(default_factory=list, metadata={"help": "only these backbones (empty: all)"})
    datasets: list[str] = field(default_factory=list, metadata={"help": "only these datasets (empty: all)"})
    shots: list[int] = field(default_factory=list, metadata={
        "help": "only these shots (empty: all); zero-shot runs (0 shots) stay as the baseline"})
    format: list[str] = field(default_factory=lambda: ["png"], metadata={
        "help": "figure formats, any of png (200 dpi), pdf, svg"})
    latex: bool = field(default=True, metadata={
        "help": "also write report.tex: the tables in the layout of the CoOp / CoCoOp papers (booktabs)"})
    published: bool = field(default=True, metadata={
        "help": "beside runs that match a published result (`fewclip published`), show it and the gap in standard "
                "errors (report.md's Published results, published.csv)"})
    out: Optional[str] = field(default=None, metadata={
        "help": "folder to write the report into (default: the first run folder)"})

    def __post_init__(self) -> None:
        bad = [f for f in self.format if f not in FIGURE_FORMATS]
        if bad or not self.format:
            raise ValueError(f"format must list some of {', '.join(FIGURE_FORMATS)}, got {self.format}")
        if any(s < 0 for s in self.shots):
            raise ValueError(f"shots must be >= 0, got {self.shots}")

"""The frame: a core without import cycles, one registry for every kind, help from the config dataclasses."""
import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

from fewclip.adapter.base import ADAPTERS
from fewclip.backbones.geometry import GEOMETRIES
from fewclip.backbones.importer import FORMATS
from fewclip.config.compose import ConfigError
from fewclip.data.base import DATASETS
from fewclip.runs.launch import LAUNCHERS
from fewclip.runs.sweep import load_sweep_config
from fewclip.utils.registry import PluginError, Registry, UnknownNameError

ROOT = Path(__file__).resolve().parents[1]
# The installed names of the repository's folders (pyproject's package-dir).
PACKAGES = {"fewclip": "fewclip", "adapters": "fewclip.adapters", "datasets": "fewclip.datasets",
            "configs": "fewclip.configs"}
MAX_INNER_IMPORTS = 40  # imports inside functions: optional extras and measured start-up costs only


@functools.cache  # three tests read it; parsing every module takes a second
def module_graph():
    """{module: set of fewclip modules it imports}, counting imports inside functions too, and the number of
    those. ``from x import y`` names both ``x`` and, where it is a module, ``x.y``."""
    files = {}
    for folder, package in PACKAGES.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_pkg else parts)])
            files[name] = (path, is_pkg)
    graph, inner = {m: set() for m in files}, 0
    for mod, (path, is_pkg) in files.items():
        tree = ast.parse(path.read_text())
        functions = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        nested = {id(i) for f in functions for i in ast.walk(f) if isinstance(i, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            inner += id(node) in nested
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                if node.level:
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                names = [prefix] + [f"{prefix}.{a.name}" for a in node.names]
            for n in names:
                parts = n.split(".")
                for i in range(len(parts), 0, -1):
                    if ".".join(parts[:i]) in files:
                        if ".".join(parts[:i]) != mod:
                            graph[mod].add(".".join(parts[:i]))
                        break
    return graph, inner


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_and_few_imports_inside_functions():
    graph, inner = module_graph()
    assert not cycles(graph), cycles(graph)
    assert inner <= MAX_INNER_IMPORTS, f"{inner} imports inside functions (at most {MAX_INNER_IMPORTS})"


# The core's subpackages, bottom up: each imports only from its own layer and those below it (counting imports
# inside functions). `fewclip` itself (the Python API) and fewclip.version sit outside the layers.
LAYERS = ("utils", "data", "config", "backbones", "features", "adapter", "training", "runs", "report", "cli")
MAX_TOP_MODULES = 8


def test_each_layer_imports_only_from_the_layers_below_it():
    graph, _ = module_graph()
    rank = {name: i for i, name in enumerate(LAYERS)}

    def layer(module):
        parts = module.split(".")
        return parts[1] if len(parts) > 1 and parts[1] in rank else None

    upward = sorted(f"{m} -> {t}" for m in graph if layer(m) for t in graph[m]
                    if layer(t) and rank[layer(t)] > rank[layer(m)])
    assert upward == []
    assert {p.name for p in (ROOT / "fewclip").iterdir() if p.is_dir() and (p / "__init__.py").exists()} >= set(LAYERS)


def test_few_modules_at_the_top_of_the_package():
    top = sorted(p.name for p in (ROOT / "fewclip").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top


def test_importing_a_method_loads_no_run_or_sweep_machinery():
    """A method is a file over the contract: importing it must not pull in runs, records, locks, sweeps or
    reports (a plugin author's import stays small)."""
    code = ("import sys, fewclip.adapters.coop; "
            "print(sorted(m for m in sys.modules if m.startswith(('fewclip.runs', 'fewclip.report', "
            "'fewclip.utils.locks', 'fewclip.cli'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_old_module_names_still_resolve_with_a_warning():
    import warnings

    import fewclip.backbones

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load = fewclip.backbones.load_backbone
    from fewclip.backbones.backbone import load_backbone

    assert load is load_backbone
    assert any(issubclass(w.category, DeprecationWarning) and "fewclip.backbones.backbone" in str(w.message)
               for w in caught)
    with pytest.raises(AttributeError):
        fewclip.backbones.no_such_name  # noqa: B018


def test_the_core_imports_no_method_or_dataset_module():
    """Methods and datasets import the core; the core finds them through the registry (entry points)."""
    graph, _ = module_graph()
    core = [m for m in graph if not m.startswith(("fewclip.adapters", "fewclip.datasets"))]
    reaching = {m: sorted(t for t in graph[m] if t.startswith(("fewclip.adapters", "fewclip.datasets")))
                for m in core}
    assert {m: t for m, t in reaching.items() if t} == {}


def test_a_registry_names_close_matches_and_refuses_duplicates():
    reg = Registry("widget", "fewclip.test-widgets", key="widget.name", listing="fewclip widgets")
    reg.register("round", object())
    with pytest.raises(UnknownNameError, match=r"unknown widget 'rund' \(widget.name\); did you mean 'round'\? "
                                               r"registered: round \(`fewclip widgets` describes them\)"):
        reg.get("rund")
    with pytest.raises(ValueError, match="registered twice"):
        reg.register("round", object())
    with pytest.raises(ValueError, match="lowercase"):
        reg.register("Round", object())
    assert reg.names() == ["round"] and "round" in reg and len(reg) == 1


def test_every_kind_has_one_registry_with_entry_points():
    for reg, name, group in ((ADAPTERS, "coop", "fewclip.adapters"), (DATASETS, "toy-shapes", "fewclip.datasets"),
                             (GEOMETRIES, "hyperbolic", "fewclip.geometries"), (FORMATS, "meru", "fewclip.formats"),
                             (LAUNCHERS, "slurm", "fewclip.launchers")):
        assert isinstance(reg, Registry) and reg.group == group and name in reg


def test_a_broken_plugin_is_named(tmp_path, monkeypatch):
    """An entry point whose module cannot be imported is one error naming it, not a traceback or a silent skip."""
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[fewclip.test-broken]\nbroken = no_such_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget", "fewclip.test-broken")
    with pytest.raises(PluginError, match="the widget plugin 'broken' .no_such_module_anywhere.* Fix or uninstall"):
        reg.get("anything")


def test_each_launcher_has_its_own_config():
    assert type(load_sweep_config(["launcher=ray", "launcher.gpus_per_run=0.5"]).launcher).__name__ == "RayConfig"
    assert load_sweep_config(["launcher.workers=3"]).launcher.workers == 3  # local by default
    with pytest.raises(ConfigError, match="workers"):  # a local option is not a SLURM option
        load_sweep_config(["launcher=slurm", "launcher.workers=2"])
    with pytest.raises(ConfigError, match=r"unknown launcher 'slurn'.*did you mean 'slurm'"):
        load_sweep_config(["launcher=slurn"])


def test_help_comes_from_the_dataclasses_and_the_top_level_help_loads_no_torch():
    fewclip = Path(sys.executable).parent / "fewclip"
    out = subprocess.run([str(fewclip), "train", "--help"], capture_output=True, text=True, check=True).stdout
    assert "n_ctx: 16  # Number of context vectors" in out  # CoOpConfig's field metadata
    assert "epochs: null  # null = CoOp's schedule by shots" in out  # TrainConfig's
    code = "import sys, fewclip.cli.main; fewclip.cli.main.main(['--help']); print('torch' in sys.modules)"
    light = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert light.strip().endswith("False")


def _config_dataclasses():
    """Every config dataclass a command composes: the run, train, features, sweep, report and split trees with
    every section under them, every registered method's and launcher's section."""
    import dataclasses

    from fewclip.config.compose import FeaturesConfig, RunConfig
    from fewclip.config.report import ReportOptions
    from fewclip.config.sweep import SweepConfig
    from fewclip.data.split_files import SplitOptions
    from fewclip.runs.run import TrainRunConfig

    roots = [RunConfig, TrainRunConfig, FeaturesConfig, SweepConfig, ReportOptions, SplitOptions,
             *(info.config_cls for _, info in ADAPTERS.items()), *(LAUNCHERS.get(n).config_cls for n in LAUNCHERS.names())]
    seen, todo = [], list(roots)
    while todo:
        cls = todo.pop()
        if cls in seen:
            continue
        seen.append(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if dataclasses.is_dataclass(default):
                todo.append(type(default))
    return seen


def test_every_config_field_has_help():
    """Help is data: `fewclip COMMAND --help` prints each field's metadata help, so none may lack it."""
    import dataclasses

    classes = _config_dataclasses()
    assert len(classes) > 40  # the walk found the sections, not just the roots
    missing = [f"{c.__module__}.{c.__qualname__}.{f.name}" for c in classes for f in dataclasses.fields(c)
               if not str(f.metadata.get("help", "")).strip()]
    assert missing == []


def test_environment_variables_are_declared_once_and_listed_by_help():
    from fewclip.utils.env import VARIABLES

    spelled = {}
    for folder in PACKAGES:
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and node.value.startswith("FEWCLIP_") and node.value.isupper():
                    spelled.setdefault(node.value, set()).add(path.relative_to(ROOT).as_posix())
    assert {name: files for name, files in spelled.items() if files != {"fewclip/utils/env.py"}} == {}
    assert set(spelled) == {v.name for v in VARIABLES}
    out = subprocess.run([str(Path(sys.executable).parent / "fewclip"), "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert all(v.name in out for v in VARIABLES) and "environment:" in out


def test_a_command_is_declared_once():
    """Name, summary, usage, options and function: one record in fewclip.cli.table, and every record runs."""
    from fewclip.cli.main import COMMAND_NAMES, USAGE
    from fewclip.cli.table import COMMANDS

    assert COMMAND_NAMES == tuple(c.name for c in COMMANDS)
    for c in COMMANDS:
        assert f"  {c.name} " in USAGE and callable(c.function())
        assert c.usage or c.run_config, f"{c.name}: --help would print nothing"
        if c.options:
            assert dataclasses_fields(c.options_class())


def dataclasses_fields(cls):
    import dataclasses

    return dataclasses.fields(cls)


def test_long_work_without_a_terminal_is_never_silent(tmp_path):
    """Run with stderr to a pipe (as under nohup or SLURM), the log has a line at least every progress interval
    (here 1 s instead of 10 s, so the test is short): phases, encodings and training epochs with their loss."""
    import os
    import re
    import time

    env = {**os.environ, "FEWCLIP_PROGRESS_EVERY_S": "0.3", "FEWCLIP_CACHE": "off"}
    cmd = [str(Path(sys.executable).parent / "fewclip"), "train", "adapter=coop", "data=toy-shapes", "shots=16",
           "train.epochs=30", "train.augment_views=0", "data.max_test=400", f"out={tmp_path / 'run'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    start, stamps, lines = time.monotonic(), [], []
    for line in proc.stdout:
        stamps.append(time.monotonic() - start)
        lines.append(line.rstrip())
    assert proc.wait() == 0, "\n".join(lines[-20:])
    text = "\n".join(lines)
    assert "loading the backbone toy-clip" in text and "train coop: at " in text and "loss=" in text
    assert stamps[-1] - stamps[0] > 1.5, "the run was too short to say anything about gaps"
    # From the first line on (before it: Python's start-up), every gap longer than a few intervals ends with a line
    # of a watcher: a progress line whose phase advanced (a line is due at the end of the first unit of work after
    # the interval) or the heartbeat's (a thread that speaks while one unit is slow). Anything else ending a long gap
    # is a phase nobody watched. On a machine so busy that the heartbeat's thread itself waits for a core, the gap
    # still ends with its line; the bound, 10 s, holds whatever the load (checked at load 8).
    unit = re.compile(r"fewclip\.utils\.progress: (.+?): at (\d+)/\d+ ")
    done, ours = {}, [(s, line) for s, line in zip(stamps, lines) if " fewclip." in line]  # not torch's warnings
    stamps, lines = [s for s, _ in ours], [line for _, line in ours]
    for a, b, line in zip(stamps, stamps[1:], lines[1:]):
        m = unit.search(line)
        if b - a > 1.5:
            advanced = m and int(m.group(2)) > done.get(m.group(1), 0)
            assert advanced or "fewclip.utils.heartbeat: " in line, (f"{b - a:.1f} s of silence before: {line}", text)
        if m:
            done[m.group(1)] = int(m.group(2))
    assert max(b - a for a, b in zip(stamps, stamps[1:])) < 10, text  # the bound, whatever the load


def test_a_sweep_s_time_to_go_is_learnt_from_the_runs_done():
    from fewclip.runs.launch.progress import time_to_go

    assert time_to_go(["coop"] * 3, {}, 0.0, 5.0) != time_to_go(["coop"] * 3, {}, 0.0, 5.0)  # nan: no evidence yet
    walls = {"zeroshot": [1.0], "coop": [10.0, 14.0]}
    # two runs at once: 25 s of run time in 12.5 s; left: 2 CoOp runs (12 s each) and one LoRA (no run yet: the
    # mean over all, 25/3 s)
    assert time_to_go(["coop", "coop", "lora"], walls, busy_s=25.0, elapsed_s=12.5) == pytest.approx(
        (12 + 12 + 25 / 3) / 2)
    # a slow start (loading, 30 s before the first result) is the launcher's overhead, not each run's
    assert time_to_go(["coop"] * 10, {"coop": [2.0]}, busy_s=2.0, elapsed_s=32.0) == pytest.approx(10 * 2.0 * 16)


def _dist(tmp_path, name: str, group: str, entry: str, module: str, source: str) -> None:
    """A package installed as a folder on sys.path with its dist-info: what pip leaves behind."""
    (tmp_path / f"{module}.py").write_text(source)
    info = tmp_path / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{entry} = {module}\n")


GEOMETRY_PLUGIN = '''
from fewclip.backbones.geometry import CLIPGeometry, register_geometry


@register_geometry
class DoubledCosine(CLIPGeometry):
    """The cosine at twice the scale (a test plugin)."""

    name = "doubled_cosine"

    def _similarity(self, img, proto):
        return 2 * super()._similarity(img, proto)
'''

LAUNCHER_PLUGIN = '''
from dataclasses import dataclass, field

from fewclip.runs.launch import Launcher, LauncherConfig, register_launcher
from fewclip.runs.launch.worker import execute_run


@dataclass
class ReversedConfig(LauncherConfig):
    name: str = "reversed"
    note: str = field(default="", metadata={"help": "a launcher option of its own"})


def run(cfg, specs, progress, *, out, context=None, poll_s=1.0):
    for spec in reversed(specs):  # the last run first, in this process
        progress.finished(execute_run(spec, wait=True))


register_launcher(Launcher("reversed", ReversedConfig, run, lambda cfg: "this process, last run first"))
'''


def test_a_geometry_and_a_launcher_from_outside(tmp_path, monkeypatch, capsys):
    """Packages on the path that declare a geometry and a launcher: fewclip finds them through the entry
    points, builds the geometry by name and runs a sweep with the launcher, with no edit to fewclip."""
    import torch

    from fewclip.backbones.geometry import make_geometry
    from fewclip.cli.main import main

    _dist(tmp_path, "doubled-geometry", "fewclip.geometries", "doubled_cosine", "fc_test_geometry", GEOMETRY_PLUGIN)
    _dist(tmp_path, "reversed-launcher", "fewclip.launchers", "reversed", "fc_test_launcher", LAUNCHER_PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        GEOMETRIES.refresh()
        LAUNCHERS.refresh()
        g, c = make_geometry("doubled_cosine", logit_scale=10.0), make_geometry("clip", logit_scale=10.0)
        x, p = torch.randn(3, 8), torch.randn(4, 8)
        assert torch.allclose(g.image_logits(x, c.embed_text(p)), 2 * c.image_logits(x, c.embed_text(p)))
        assert GEOMETRIES.source("doubled_cosine") == "fc_test_geometry"
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text("sweep:\n  datasets: [toy-shapes]\n  methods: [zeroshot, tip_adapter]\n  shots: [1]\n"
                         "  seeds: [1]\n  args: [data.max_test=16]\n")
        out = tmp_path / "out"
        assert main(["sweep", str(sweep), f"out={out}", "launcher=reversed", "launcher.note=hi",
                     "feature_store=off"]) == 0
        text = capsys.readouterr()
        assert "sweep: 2 runs, 0 already done, 2 ran" in text.out
        assert "this process, last run first" in text.err
    finally:
        GEOMETRIES.pop("doubled_cosine", None)
        LAUNCHERS.pop("reversed", None)

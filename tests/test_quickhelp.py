"""`fewclip COMMAND --help` without torch (issue 21, item 6): the config sections are torch-free dataclasses and a
built-in method's section comes from the committed adapter index, which must match the methods' own code."""
import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from fewclip.adapter import index as adapter_index
from fewclip.adapter.base import ADAPTERS
from fewclip.cli import commands, light, quickhelp
from fewclip.cli.main import COMMAND_NAMES, main

ROOT = Path(__file__).resolve().parents[1]


def full_help(command, args):
    """The help printed by the command itself, which imports the methods and launchers."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert commands.config_help(command, [*args, "--help"]) == 0
    return out.getvalue().rstrip("\n")


def quick_help(command, args):
    lines = quickhelp.help_lines(command, [*args, "--help"])
    assert lines is not None, f"{command} {args}: the quick help fell back to importing the methods"
    return "\n".join(lines)


def test_the_committed_adapter_index_is_current():
    committed = json.loads(adapter_index.INDEX_FILE.read_text())
    assert committed == json.loads(json.dumps(adapter_index.build_index())), (
        "fewclip/adapter/index.json is out of date with the methods' code: run `python -m fewclip.adapter.index`")
    builtin = {n for n, i in ADAPTERS.items() if i.adapter_cls.__module__.startswith("fewclip.adapters.")}
    assert set(committed["methods"]) == builtin


@pytest.mark.parametrize("name", sorted(json.loads(adapter_index.INDEX_FILE.read_text())["methods"]))
def test_each_method_s_quick_help_equals_its_own(name):
    assert quick_help("train", [f"adapter={name}"]) == full_help("train", [f"adapter={name}"])


@pytest.mark.parametrize("command,args", [
    ("train", []),
    ("train", ["adapter=coop", "adapter.n_ctx=4", "train.lr=1e-3", "shots=4", "data=toy-colours"]),
    ("train", ["adapter=tip_adapter_f", "train.epochs=3"]),
    ("train", ["adapter/coop-init.yaml"]),
    ("zeroshot", []),
    ("features", []),
    ("sweep", []),
    ("sweep", ["sweep/demo.yaml"]),
    ("sweep", ["launcher=slurm", "launcher.partition=gpu"]),
    ("sweep", ["launcher=ray"]),
])
def test_quick_help_with_arguments_equals_the_command_s_own(command, args):
    assert quick_help(command, args) == full_help(command, args)


def test_an_index_of_other_sources_is_not_used(tmp_path, monkeypatch):
    stale = json.loads(adapter_index.INDEX_FILE.read_text())
    stale["fingerprint"] = "0" * 64
    path = tmp_path / "adapter_index.json"
    path.write_text(json.dumps(stale))
    assert adapter_index.load_index(path) is None
    monkeypatch.setattr(quickhelp, "load_index", lambda: None)
    assert quickhelp.help_lines("train", ["--help"]) is None  # the command then imports the methods


def test_a_method_or_launcher_outside_the_index_falls_back_to_the_registries(capsys):
    assert quickhelp.help_lines("train", ["adapter=no_such_method", "--help"]) is None
    assert quickhelp.help_lines("sweep", ["launcher=no_such_launcher", "--help"]) is None
    assert main(["train", "adapter=coopp", "--help"]) == 2  # the registry's error, one line
    err = capsys.readouterr().err
    assert "unknown adapter 'coopp'" in err and "did you mean 'coop'" in err and len(err.strip().splitlines()) == 1


def test_the_adapter_listing_from_the_index_equals_the_methods_own(capsys, monkeypatch):
    """`fewclip adapters` prints the built-in methods from the index, the same text as from the methods."""
    assert commands.cmd_adapters([]) == 0
    own = capsys.readouterr().out
    monkeypatch.setattr(commands, "cmd_adapters", lambda args: pytest.fail("the listing imported the methods"))
    assert light.cmd_adapters([]) == 0
    assert capsys.readouterr().out == own and "coop: " in own and "presets: fewclip, " in own


def test_the_adapter_listing_imports_the_methods_for_a_plugin_a_name_or_a_stale_index(monkeypatch):
    calls = []
    monkeypatch.setattr(commands, "cmd_adapters", lambda args: calls.append(list(args)) or 0)
    light.cmd_adapters(["coop"])  # one method in detail: its presets field by field
    plugin = type("EntryPoint", (), {"name": "mine", "value": "my_pkg.methods"})()
    with monkeypatch.context() as m:
        m.setattr(light, "plugin_entry_points", lambda group: [plugin])
        light.cmd_adapters([])
    with monkeypatch.context() as m:
        m.setattr(light, "load_index", lambda: None)
        light.cmd_adapters([])
    assert calls == [["coop"], [], []]


def test_the_listings_import_no_torch():
    code = ("import sys; from fewclip.cli.main import main; assert main(['adapters']) == 0; "
            "assert main(['datasets']) == 0; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'open_clip', 'torchvision')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "tip_adapter_f: " in out and out.strip().splitlines()[-1] == "[]", out[-300:]


@pytest.mark.parametrize("command", COMMAND_NAMES)
def test_no_command_s_help_imports_torch(command):
    code = ("import sys; from fewclip.cli.main import main; main([sys.argv[1], '--help']); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'open_clip', 'torchvision')))")
    out = subprocess.run([sys.executable, "-c", code, command], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]", f"`fewclip {command} --help` imported {out.splitlines()[-1]}"


def test_every_package_folder_is_installed():
    """pyproject's package list names every folder with an __init__.py (a non-editable install has only those)."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    installed = set(tool["packages"])
    for package, folder in tool["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            parts = init.parent.relative_to(ROOT / folder).parts
            assert ".".join([package, *parts]) in installed, f"{init.parent} is missing from pyproject's packages"
    assert "index.json" in tool["package-data"]["fewclip.adapter"]

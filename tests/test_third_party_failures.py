"""Code fewclip does not own failing inside a fewclip command: a plugin whose import exits or raises, a logging
back end that is installed but broken. Each is one message naming the culprit (a plugin: exit 2, as a bad
install), never a silent exit with the plugin's code, and logging never stops a run."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fewclip.utils.registry import PluginError, Registry


def plugin_dist(root: Path, group: str, body: str, name: str = "exits_on_import") -> Path:
    """A package ``name`` installed (as metadata on the path) with one entry point in ``group``."""
    dist = root / f"{name}-0.1.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[{group}]\n{name} = {name}\n")
    (root / f"{name}.py").write_text(body)
    return root


@pytest.mark.parametrize("body, what", [
    ("import sys\nsys.exit(3)\n", "called sys.exit(3)"),
    ("raise SystemExit('bye')\n", "called sys.exit('bye')"),
    ("raise RuntimeError('no GPU here')\n", "RuntimeError: no GPU here"),
    ("def register():\n    raise KeyError('x')\n", "KeyError"),
])
def test_a_plugin_that_exits_or_raises_is_named(tmp_path, monkeypatch, body, what):
    if "register" in body:  # an entry point naming a callable
        root = plugin_dist(tmp_path, "fewclip.test-exits", body)
        ep = root / "exits_on_import-0.1.dist-info" / "entry_points.txt"
        ep.write_text("[fewclip.test-exits]\nexits_on_import = exits_on_import:register\n")
    else:
        plugin_dist(tmp_path, "fewclip.test-exits", body)
    monkeypatch.syspath_prepend(str(tmp_path))
    reg = Registry("widget", "fewclip.test-exits")
    with pytest.raises(PluginError) as e:
        reg.get("anything")
    assert str(e.value).startswith("the widget plugin 'exits_on_import' (exits_on_import")
    assert what in str(e.value) and "Fix or uninstall the package that provides it" in str(e.value)
    sys.modules.pop("exits_on_import", None)


def check_one_line_naming_the_plugin(code, stderr):
    assert code == 2, (code, stderr)
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("fewclip adapters: error: the adapter plugin 'exits_on_import'")
    assert "called sys.exit(3)" in lines[0] and "Fix or uninstall" in lines[0]


def test_a_plugin_calling_sys_exit_does_not_end_a_command_silently(tmp_path, monkeypatch, capsys):
    """Such a plugin installed as a method, `fewclip adapters` in this process: one line naming it, exit 2, not 3
    (and no SystemExit out of main)."""
    from fewclip.adapter.base import ADAPTERS
    from fewclip.cli.main import main

    plugin_dist(tmp_path, "fewclip.adapters", "import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FEWCLIP_DEBUG", "0")
    monkeypatch.setattr(ADAPTERS, "_loaded", False)  # look at the entry points again, as a fresh process does
    try:
        code = main(["adapters"])
    finally:
        sys.modules.pop("exits_on_import", None)
    check_one_line_naming_the_plugin(code, capsys.readouterr().err)


@pytest.mark.slow  # the same in this process: test_a_plugin_calling_sys_exit_does_not_end_a_command_silently
def test_a_plugin_calling_sys_exit_does_not_end_commands_silently(tmp_path):
    """The real command line with such a plugin installed as a method: one line naming it, exit 2, not 3."""
    plugin_dist(tmp_path, "fewclip.adapters", "import sys\nsys.exit(3)\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "FEWCLIP_DEBUG": "0"}
    p = subprocess.run([sys.executable, "-m", "fewclip.cli.main", "adapters"], env=env, capture_output=True, text=True,
                       timeout=300)
    check_one_line_naming_the_plugin(p.returncode, p.stderr)


# (An installed wandb whose import raises something else than ImportError breaks timm's own `import wandb`, and so
# open_clip's import, before fewclip runs: not fewclip's to catch.)
@pytest.mark.parametrize("backend, body", [
    ("wandb", "from google.protobuf import no_such_name_in_this_version\n"),
    ("tensorboard", "raise RuntimeError('tensorboard built for another numpy')\n"),
    ("tensorboard", "import sys\nsys.exit(1)\n"),
])
def test_a_broken_logging_library_is_one_warning_and_the_run_goes_on(backend, body, tmp_path, monkeypatch, capsys):
    """Installed, but its import fails: not 'unexpected ... a bug in fewclip' and a stopped run; one warning."""
    from fewclip.cli.main import main
    from fewclip.utils import explog

    (tmp_path / "libs" / backend).mkdir(parents=True)
    (tmp_path / "libs" / backend / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path / "libs"))
    for name in [m for m in sys.modules if m == backend or m.startswith(backend + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(explog, "_BROKEN", {})
    out = tmp_path / "run"
    argv = ["train", "adapter=linear_probe", "data=toy-shapes", "shots=1", "seed=1", "data.max_test=8",
            "backbone.device=cpu", f"log={backend}", f"out={out}"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if f"log={backend}: importing {backend} failed" in line]
    assert len(said) == 1 and "the runs go on without it" in said[0] and "Traceback" not in err, err
    assert (out / "metrics.json").is_file() and not (out / backend).exists()
    assert main(argv) == 0  # the same run again in this process (finished): nothing said twice
    assert f"importing {backend} failed" not in capsys.readouterr().err



@pytest.mark.parametrize("body, what", [
    ("raise RuntimeError('built for another Python')\n", "RuntimeError: built for another Python"),
    ("import cloudpickle_of_another_name_entirely\n", "No module named 'cloudpickle_of_another_name_entirely'"),
])
def test_a_broken_launcher_library_is_named_not_a_bug_in_fewclip(tmp_path, monkeypatch, body, what):
    """A sweep cannot run without its launcher's library: an error (exit 2) naming it and the reinstall."""
    from fewclip.runs.launch.base import LauncherError, require_extra
    from fewclip.utils.errors import describe

    (tmp_path / "submitit").mkdir()
    (tmp_path / "submitit" / "__init__.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "submitit" or m.startswith("submitit.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(LauncherError) as e:
        require_extra("slurm")
    message, code = describe(e.value)
    assert code == 2 and message.startswith("launcher=slurm: submitit is installed but fails to import (")
    assert what in message and 'pip install --force-reinstall "fewclip[slurm]"' in message

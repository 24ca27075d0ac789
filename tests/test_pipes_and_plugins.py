"""A plugin that claims a name fewclip already has, and commands whose output pipe closes early (issue 36, item 8)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fewclip.utils import registry as registry_module
from fewclip.utils.registry import PluginError, Registry


class _EntryPoint:
    """What importlib.metadata gives: a name, a value and a load() that imports (here: registers)."""

    def __init__(self, name, value, register):
        self.name, self.value, self._register = name, value, register

    def load(self):
        self._register()
        return object()


@pytest.mark.parametrize("plugin_first", [True, False])
def test_a_plugin_claiming_a_builtin_name_is_blamed_whatever_the_order(monkeypatch, plugin_first):
    reg = Registry("adapter", "fewclip.test-clash", key="adapter.name")
    builtin = _EntryPoint("builtin", "fewclip.adapters", lambda: reg.register("coop", object(),
                                                                             source="fewclip.adapters.coop"))
    plugin = _EntryPoint("mine", "my_pkg.coop", lambda: reg.register("coop", object(), source="my_pkg.coop"))
    eps = [plugin, builtin] if plugin_first else [builtin, plugin]
    monkeypatch.setattr(registry_module, "entry_points_of", lambda group: eps)
    with pytest.raises(PluginError) as err:
        reg.load()
    message = str(err.value)
    assert "the plugin module my_pkg.coop registers it again" in message and "'mine'" in message
    assert "fewclip.adapters.coop" not in message  # fewclip's own method is never the one blamed


def test_a_plugin_imported_before_fewclip_s_own_is_still_the_one_blamed():
    """The plugin registered first (its module imported directly): fewclip's registration names the plugin."""
    reg = Registry("adapter", "fewclip.test-clash2")
    reg.register("coop", object(), source="my_pkg.coop")
    with pytest.raises(ValueError, match=r"the plugin module my_pkg\.coop registers it again: rename it"):
        reg.register("coop", object(), source="fewclip.adapters.coop")


@pytest.mark.parametrize("args", [["--help"], ["adapters"], ["datasets"], ["train", "--help"]])
def test_a_closed_pipe_ends_a_command_quietly_with_exit_0(args):
    """`fewclip --help | head -1`: the reader leaves after one line; fewclip says nothing more and exits 0."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    exe = str(Path(sys.executable).parent / "fewclip")
    for _ in range(2):  # it used to fail in 3 or 4 of 4 tries
        proc = subprocess.Popen([exe, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        proc.stdout.readline()
        proc.stdout.close()  # what `head -1` does after its line
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 0, err
        assert "BrokenPipe" not in err and "Traceback" not in err and "Exception ignored" not in err, err

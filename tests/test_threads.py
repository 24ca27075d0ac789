"""fewclip chooses each process's CPU threads (issue 36, item 5): cores / workers unless the user chose."""
from __future__ import annotations

import json

import pytest

from fewclip.utils import threads


def test_the_choice_is_cores_per_worker_unless_the_user_chose(monkeypatch):
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads.choose() == (8, "8 core(s)")
    assert threads.choose(workers=3) == (2, "8 core(s) / 3 workers")
    assert threads.choose(workers=16)[0] == 1  # never 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert threads.choose(workers=4) == (3, "OMP_NUM_THREADS")
    assert threads.choose(workers=4, setting=5) == (5, "threads=")  # the config key wins over the environment
    monkeypatch.setenv("OMP_NUM_THREADS", "lots")  # not a number: ignored, as OpenMP would
    assert threads.choose(workers=2) == (4, "8 core(s) / 2 workers")


def test_a_run_prints_and_records_its_threads(tmp_path, monkeypatch, capfd):
    import torch

    from fewclip.cli.main import main

    before = torch.get_num_threads()
    monkeypatch.setitem(threads._chosen, "n", None)  # this process has not chosen yet
    monkeypatch.setenv("FEWCLIP_CACHE", "off")
    try:
        assert main(["zeroshot", "data=toy-shapes", "data.max_test=16", "threads=1", f"out={tmp_path / 'zs'}"]) == 0
        first = next(line for line in capfd.readouterr().err.splitlines() if " fewclip." in line)
        assert "fewclip.runs.run: run " in first and "1 CPU thread(s) (threads=)" in first, first
        metrics = json.loads((tmp_path / "zs" / "metrics.json").read_text())
        assert metrics["threads"] == 1 and metrics["threads_chosen_by"] == "threads="
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        threads._chosen.update(n=None, by=None)


def test_threads_are_not_part_of_a_run_s_identity():
    from fewclip.config.compose import RunConfig
    from fewclip.runs.records import config_dict

    assert config_dict(RunConfig(threads=3)) == config_dict(RunConfig())
    with pytest.raises(ValueError, match="threads must be >= 0"):
        RunConfig(threads=-1)

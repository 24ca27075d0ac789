"""A full disk, a read-only store, a kill during a write: what fewclip says is what happened, and it leaves
nothing behind that a later command does not clean up."""
import errno
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from fewclip.cli.main import main
from fewclip.runs import records
from fewclip.runs.launch.worker import RunLogFile, run_log

TINY_SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, linear_probe]
  shots: [1]
  seeds: [1, 2]
  args: [data.max_test=8, backbone.device=cpu]
"""


class FullDisk:
    """A file on a full disk: writes are buffered, every flush and the close fail with ENOSPC."""

    def __init__(self, path=None):
        self.name, self.buffer, self.closed = str(path), [], False

    def write(self, s):
        self.buffer.append(s)
        return len(s)

    def flush(self):
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self):
        self.closed = True
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture
def terminal(monkeypatch):
    """No handler on the root logger but pytest's own (caplog): a terminal handler that an earlier command line
    left on a closed capture stream would print errors of its own."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def said(caplog, words="could not be written"):
    """The warnings about a log file that reached the root logger's handlers (the terminal)."""
    return [r.getMessage() for r in caplog.records if words in r.getMessage() and r.levelno == logging.WARNING]


def full_disk_open(self):
    return FullDisk(self.baseFilename)


def test_the_run_log_on_a_full_disk_says_it_once_and_never_raises(tmp_path, capsys, caplog, monkeypatch, terminal):
    monkeypatch.setattr(RunLogFile, "_open", full_disk_open)
    path = tmp_path / "run.log"
    with run_log(path, "info"):
        for i in range(20):
            logging.getLogger("fewclip.training.engine").info("step %d", i)
        logging.getLogger("fewclip.training.engine").error("a failure with its trace", exc_info=(OSError, OSError(5), None))
    err = capsys.readouterr().err
    assert "Traceback" not in err and "Logging error" not in err, err
    (line,) = said(caplog)
    assert line == f"log file {path} could not be written: disk full (or quota exceeded); the run goes on without its log"
    # the error record still reached the terminal (warnings and up are echoed), once
    assert [r.getMessage() for r in caplog.records].count("a failure with its trace") == 1


def test_closing_a_log_whose_last_lines_cannot_be_written_does_not_raise(tmp_path, capsys, caplog, terminal):
    h = RunLogFile(tmp_path / "run.log")
    h.stream = FullDisk()  # the lines sit in the buffer; only the flush in close() finds the disk full
    h.stream.flush = lambda: None
    h.emit(logging.LogRecord("fewclip", logging.INFO, __file__, 1, "last line", None, None))
    stream = h.stream
    h.close()  # a worker process closing its handler after the run: it used to die here
    assert stream.closed
    assert "Traceback" not in capsys.readouterr().err
    assert len(said(caplog, "could not be written: disk full")) == 1


def test_a_log_folder_that_cannot_be_opened_does_not_stop_the_run(tmp_path, capsys, caplog, terminal):
    path = tmp_path / "no_such_folder" / "run.log"
    with run_log(path, "info"):
        logging.getLogger("fewclip.training.engine").warning("still said")
    assert "Traceback" not in capsys.readouterr().err
    (line,) = said(caplog)
    assert line.startswith(f"log file {path} could not be written: No such file or directory")
    assert "still said" in [r.getMessage() for r in caplog.records]


def test_a_sweep_on_a_full_disk_logs_no_traces_and_finishes(tmp_path, capsys, monkeypatch):
    """Only the logs are on the full disk here (the results' writes are covered by test_cli_errors): every run
    finishes, each log's failure is one line, and logging's own traces never reach the terminal."""
    monkeypatch.setattr(RunLogFile, "_open", full_disk_open)
    spec = tmp_path / "s.yaml"
    spec.write_text(TINY_SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}", "report=false"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "Traceback" not in err and "Logging error" not in err, err
    said = [line for line in err.splitlines() if "could not be written: disk full" in line]
    assert len(said) == 3, err  # one per run: zero-shot once, the linear probe at two seeds
    assert len(list(out.rglob("metrics.json"))) == 3
    assert "3 ran" in captured.out


# ---------------------------------------------------------------- fewclip cache clear on a read-only store


def read_only(monkeypatch, under: Path, code: int = errno.EROFS):
    """Removing anything under ``under`` fails as on a read-only mount (or a folder without write permission:
    the tests run as root, for whom permissions do not stop a removal). shutil.rmtree removes names relative to
    an open folder; /proc names that folder."""
    def guard(real):
        def call(path, *args, dir_fd=None, **kwargs):
            base = os.readlink(f"/proc/self/fd/{dir_fd}") if dir_fd is not None else ""
            if os.path.join(base, os.fsdecode(path)).startswith(str(under)):
                raise OSError(code, os.strerror(code), os.fsdecode(path))
            return real(path, *args, dir_fd=dir_fd, **kwargs)
        return call

    monkeypatch.setattr(os, "unlink", guard(os.unlink))
    monkeypatch.setattr(os, "rmdir", guard(os.rmdir))


@pytest.fixture
def two_groups(tmp_path, feature_store):
    """A store holding the test features of two datasets (two groups)."""
    for data in ("toy-shapes", "toy-colours"):
        assert main(["zeroshot", "backbone=toy-clip", "backbone.device=cpu", f"data={data}", "data.max_test=8",
                     f"out={tmp_path / data}"]) == 0
    groups = sorted(p for p in (feature_store / "v3").iterdir() if p.is_dir())
    assert len(groups) == 2
    return groups


def shards(feature_store: Path):
    return sorted(feature_store.rglob("*.safetensors"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open folder through /proc")
def test_cache_clear_on_a_read_only_store_says_it_removed_nothing(two_groups, feature_store, capsys, monkeypatch):
    before = shards(feature_store)
    capsys.readouterr()
    read_only(monkeypatch, feature_store)
    assert main(["cache", "clear"]) == 1
    out, err = capsys.readouterr()
    assert "removed" not in out and "Traceback" not in err
    (line,) = err.splitlines()
    assert line.startswith("fewclip cache: error: could not remove 2 feature group(s), ")
    assert f"from {feature_store}: Read-only file system ({feature_store}" in line
    assert "clear it where it is mounted read-write" in line and "dir= (FEWCLIP_CACHE)" in line
    assert shards(feature_store) == before  # nothing was removed, and nothing said it was


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="names an open folder through /proc")
def test_cache_clear_that_removes_part_says_which_part(two_groups, feature_store, capsys, monkeypatch):
    kept, gone = two_groups
    capsys.readouterr()
    with monkeypatch.context() as m:
        read_only(m, kept, errno.EACCES)
        assert main(["cache", "clear"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("removed 1 feature group(s), ") and f"from {feature_store}" in out
    (line,) = err.splitlines()
    assert line.startswith("fewclip cache: error: could not remove 1 feature group(s), ")
    assert f": Permission denied ({kept}" in line and "chmod u+w" in line
    assert not gone.exists() and shards(feature_store) and all(kept in p.parents for p in shards(feature_store))
    # writable again: the rest goes, and the command says so
    assert main(["cache", "clear"]) == 0
    assert capsys.readouterr().out.startswith("removed 1 feature group(s), ") and not shards(feature_store)


# ---------------------------------------------------------------- a kill during safetensors' own write

KILLED_WRITE = """\
import resource, signal, sys, torch
from safetensors.torch import save_file
signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; by default the kernel's signal kills
resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))  # the kernel kills us (SIGXFSZ) mid-write
save_file({"x": torch.ones(1 << 20)}, sys.argv[1])
"""


def test_the_temporary_file_of_a_killed_safetensors_write_is_removed_by_the_next_run(tmp_path, capsys):
    """safetensors writes its own temporary file (".tmp" and 6 characters, beside the target) and renames it when
    complete; a process killed during that write left it in the run folder for good."""
    run = tmp_path / "run"
    train = ["train", "adapter=linear_probe", "data=toy-shapes", "shots=1", "seed=1", "data.max_test=8",
             "backbone.device=cpu", f"out={run}"]
    assert main(train) == 0
    finished = sorted(p.name for p in run.iterdir())
    p = subprocess.run([sys.executable, "-c", KILLED_WRITE, str(run / ".adapter.safetensors.abcd1234.tmp")],
                       capture_output=True, timeout=300)
    assert p.returncode == -signal.SIGXFSZ, p.stderr  # killed by the kernel during safetensors' write
    left = sorted(set(p.name for p in run.iterdir()) - set(finished))
    assert len(left) == 1 and re.fullmatch(r"\.tmp[A-Za-z0-9]{6}", left[0]), left  # safetensors' own name
    assert records.is_leftover(left[0])
    capsys.readouterr()
    assert main(train) == 0  # the same run again: finished already, and its folder tidied under its lock
    assert sorted(p.name for p in run.iterdir()) == finished
    assert not records.is_leftover("adapter.safetensors") and not records.is_leftover(".tmpdir_of_mine")

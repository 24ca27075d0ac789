"""fewclip.runs.records on its own: run identity, the finished-run record, run locks and clean-up."""
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from fewclip.runs import records
from fewclip.runs.records import (
    RECORD_KEY,
    RunExistsError,
    RunLock,
    RunLockedError,
    check_finite,
    claim_run,
    clear_run,
    config_changes,
    open_run,
    remove_leftovers,
    run_identity,
    run_state,
)
from fewclip.utils import locks
from fewclip.utils.errors import NonFiniteError
from fewclip.utils.io import atomic_write, atomic_write_text


@dataclass
class Section:
    name: str = "toy"
    workers: int = 0
    lr: float = 0.002


@dataclass
class Cfg:
    data: Section = field(default_factory=Section)
    out: str = "runs/a"
    log_level: str = "info"
    seed: int = 1


DATA = {"dataset": "toy", "classnames": ["a", "b"], "templates": ["a {}."], "test": [["x", 0], ["y", 1]]}


def ident(cfg=None, weights="file:abc", data=None):
    return run_identity(cfg or Cfg(), weights, data or DATA)


# ---------------------------------------------------------------- identity


def test_identity_covers_config_weights_and_data_but_not_where_or_how():
    base = ident()
    assert base == ident() and len(base.digest) == 64
    # Where results go, how verbose and how parallel: not part of what a run is.
    assert ident(Cfg(out="elsewhere", log_level="debug", data=Section(workers=8))) == base
    changed = {
        "config": ident(Cfg(seed=2)),
        "nested config": ident(Cfg(data=Section(lr=0.1))),
        "weights": ident(weights="file:abd"),
        "data": ident(data={**DATA, "test": [["x", 0]]}),
        "class names": ident(data={**DATA, "classnames": ["a", "c"]}),
    }
    for what, other in changed.items():
        assert other.digest != base.digest, what
    assert changed["weights"].parts["config"] == base.parts["config"]  # the parts say what changed
    assert changed["weights"].parts["weights"] != base.parts["weights"]


def test_config_changes_names_the_keys():
    old = {"train": {"epochs": 1, "lr": 0.002}, "seed": 1}
    new = {"train": {"epochs": 2, "lr": 0.002}, "seed": 3, "shots": 4}
    assert config_changes(old, new) == "seed: 1 -> 3, shots: (unset) -> 4, train.epochs: 1 -> 2"
    assert config_changes(old, new, limit=1) == "seed: 1 -> 3 and 2 more"


# ---------------------------------------------------------------- finite checks


def test_check_finite_names_the_bad_value():
    check_finite({"top1": 50.0, "per_class": {"a": None, "b": 1.0}, "loss_curve": [0.5, 0.25]},
                 {"ctx": torch.zeros(2, 3), "ids": torch.arange(3)})
    with pytest.raises(NonFiniteError, match=r"loss_curve\[1\] = nan"):
        check_finite({"top1": 50.0, "loss_curve": [0.5, float("nan")]})
    with pytest.raises(NonFiniteError, match=r"per_class.b = inf"):
        check_finite({"per_class": {"a": 1.0, "b": float("inf")}})
    ctx = torch.zeros(4, 2)
    ctx[1, 1] = float("nan")
    with pytest.raises(NonFiniteError, match=r"adapter tensor 'ctx' holds 1 non-finite"):
        check_finite({"top1": 1.0}, {"ctx": ctx})


# ---------------------------------------------------------------- the record


def finish(run_dir, identity, metrics=None, files=("config.yaml", "adapter.bin"), overwrite=False):
    """A finished run written the way run_train writes one."""
    with open_run(run_dir, identity, overwrite=overwrite) as run:
        assert not run.done
        atomic_write_text(run_dir / "config.yaml", "seed: 1\n")
        atomic_write(run_dir / "adapter.bin", lambda tmp: open(tmp, "wb").write(b"\x00\x01"))
        run.finish(metrics or {"top1": 42.0}, files=list(files))
    return run_dir


def test_run_state_kinds(tmp_path):
    me = ident()
    d = tmp_path / "run"
    assert run_state(d, me).kind == "missing"
    finish(d, me)
    state = run_state(d, me)
    assert state.finished and state.metrics["top1"] == 42.0 and RECORD_KEY in state.metrics
    assert run_state(d).finished  # without an identity: only the record's own checks
    assert not (d / locks.LOCK_FILE).exists()  # released

    other = ident(Cfg(seed=2))
    state = run_state(d, other)
    assert state.kind == "changed" and state.holds_results and "config changed" in state.reason

    (d / "adapter.bin").write_bytes(b"\x00\x02")  # a file changed after the run finished
    state = run_state(d, me)
    assert state.kind == "modified" and "adapter.bin changed" in state.reason

    finish(d, me, overwrite=True)
    m = json.loads((d / "metrics.json").read_text())
    m["top1"] = 99.0  # numbers edited by hand
    (d / "metrics.json").write_text(json.dumps(m))
    assert "edited" in run_state(d, me).reason

    m.pop(RECORD_KEY)  # an older fewclip's run
    (d / "metrics.json").write_text(json.dumps(m))
    state = run_state(d, me)
    assert state.kind == "legacy" and state.holds_results

    (d / "metrics.json").write_text('{"top1": 4')  # truncated
    state = run_state(d, me)
    assert state.kind == "unreadable" and not state.holds_results


def test_changed_config_is_explained_from_the_old_config_yaml(tmp_path):
    d = tmp_path / "run"
    cfg1, cfg2 = Cfg(data=Section(lr=0.1)), Cfg(data=Section(lr=0.2))
    with open_run(d, ident(cfg1)) as run:
        atomic_write_text(d / "config.yaml", "data:\n  name: toy\n  workers: 0\n  lr: 0.1\nout: x\nlog_level: info\n"
                                             "seed: 1\n")
        run.finish({"top1": 1.0}, files=["config.yaml"])
    assert run_state(d, ident(cfg2)).reason == "config changed (data.lr: 0.1 -> 0.2)"
    assert "backbone weights changed" in run_state(d, ident(cfg1, weights="file:zzz")).reason
    assert "data changed" in run_state(d, ident(cfg1, data={**DATA, "templates": []})).reason


def test_open_run_keeps_refuses_or_overwrites(tmp_path):
    me, other = ident(), ident(Cfg(seed=2))
    d = finish(tmp_path / "run", me)
    (d / "notes.txt").write_text("mine")
    (d / "prompts.safetensors").write_text("exported from the old run")
    with open_run(d, me) as run:  # the same run: kept, nothing to write
        assert run.done and run.metrics["top1"] == 42.0
    with pytest.raises(RunExistsError, match="overwrite=true"):
        with open_run(d, other):
            pass
    assert run_state(d, me).finished  # refused: untouched
    with open_run(d, other, overwrite=True) as run:
        assert not run.done
        # the old run's files and what was exported from it are gone, the user's own file stays
        assert sorted(p.name for p in d.iterdir()) == [locks.LOCK_FILE, "notes.txt"]
        run.finish({"top1": 7.0}, files=[])
    assert run_state(d, other).finished and run_state(d, me).kind == "changed"


def test_a_finish_with_non_finite_numbers_records_nothing(tmp_path):
    d = tmp_path / "run"
    with pytest.raises(NonFiniteError):
        with open_run(d, ident()) as run:
            run.finish({"top1": float("nan")}, files=[])
    assert not (d / "metrics.json").exists() and not (d / locks.LOCK_FILE).exists()


def test_clear_run_and_leftovers(tmp_path):
    d = finish(tmp_path / "run", ident())
    (d / ".metrics.json.abc123.tmp").write_text("{")  # a killed atomic write
    (d / f"{locks.LOCK_FILE}.0123.tmp").write_text("")  # a killed lock creation
    (d / "export").mkdir()
    (d / "export" / "adapter_model.safetensors").write_text("x")
    assert records.is_leftover(".metrics.json.abc123.tmp") and not records.is_leftover("metrics.json")
    clear_run(d)
    assert list(d.iterdir()) == []
    (d / ".report.md.x.tmp").write_text("")
    assert remove_leftovers(d) == 1 and list(d.iterdir()) == []


# ---------------------------------------------------------------- writes


def test_atomic_write_names_the_file_of_a_failed_write(tmp_path):
    def full(tmp):  # what safetensors raises on a full disk
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "adapter.safetensors", full)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(tmp_path / "adapter.safetensors")
    assert list(tmp_path.iterdir()) == []  # no temporary file left

    def oserror(tmp):
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        atomic_write(tmp_path / "m.json", oserror)
    assert e.value.filename == str(tmp_path / "m.json") and list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- locks


def test_lock_is_exclusive_and_says_who_holds_it(tmp_path):
    a = claim_run(tmp_path / "run")
    assert a is not None and a.held
    info = locks.read_lock(a.path)
    assert (info.pid, info.host) == (os.getpid(), socket.gethostname())
    b = RunLock(tmp_path / "run")
    assert not b.try_acquire() and b.blocked_by.token == info.token
    with pytest.raises(RunLockedError, match=f"pid {os.getpid()} on host"):
        with b:
            pass
    a.release()
    assert not a.path.exists()
    assert b.try_acquire()
    b.release()


def test_locks_of_many_threads_admit_one_holder_at_a_time(tmp_path):
    """Threads claim the folder and, while they hold it, count up in a file (read, then write): a second
    holder at the same time would be seen inside, and would lose increments."""
    inside, overlaps, held = [], [], []
    counter = tmp_path / "n"
    counter.write_text("0")

    def work():
        for _ in range(20):
            lock = RunLock(tmp_path)
            if lock.try_acquire():
                inside.append(1)
                if len(inside) > 1:
                    overlaps.append(1)
                n = int(counter.read_text())
                time.sleep(0.001)
                counter.write_text(str(n + 1))
                held.append(1)
                inside.pop()
                lock.release()

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not overlaps and int(counter.read_text()) == len(held) > 0


def write_lock(path, **fields):
    info = {"host": socket.gethostname(), "boot_id": locks._boot_id(), "pid": os.getpid(),
            "pid_start": locks._process_start(os.getpid()), "created": time.time(), "token": "t" * 32}
    info.update(fields)
    path.write_text(json.dumps(info))
    return path


def test_a_lock_of_a_dead_process_on_this_host_is_broken(tmp_path, caplog):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = int(proc.stdout)  # that process has exited
    write_lock(tmp_path / locks.LOCK_FILE, pid=dead, pid_start=None)
    lock = RunLock(tmp_path)
    assert lock.try_acquire()
    assert f"removed a stale lock of pid {dead}" in caplog.text
    lock.release()
    assert list(tmp_path.iterdir()) == []  # nothing left behind (the broken lock was deleted)


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    # pid 1 runs, but not the process that took the lock (another start time)
    write_lock(tmp_path / locks.LOCK_FILE, pid=1, pid_start="1")
    if locks._process_start(1) in (None, "1"):
        pytest.skip("no /proc start times here")
    lock = RunLock(tmp_path)
    assert lock.try_acquire()
    lock.release()


def test_a_live_process_keeps_its_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path / locks.LOCK_FILE, pid=proc.pid, pid_start=locks._process_start(proc.pid))
        lock = RunLock(tmp_path, stale_after_s=0.01)  # the timeout is for other hosts only
        time.sleep(0.05)
        assert not lock.try_acquire() and lock.blocked_by.pid == proc.pid
    finally:
        proc.kill()
        proc.wait()
    assert lock.try_acquire()  # gone now
    lock.release()


def test_another_hosts_lock_is_stale_only_after_the_timeout(tmp_path, monkeypatch):
    path = write_lock(tmp_path / locks.LOCK_FILE, host="elsewhere", boot_id="other", pid=12345)
    assert not RunLock(tmp_path, stale_after_s=60).try_acquire()
    old = time.time() - 120  # no heartbeat for two minutes
    os.utime(path, (old, old))
    assert not RunLock(tmp_path, stale_after_s=600).try_acquire()
    lock = RunLock(tmp_path, stale_after_s=60)
    assert lock.try_acquire()
    lock.release()
    # the timeout can come from the environment
    path = write_lock(tmp_path / locks.LOCK_FILE, host="elsewhere", boot_id="other", pid=12345)
    os.utime(path, (old, old))
    monkeypatch.setenv(locks.LOCK_TIMEOUT_ENV, "1000")
    assert not RunLock(tmp_path).try_acquire()
    monkeypatch.setenv(locks.LOCK_TIMEOUT_ENV, "30")
    assert RunLock(tmp_path).try_acquire()


def test_same_host_after_a_reboot_is_stale(tmp_path):
    if not locks._boot_id():
        pytest.skip("no boot id here")
    write_lock(tmp_path / locks.LOCK_FILE, boot_id="an-earlier-boot", pid=os.getppid())
    lock = RunLock(tmp_path)
    assert lock.try_acquire()
    lock.release()


def test_heartbeat_touches_the_lock_and_a_lost_lock_is_not_recorded(tmp_path):
    lock = RunLock(tmp_path, stale_after_s=60, heartbeat_s=0.05)
    assert lock.try_acquire()
    old = time.time() - 100
    os.utime(lock.path, (old, old))
    time.sleep(0.3)
    assert time.time() - os.stat(lock.path).st_mtime < 10  # touched again
    # Another worker judged it stale and took it over: this holder may no longer record the run.
    write_lock(lock.path, token="someone-else" + "x" * 20)
    assert not lock.still_held()
    run = records.Run(tmp_path, ident(), lock)
    with pytest.raises(records.RunError, match="lost the run's lock"):
        run.finish({"top1": 1.0}, files=[])
    lock.release()
    assert locks.read_lock(tmp_path / locks.LOCK_FILE).token.startswith("someone-else")  # theirs is left alone


def test_a_damaged_lock_file_counts_by_its_age(tmp_path):
    path = tmp_path / locks.LOCK_FILE
    path.write_text("")  # e.g. created without hard links and not yet written
    assert not RunLock(tmp_path, stale_after_s=60).try_acquire()
    old = time.time() - 120
    os.utime(path, (old, old))
    lock = RunLock(tmp_path, stale_after_s=60)
    assert lock.try_acquire()
    lock.release()
    remove_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_unwritable_folder_is_a_run_error(tmp_path, monkeypatch):
    real = os.open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    (tmp_path / "run").mkdir()
    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(records.RunError, match="cannot write in .*Read-only file system; choose a writable out="):
        with open_run(tmp_path / "run", ident()):
            pass


def test_prepare_dir_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(records.RunError, match="is a file, not a folder"):
        records.prepare_dir(tmp_path / "f")
    with pytest.raises(records.RunError, match="is a file, not a folder"):
        records.prepare_dir(tmp_path / "f" / "sub")


def test_tidy_removes_a_dead_processes_lock_and_leftovers_only(tmp_path):
    d = finish(tmp_path / "run", ident())
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    write_lock(d / locks.LOCK_FILE, pid=int(proc.stdout), pid_start=None)  # killed after it recorded the run
    (d / ".prompts.safetensors.x1.tmp").write_text("")  # killed during an export
    records.tidy(d)
    assert sorted(p.name for p in d.iterdir()) == ["adapter.bin", "config.yaml", "metrics.json"]
    assert records.is_finished(d, ident())
    live = RunLock(d)
    assert live.try_acquire()
    (d / ".metrics.json.x2.tmp").write_text("")  # a live holder's write in progress
    records.tidy(d)
    assert (d / ".metrics.json.x2.tmp").exists() and live.still_held()
    live.release()


def test_a_killed_but_unreaped_process_does_not_keep_its_lock(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_lock(tmp_path / locks.LOCK_FILE, pid=proc.pid, pid_start=locks._process_start(proc.pid))
    assert not RunLock(tmp_path).try_acquire()
    proc.kill()
    for _ in range(100):  # a zombie until waited for
        if locks._process_start(proc.pid) is None or not locks._pid_alive(proc.pid):
            break
        time.sleep(0.05)
    try:
        lock = RunLock(tmp_path)
        assert lock.try_acquire()
        lock.release()
    finally:
        proc.wait()

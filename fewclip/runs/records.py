"""Run identity, finished-run records and run locks: which numbers a run directory vouches for, and who
is writing it.

Identity
--------
A run's identity is a digest of three parts (:func:`run_identity`):

* ``config``: the resolved config, without the keys that say where results go or how verbose or
  parallel the work is (``IGNORED_CONFIG_KEYS``: ``out``, ``log_level``, ``overwrite``,
  ``data.workers``, ``backbone.cache_dir``, ``log``), nor keys added later while they hold their defaults
  (``LATER_KEY_DEFAULTS``: ``protocol: fewshot``, ``targets: []``, ``data.reader: null``, ``data.prompts: []``,
  ``data.fewshot_file: null``, ``preset: fewclip``, ``preset_set: {}``, ``data.sampler: fewclip``,
  ``backbone.seed: 0``, so earlier runs keep their identity);
* ``weights``: the backbone's weights checksum (the sha256 of its weights file, or of its loaded
  state dict where there is no file, e.g. an open_clip pretrained tag or random init);
* ``data``: the class names, the prompt templates, the few-shot split (train and validation image
  ids) and the test image ids; under a generalisation protocol also every test set's dataset, class
  names, templates, class map and test image ids (``evals``).

The record
----------
``metrics.json`` carries, under ``"run_record"``, the identity and its parts, the sha256 of every file
the run wrote (``config.yaml``, ``split.json``, ``adapter.safetensors``) and of the metrics
themselves. A run is finished only if that record parses and every checksum matches
(:func:`run_state`); it is the run's own only if the identity matches too. Every data file is
written atomically and fsynced together with its directory entry (``fewclip.utils.io``) before the record
is written, and the record is written last, so a kill at any moment leaves either a finished run or
an unfinished one, never a finished-looking mixture. Nothing non-finite is ever recorded:
:func:`check_finite` refuses NaN or infinite metrics and adapter tensors.

Locks: ``fewclip.utils.locks`` (a run directory is written only by the process that holds its lock).
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from fewclip.config.compose import load_yaml
from fewclip.utils.checksums import sha256_bytes, sha256_file, weights_checksum  # noqa: F401  (weights_checksum: re-exported)
from fewclip.utils.errors import NonFiniteError, RunError  # noqa: F401  (re-exported: where runs raise them)
from fewclip.utils.io import atomic_write_json, fsync_dir
from fewclip.utils.locks import LOCK_FILE, LOCK_TIMEOUT_ENV, RunLock, RunLockedError, locked_error  # noqa: F401  (re-exported)
from fewclip.version import __version__

log = logging.getLogger(__name__)

RECORD_KEY = "run_record"
RECORD_FORMAT = "fewclip.run"
RECORD_VERSION = 1
METRICS_FILE = "metrics.json"
# What a run writes (metrics.json last) and what `fewclip export` derives from it by default; an
# overwrite removes all of them (metrics.json first), and nothing else in the folder.
RUN_FILES = ("metrics.json", "adapter.safetensors", "split.json", "protocol.json", "config.yaml")
DERIVED_FILES = ("prompts.safetensors", "export")
FAILED_FILE = "failed.json"  # what a failed attempt leaves instead of its half-written files (cleared by a rerun)
IGNORED_CONFIG_KEYS = ("out", "log_level", "overwrite", "data.workers", "backbone.cache_dir", "log", "threads")
# Keys added to the run config after run records existed: left out of the config part while they hold these
# defaults, so a finished run keeps its identity when a fewclip that knows the key reads it.
LATER_KEY_DEFAULTS = {"protocol": "fewshot", "targets": [], "data.reader": None, "data.prompts": [],
                      "transductive": "none", "data.fewshot_file": None, "preset": "fewclip", "preset_set": {},
                      "data.sampler": "fewclip", "data.classnames": None, "data.prompts_file": None,
                      "data.skip_bad_images": False, "backbone.seed": 0}


class RunDirError(RunError):
    """An output folder that cannot be one: a file in the way, or a place where no folder can be made."""

    exit_code = 2


class RunExistsError(RunError):
    """The directory holds another run's results and overwriting was not asked for."""

    exit_code = 2


# ---------------------------------------------------------------------------
# checksums and identity
# ---------------------------------------------------------------------------


def canonical_json(obj: Any) -> bytes:
    """JSON with sorted keys and no spaces: the same bytes for the same content on every machine."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def config_dict(cfg: Any) -> dict[str, Any]:
    """A config (dataclass, DictConfig or dict) as a plain dict without ``IGNORED_CONFIG_KEYS``, nor the
    ``LATER_KEY_DEFAULTS`` keys that hold their defaults."""

    if isinstance(cfg, Mapping) and not isinstance(cfg, DictConfig):
        d = json.loads(json.dumps(cfg))
    else:
        node = cfg if isinstance(cfg, DictConfig) else OmegaConf.structured(cfg)
        d = OmegaConf.to_container(node, resolve=True)
    for key in IGNORED_CONFIG_KEYS:
        parent, _, leaf = key.rpartition(".")
        node = d
        for part in parent.split(".") if parent else ():
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(leaf, None)
    for key, default in LATER_KEY_DEFAULTS.items():
        parent, _, leaf = key.rpartition(".")
        node = d
        for part in parent.split(".") if parent else ():
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and leaf in node and node[leaf] == default:
            node.pop(leaf)
    return d


def items_list(items: Sequence[Any]) -> list[list[Any]]:
    """Dataset items as [[id, label], ...]."""
    return [[it.id, int(it.label)] for it in items]


def data_part(*, dataset: str, classnames: Sequence[str], templates: Sequence[str], test: Sequence[Any],
              split: Optional[dict[str, Any]] = None, evals: Optional[Sequence[dict[str, Any]]] = None
              ) -> dict[str, Any]:
    """The ``data`` part of an identity: names, templates, few-shot split (train/val ids, and the file it was read
    from with its sha256) and test ids; ``evals``:
    a protocol's test sets, each a dict of what it holds (JSON-able; test items under ``"test"``)."""
    d = {"dataset": dataset, "classnames": list(classnames), "templates": list(templates),
         "test": items_list(test)}
    if split is not None:
        d["train"] = [list(x) for x in split["train"]]
        d["val"] = [list(x) for x in split["val"]]
        if split.get("source"):  # read from a file (data.fewshot_file): the file, by its checksum, too
            d["split_source"] = split["source"]
    if evals is not None:
        d["evals"] = [{**e, "test": items_list(e["test"])} for e in evals]
    return d


@dataclass(frozen=True)
class Identity:
    """What a run is: ``digest`` over the parts; ``config`` is kept to explain a change."""

    digest: str
    parts: dict[str, str]
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)


def run_identity(cfg: Any, weights: str, data: dict[str, Any]) -> Identity:
    """The identity of a run of config ``cfg`` on backbone weights ``weights`` (a :func:`weights_checksum`)
    with the data of :func:`data_part`."""
    conf = config_dict(cfg)
    parts = {"config": sha256_bytes(canonical_json(conf)), "weights": weights,
             "data": sha256_bytes(canonical_json(data))}
    digest = sha256_bytes(canonical_json({"format": RECORD_FORMAT, "version": RECORD_VERSION, **parts}))
    return Identity(digest, parts, conf)


# ---------------------------------------------------------------------------
# finite checks
# ---------------------------------------------------------------------------


def _nonfinite(obj: Any, where: str) -> Optional[str]:
    if isinstance(obj, bool) or obj is None or isinstance(obj, (str, int)):
        return None
    if isinstance(obj, float):
        return None if math.isfinite(obj) else f"{where} = {obj}"
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            bad = _nonfinite(v, f"{where}.{k}" if where else str(k))
            if bad:
                return bad
        return None
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            bad = _nonfinite(v, f"{where}[{i}]")
            if bad:
                return bad
        return None
    try:
        v = float(obj)  # numpy scalars, 0-d tensors
    except (TypeError, ValueError):
        return None
    return None if math.isfinite(v) else f"{where} = {v}"


def check_finite(metrics: Mapping[str, Any], tensors: Optional[Mapping[str, Any]] = None, *, run: str = "") -> None:
    """Refuse NaN or infinite values in ``metrics`` (any depth) or in floating ``tensors``."""
    where = f"run {run}: " if run else ""
    bad = _nonfinite(dict(metrics), "")
    if bad:
        raise NonFiniteError(f"{where}metric {bad} is not a finite number; the run is not recorded as finished "
                             f"(a diverged training: lower train.lr, or check the data)")
    for name, t in (tensors or {}).items():
        if getattr(t, "is_floating_point", lambda: False)():
            finite = t.isfinite()  # a tensor's own method: this module does not import torch
            if not bool(finite.all()):
                n = int((~finite).sum())
                raise NonFiniteError(f"{where}adapter tensor {name!r} holds {n} non-finite value(s); the run is not "
                                     f"recorded as finished (a diverged training: lower train.lr)")


# ---------------------------------------------------------------------------
# the finished-run record
# ---------------------------------------------------------------------------


@dataclass
class RunState:
    """What a run directory holds. ``kind``:

    * ``"finished"``: a valid record (of ``identity`` when one was asked about);
    * ``"missing"``: no metrics.json: nothing, or an unfinished run;
    * ``"unreadable"``: a metrics.json that does not parse (no numbers can come from it);
    * ``"legacy"``: a metrics.json without a record (an older fewclip, or written by hand);
    * ``"modified"``: a record whose files or metrics no longer match their checksums;
    * ``"changed"``: a valid record of another identity (``reason`` says what changed).
    """

    kind: str
    reason: str = ""
    metrics: Optional[dict[str, Any]] = None

    @property
    def finished(self) -> bool:
        return self.kind == "finished"

    @property
    def holds_results(self) -> bool:
        """Numbers that are not this run's: replacing them needs ``overwrite=true`` (a sweep reruns them)."""
        return self.kind in ("legacy", "modified", "changed")


def _metrics_digest(metrics: Mapping[str, Any]) -> str:
    return sha256_bytes(canonical_json({k: v for k, v in metrics.items() if k != RECORD_KEY}))


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any], limit: int = 3) -> str:
    """``"train.epochs: 1 -> 2, seed: 1 -> 3"``: the keys whose values differ (at most ``limit`` named)."""
    a, b = _flat(old), _flat(new)
    diffs = [f"{k}: {a.get(k, '(unset)')} -> {b.get(k, '(unset)')}" for k in sorted(set(a) | set(b))
             if a.get(k, object()) != b.get(k, object())]
    more = f" and {len(diffs) - limit} more" if len(diffs) > limit else ""
    return ", ".join(diffs[:limit]) + more


def _change_reason(run_dir: Path, record: dict[str, Any], identity: Identity) -> str:
    old = record.get("parts") or {}
    reasons = []
    if old.get("config") != identity.parts["config"]:
        detail = ""
        try:
            detail = config_changes(config_dict(OmegaConf.to_container(load_yaml(run_dir / "config.yaml"))),
                                    identity.config)
        except Exception:  # an unreadable old config only costs the detail
            pass
        reasons.append(f"config changed ({detail})" if detail else "config changed")
    if old.get("weights") != identity.parts["weights"]:
        reasons.append(f"backbone weights changed ({str(old.get('weights'))[:21]}... -> "
                       f"{identity.parts['weights'][:21]}...)")
    if old.get("data") != identity.parts["data"]:
        reasons.append("data changed (class names, templates, few-shot split, test images or a protocol's test "
                       "sets)")
    return "; ".join(reasons) or "identity changed (older record format)"


def read_metrics(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """``metrics.json`` of a run directory, or None when absent or unreadable."""
    path = Path(run_dir) / METRICS_FILE
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (OSError, ValueError):
        return None
    return obj if isinstance(obj, dict) else None


def run_state(run_dir: str | os.PathLike, identity: Optional[Identity] = None) -> RunState:
    """Is the run in ``run_dir`` finished and valid (and, given ``identity``, this identity's)?"""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE
    if not path.exists():
        return RunState("missing", "no metrics.json")
    metrics = read_metrics(run_dir)
    if metrics is None:
        return RunState("unreadable", "metrics.json is damaged (does not parse as a JSON object)")
    record = metrics.get(RECORD_KEY)
    if record is None:
        return RunState("legacy", "metrics.json has no run record (written by an older fewclip or by hand)", metrics)
    if (not isinstance(record, dict) or record.get("format") != RECORD_FORMAT
            or not isinstance(record.get("identity"), str) or not isinstance(record.get("files"), dict)):
        return RunState("modified", "metrics.json has a damaged run record", metrics)
    if record.get("version") != RECORD_VERSION:
        return RunState("modified", f"run record version {record.get('version')!r} (this fewclip writes "
                                    f"{RECORD_VERSION})", metrics)
    if record.get("metrics_sha256") != _metrics_digest(metrics):
        return RunState("modified", "metrics.json was edited after the run finished", metrics)
    for name, digest in record["files"].items():
        f = run_dir / name
        try:
            have = sha256_file(f)
        except OSError:
            return RunState("modified", f"{name} is missing or unreadable", metrics)
        if have != digest:
            return RunState("modified", f"{name} changed after the run finished", metrics)
    if identity is not None and record["identity"] != identity.digest:
        return RunState("changed", _change_reason(run_dir, record, identity), metrics)
    return RunState("finished", "", metrics)


def is_finished(run_dir: str | os.PathLike, identity: Optional[Identity] = None) -> bool:
    """Is run ``run_dir`` finished and valid (and, given ``identity``, this identity's)?"""
    return run_state(run_dir, identity).finished


def make_record(run_dir: Path, metrics: Mapping[str, Any], identity: Identity, files: Sequence[str]) -> dict[str, Any]:

    return {
        "format": RECORD_FORMAT,
        "version": RECORD_VERSION,
        "identity": identity.digest,
        "parts": dict(identity.parts),
        "files": {name: sha256_file(run_dir / name) for name in files},
        "metrics_sha256": _metrics_digest(metrics),
        "fewclip_version": __version__,
        "writer": {"host": socket.gethostname(), "pid": os.getpid()},
    }


# ---------------------------------------------------------------------------
# run directories
# ---------------------------------------------------------------------------


def check_no_file_in_the_way(path: str | os.PathLike, what: str = "out") -> None:
    """Raise RunDirError where a file stands at ``path`` or at a parent of it, where its folder would go."""
    path = Path(path)
    for p in (path, *path.parents):
        if p.exists() and not p.is_dir():
            raise RunDirError(f"{what}={str(path)!r}: {p} is a file, not a folder; give {what}= a folder path")
        if p.is_dir():
            break


def prepare_dir(path: str | os.PathLike, what: str = "out") -> Path:
    """Create the output folder ``path``; a file in the way, or an unwritable place, is a RunDirError."""
    path = Path(path)
    check_no_file_in_the_way(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the folder {what}={str(path)!r}: {e.strerror}; choose a writable "
                          f"location for {what}=") from None
    return path


# safetensors (>= 0.6) writes a file through Rust's tempfile crate: ".tmp" and 6 random letters or digits in the
# target's folder, renamed into place when complete. A process killed meanwhile leaves that file (a whole copy
# of the tensors) under a name no fewclip write uses; it is a leftover like fewclip's own ".NAME.XXXX.tmp".
_SAFETENSORS_TMP = re.compile(r"\.tmp[A-Za-z0-9]{6}")


def is_leftover(name: str) -> bool:
    """A temporary file of an interrupted atomic write (fewclip's or safetensors' own, inside it), or of a lock
    being created or broken."""
    return ((name.startswith(".") and name.endswith(".tmp")) or _SAFETENSORS_TMP.fullmatch(name) is not None
            or (name.startswith(LOCK_FILE + ".") and name.endswith((".tmp", ".broken"))))


def remove_leftovers(folder: str | os.PathLike) -> int:
    """Delete the leftover temporary files in ``folder`` (not below it); returns how many.

    Call it only while holding the folder's lock: another process's write in progress looks the same."""
    n = 0
    try:
        entries = list(os.scandir(folder))
    except FileNotFoundError:
        return 0
    for e in entries:
        if is_leftover(e.name) and not e.is_dir(follow_symlinks=False):
            try:
                os.unlink(e.path)
                n += 1
            except FileNotFoundError:
                pass
    return n


def clear_run(run_dir: str | os.PathLike) -> None:
    """Remove a run's files (``metrics.json`` first, made durable, so that a kill half-way leaves an
    unfinished run; then ``RUN_FILES`` and the files its record vouches for), what ``fewclip export``
    derived from it, and leftover temporary files. Other files in the folder stay."""

    run_dir = Path(run_dir)
    record = (read_metrics(run_dir) or {}).get(RECORD_KEY)
    vouched = record.get("files") if isinstance(record, dict) else None
    named = [n for n in (vouched if isinstance(vouched, dict) else ())
             if isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..", LOCK_FILE, METRICS_FILE)]
    if (run_dir / METRICS_FILE).exists():
        os.unlink(run_dir / METRICS_FILE)
        fsync_dir(run_dir)
    for name in dict.fromkeys([*RUN_FILES[1:], *named, *DERIVED_FILES, FAILED_FILE]):
        p = run_dir / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        elif p.exists() or p.is_symlink():
            os.unlink(p)
    remove_leftovers(run_dir)
    fsync_dir(run_dir)


def mark_failed(run_dir: str | os.PathLike, error: BaseException, message: str) -> Path:
    """A failed attempt's folder: its half-written results removed (``config.yaml`` stays: what was tried) and
    ``failed.json`` written beside it (the first line of the error, its type, when). The next run there clears
    both."""
    run_dir = Path(run_dir)
    for name in (*RUN_FILES[1:], *DERIVED_FILES):
        p = run_dir / name
        if name == "config.yaml" or not (p.exists() or p.is_symlink()):
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            os.unlink(p)
    remove_leftovers(run_dir)
    record = {"status": "failed", "error": message.splitlines()[0] if message else type(error).__name__,
              "error_type": type(error).__name__, "failed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return atomic_write_json(run_dir / FAILED_FILE, record)


def read_failure(run_dir: str | os.PathLike) -> Optional[dict[str, Any]]:
    """What ``failed.json`` says about the last attempt in ``run_dir``, or None."""
    try:
        data = json.loads((Path(run_dir) / FAILED_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def claim_run(run_dir: str | os.PathLike, *, stale_after_s: Optional[float] = None) -> Optional[RunLock]:
    """Try to claim ``run_dir`` (created if needed) without waiting: a held :class:`RunLock`, or None
    when a live process holds it."""
    prepare_dir(run_dir, "run directory")
    lock = RunLock(run_dir, stale_after_s=stale_after_s)
    return lock if lock.try_acquire() else None


def tidy(run_dir: str | os.PathLike, *, stale_after_s: Optional[float] = None) -> None:
    """Remove a stale lock and leftover temporary files from ``run_dir`` (e.g. of a process killed after
    it recorded its run, or during an export), unless a live process holds it."""
    run_dir = Path(run_dir)
    try:
        names = [e.name for e in os.scandir(run_dir)]
    except OSError:
        return
    if not any(n == LOCK_FILE or is_leftover(n) for n in names):
        return
    lock = RunLock(run_dir, stale_after_s=stale_after_s)
    try:
        if lock.try_acquire():
            remove_leftovers(run_dir)
    except OSError:  # an unwritable folder: nothing to tidy there
        return
    finally:
        lock.release()


# ---------------------------------------------------------------------------
# one run
# ---------------------------------------------------------------------------


class Run:
    """A run directory held under its lock, between :func:`open_run` and :meth:`finish`.

    ``done`` is True when the directory already held this identity's finished run (``metrics``
    then holds its metrics, and nothing is to be written)."""

    def __init__(self, path: Path, identity: Identity, lock: RunLock, done: bool = False,
                 metrics: Optional[dict[str, Any]] = None):
        self.path = path
        self.identity = identity
        self.lock = lock
        self.done = done
        self.metrics = metrics

    def finish(self, metrics: dict[str, Any], files: Sequence[str], tensors: Optional[Mapping[str, Any]] = None
               ) -> dict[str, Any]:
        """Write ``metrics.json`` with the record vouching for ``files`` (already written and fsynced)."""

        check_finite(metrics, tensors, run=str(self.path))
        if not self.lock.still_held():
            raise RunError(f"{self.path}: this process lost the run's lock (another worker judged it stale: raise "
                           f"{LOCK_TIMEOUT_ENV} above the clock skew between hosts); the run is not recorded")
        record = make_record(self.path, metrics, self.identity, files)
        atomic_write_json(self.path / METRICS_FILE, {**metrics, RECORD_KEY: record})
        self.metrics = metrics
        self.done = True
        return metrics


@contextmanager
def open_run(run_dir: str | os.PathLike, identity: Identity, *, overwrite: bool = False,
             lock: Optional[RunLock] = None, stale_after_s: Optional[float] = None) -> Iterator[Run]:
    """Hold ``run_dir`` for a run of ``identity``.

    Yields a :class:`Run` whose ``done`` is True when this identity's run is already finished there
    (and ``overwrite`` is false). Otherwise the directory is cleared (old run files first, so a kill
    leaves an unfinished run) and the caller writes its files and calls :meth:`Run.finish`. A directory
    holding another run's results is refused with :class:`RunExistsError` unless ``overwrite``. The lock
    is taken here (or ``lock``, already held, is used) and released at the end, unless it was passed in.
    """
    run_dir = prepare_dir(run_dir, "out")
    own = lock is None
    if own:
        lock = RunLock(run_dir, stale_after_s=stale_after_s)
        try:
            acquired = lock.try_acquire()
        except OSError as e:
            raise RunError(f"cannot write in {run_dir}: {e.strerror}; choose a writable out= folder") from None
        if not acquired:
            raise locked_error(run_dir, lock.blocked_by)
    try:
        state = run_state(run_dir, identity)
        if state.finished and not overwrite:
            remove_leftovers(run_dir)  # of a process killed after it finished (an export, say); we hold the lock
            yield Run(run_dir, identity, lock, done=True, metrics=state.metrics)
            return
        if state.holds_results and not overwrite:
            raise RunExistsError(f"{run_dir} holds the results of another run: {state.reason}. Pass overwrite=true "
                                 f"to replace them (the old files are removed first), or choose another out=")
        if state.holds_results or state.finished:
            log.info("%s: replacing the run there (%s)", run_dir, state.reason or "overwrite=true")
        clear_run(run_dir)
        yield Run(run_dir, identity, lock)
    finally:
        if own:
            lock.release()

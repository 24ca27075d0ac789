"""Read back a W&B offline run (the ``run-*.wandb`` file of ``DIR/wandb/offline-run-*``) for the tests.

The file is W&B's transaction log: a 7-byte header (``:W&B``, a 2-byte magic, a version byte), then records in
LevelDB's log format (32 KiB blocks; each chunk a 7-byte header: CRC-32, length, type full/first/middle/last),
each record one ``wandb_internal_pb2.Record`` protobuf, parsed here with wandb's own definitions. The reader
that older wandb releases shipped (``wandb.sdk.internal.datastore``) is gone from wandb 0.2x, so the framing is
read here; the records are what ``wandb sync`` would upload.
"""
from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from wandb.proto import wandb_internal_pb2

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(data: bytes) -> Iterator[bytes]:
    """The records' payloads of a transaction log, CRC-checked."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log (no ':W&B' header)")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if n == 0 and kind == 0:  # zero padding to the end of the block
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + n]
        if zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF != crc:
            raise ValueError(f"CRC mismatch at byte {pos}")
        pos += HEADER + n
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""


def _key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


@dataclass
class OfflineRun:
    """What an offline run recorded: its name, group and project, its config, the history rows (one dict per
    step) and the summary as it stands at the end."""

    name: str = ""
    group: str = ""
    project: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    exit_code: Optional[int] = None


def read_offline_run(run_dir: Path) -> OfflineRun:
    """The run in ``run_dir`` (an ``offline-run-*`` folder)."""
    (path,) = list(Path(run_dir).glob("run-*.wandb"))
    out = OfflineRun()
    for payload in chunks(path.read_bytes()):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(payload)
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out.name, out.group, out.project = rec.run.display_name, rec.run.run_group, rec.run.project
            for u in rec.run.config.update:
                out.config[_key(u)] = json.loads(u.value_json)
        elif kind == "config":
            for u in rec.config.update:
                out.config[_key(u)] = json.loads(u.value_json)
        elif kind == "history":
            out.history.append({_key(i): json.loads(i.value_json) for i in rec.history.item})
        elif kind == "summary":
            for u in rec.summary.update:
                out.summary[_key(u)] = json.loads(u.value_json)
            for r in rec.summary.remove:
                out.summary.pop(_key(r), None)
        elif kind == "exit":
            out.exit_code = rec.exit.exit_code
    return out


def offline_runs(wandb_dir: Path) -> list[OfflineRun]:
    """Every offline run under a ``wandb`` folder."""
    return [read_offline_run(d) for d in sorted(Path(wandb_dir).glob("offline-run-*"))]

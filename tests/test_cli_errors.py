"""Every error a user can cause: one message naming the problem and the fix, a non-zero exit code, never a
trace. The CLI is driven over a table of bad inputs in-process (fewclip.cli.main.main) and, for a few, as a
subprocess (`python -m fewclip.cli.main`), where an uncaught exception would print its trace."""
import errno
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open
from safetensors.torch import save_file

from fewclip.adapter.exports import METADATA_KEY
from fewclip.cli.main import main
from fewclip.runs.export import export_run

TINY = ["data.max_test=8", "backbone.device=cpu"]
TRAIN = ["train", "adapter=coop", "data=toy-shapes", "shots=1", "seed=1", "train.epochs=1", "train.augment_views=1",
         "adapter.n_ctx=2", *TINY]


def image_folder(root: Path, classes, n=4):
    for c in classes:
        (root / c).mkdir(parents=True)
        for i in range(n):
            Image.new("RGB", (32, 32), (40 * i, 80, 0)).save(root / c / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The bad inputs, made once."""
    t = tmp_path_factory.mktemp("inputs")
    f = {"tmp": t}
    f["bad_yaml"] = t / "bad.yaml"
    f["bad_yaml"].write_text("sweep:\n  seeds: [1, 2\n  shots: [1]\n")
    f["marker"] = t / "pwned"
    f["evil_yaml"] = t / "evil.yaml"
    f["evil_yaml"].write_text(f"train: !!python/object/apply:os.system ['touch {f['marker']}']\n")
    f["evil_sweep"] = t / "evil_sweep.yaml"
    f["evil_sweep"].write_text(f"sweep:\n  args: !!python/object/apply:os.system ['touch {f['marker']}']\n")
    f["a_file"] = t / "a_file"
    f["a_file"].write_text("not a folder")
    loop = image_folder(t / "loop", ["circle", "square"])
    os.symlink("self.png", loop / "square" / "self.png")  # a link to itself
    f["loop"] = loop
    dirloop = image_folder(t / "dirloop", ["circle", "square"])
    os.symlink("star", dirloop / "star")  # a class folder that is a link to itself
    f["dirloop"] = dirloop
    f["hash"] = image_folder(t / "hash", ["circle", "###"])  # no word the toy tokenizer can encode
    f["one"] = image_folder(t / "one", ["circle"])
    f["img"] = t / "img.png"
    Image.new("RGB", (32, 32), (200, 10, 10)).save(f["img"])
    f["img_dir"] = t / "images"
    f["img_dir"].mkdir()
    f["empty_dir"] = t / "empty"
    f["empty_dir"].mkdir()
    # A real prompt file, then copies that do not fit.
    run = t / "coop"
    assert main([*TRAIN, f"out={run}"]) == 0
    f["run"] = run
    f["prompts"] = export_run(run).path
    with safe_open(str(f["prompts"]), "pt") as sf:
        meta = json.loads(sf.metadata()[METADATA_KEY])
        tensors = {k: sf.get_tensor(k) for k in sf.keys()}
    wide = dict(tensors, ctx=np.pad(tensors["ctx"].numpy(), ((0, 0), (0, 32))))
    import torch

    f["wide"] = t / "wide.safetensors"
    save_file({k: torch.as_tensor(v).contiguous() for k, v in wide.items()}, str(f["wide"]),
              metadata={METADATA_KEY: json.dumps(meta)})
    # LoRA export folders that are not: metadata only naming the format, and metadata with garbage weights.
    f["fake_lora"] = t / "fake_lora"
    f["fake_lora"].mkdir()
    (f["fake_lora"] / "fewclip.json").write_text(json.dumps({"format": "fewclip.lora", "format_version": 1}))
    f["fake_lora2"] = t / "fake_lora2"
    f["fake_lora2"].mkdir()
    lora_meta = {**meta, "format": "fewclip.lora", "templates": ["a photo of a {}."], "lora": {}}
    (f["fake_lora2"] / "fewclip.json").write_text(json.dumps(lora_meta))
    (f["fake_lora2"] / "adapter_model.safetensors").write_bytes(os.urandom(256))
    return f


# (id, arguments, exit code, words the message must hold: the problem and the fix)
CASES = [
    ("yaml-syntax-train", lambda f: ["train", str(f["bad_yaml"])], 2,
     ["YAML syntax error", "bad.yaml", "line 3", "fix the file"]),
    ("yaml-syntax-sweep", lambda f: ["sweep", str(f["bad_yaml"]), f"out={f['tmp'] / 's1'}"], 2,
     ["YAML syntax error", "bad.yaml"]),
    ("python-tag-config", lambda f: ["train", str(f["evil_yaml"]), *TINY], 2,
     ["!!python/object/apply:os.system", "not allowed", "Remove the tag"]),
    ("python-tag-sweep", lambda f: ["sweep", str(f["evil_sweep"]), f"out={f['tmp'] / 's2'}"], 2,
     ["!!python/object/apply:os.system", "never constructs objects"]),
    ("device-tpu", lambda f: ["zeroshot", "backbone.device=tpu", f"out={f['tmp'] / 'z1'}"], 2,
     ["backbone.device", "'tpu'", "auto, cpu, cuda"]),
    ("predict-device-tpu", lambda f: ["predict", f"prompts={f['prompts']}", str(f["img"]), "backbone.device=tpu"], 2,
     ["backbone.device", "'tpu'"]),
    ("report-missing", lambda f: ["report", str(f["tmp"] / "no_such_runs")], 2,
     ["does not exist", "out= folder of a `fewclip sweep`"]),
    ("out-is-a-file", lambda f: ["zeroshot", f"out={f['a_file']}"], 2, ["is a file, not a folder", "folder path"]),
    ("out-below-a-file", lambda f: [*TRAIN, f"out={f['a_file'] / 'run'}"], 2, ["is a file, not a folder"]),
    ("sweep-out-is-a-file", lambda f: ["sweep", f"out={f['a_file']}"], 2, ["is a file, not a folder"]),
    ("symlink-loop-image", lambda f: ["zeroshot", "data=folder", f"data.root={f['loop']}", *TINY,
                                      f"out={f['tmp'] / 'z2'}"], 2,
     ["self.png", "symbolic link loop", "remove or fix it"]),
    ("symlink-loop-class-folder", lambda f: ["zeroshot", "data=folder", f"data.root={f['dirloop']}", *TINY,
                                             f"out={f['tmp'] / 'z3'}"], 2, ["star", "symbolic link loop"]),
    ("coop-no-tokens", lambda f: [*TRAIN, "data=folder", f"data.root={f['hash']}", f"out={f['tmp'] / 't1'}"], 2,
     ["'###'", "gives no tokens", "rename the class"]),
    ("one-class-dataset", lambda f: ["zeroshot", "data=folder", f"data.root={f['one']}", f"out={f['tmp'] / 'z4'}"],
     2, ["1 class", "at least 2 classes"]),
    ("prompt-file-wrong-width", lambda f: ["predict", f"prompts={f['wide']}", str(f["img"])], 2,
     ["ctx has width 96", "needs 64", "export the run again"]),
    ("fake-lora-export", lambda f: ["predict", f"prompts={f['fake_lora']}", str(f["img"])], 2,
     ["fewclip.json", "'backbone' is missing", "export the run again"]),
    ("fake-lora-weights", lambda f: ["predict", f"prompts={f['fake_lora2']}", str(f["img"])], 2,
     ["adapter_model.safetensors is damaged or not a safetensors file"]),
    ("predict-on-a-folder", lambda f: ["predict", f"prompts={f['prompts']}", str(f["img_dir"])], 2,
     ["a folder without image files"]),  # a folder stands for its images (tests/test_predict_and_failed.py)
    ("prompts-is-a-plain-folder", lambda f: ["predict", f"prompts={f['empty_dir']}", str(f["img"])], 2,
     ["is a folder but not a fewclip export", "fewclip export"]),
    ("negative-seed", lambda f: [*TRAIN, "seed=-1", f"out={f['tmp'] / 't3'}"], 2,
     ["seed must be >= 0", "-1"]),
    ("sweep-negative-seed", lambda f: ["sweep", "sweep.seeds=[-1]", f"out={f['tmp'] / 's3'}"], 2,
     ["seed must be >= 0"]),
    ("lr-nan", lambda f: [*TRAIN, "train.lr=nan", f"out={f['tmp'] / 't4'}"], 2, ["train.lr", "finite"]),
    ("lock-timeout", lambda f: ["sweep", "lock_timeout_s=-5", f"out={f['tmp'] / 's4'}"], 2, ["lock_timeout_s"]),
    ("non-finite-loss", lambda f: [*TRAIN, "train.lr=1e30", "train.epochs=3", f"out={f['tmp'] / 't5'}"], 1,
     ["training loss became nan", "not recorded", "Lower train.lr"]),
    ("finished-dir-other-config", lambda f: [*TRAIN, "train.epochs=2", f"out={f['run']}"], 2,
     ["holds the results of another run", "train.epochs: 1 -> 2", "overwrite=true"]),
]


@pytest.mark.parametrize("name, argv, code, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gives_one_message(name, argv, code, words, files, capsys):
    rc = main(argv(files))
    out, err = capsys.readouterr()
    assert rc == code, (rc, err)
    assert "Traceback" not in out + err
    message = [line for line in err.splitlines() if ": error: " in line]
    assert len(message) == 1, err
    for w in words:
        assert w in message[0], (w, message[0])
    assert not files["marker"].exists()  # no object was ever constructed from YAML


def test_nothing_is_left_recorded_by_failures(files):
    tmp = files["tmp"]
    assert not (tmp / "t5" / "metrics.json").exists()  # the diverged run
    for d in ("t1", "t2", "z2", "z4"):
        assert not (tmp / d / "metrics.json").exists()
    assert "epochs: 1\n" in (files["run"] / "config.yaml").read_text()  # the refused overwrite left it alone


def test_debug_shows_the_trace(files, capsys, monkeypatch):
    assert main(["zeroshot", "backbone.device=tpu", "--debug", f"out={files['tmp'] / 'z6'}"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "backbone.device" in err
    monkeypatch.setenv("FEWCLIP_DEBUG", "1")
    assert main(["report", str(files["tmp"] / "no_such_runs")]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_disk_full_while_writing_the_adapter(tmp_path, capsys, monkeypatch):
    import fewclip.runs.run

    def full(*args, **kwargs):  # what safetensors raises when the disk is full
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(fewclip.runs.run, "save_file", full)
    out = tmp_path / "run"
    assert main([*TRAIN, f"out={out}"]) == 1
    err = capsys.readouterr().err
    assert "no space left on the device" in err and "adapter.safetensors" in err and "free some space" in err
    assert "Traceback" not in err
    assert not (out / "metrics.json").exists()
    # the config tried and why it failed; no half-written result (split.json), no temp file, no lock left
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "failed.json"]


def test_read_only_out_directory(tmp_path, capsys, monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    real = os.open

    def read_only(path, *args, **kwargs):  # every file created under `out` fails as on a read-only mount
        if str(path).startswith(str(out)) and args and args[0] & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only)
    assert main(["zeroshot", *TINY, f"out={out}"]) == 1
    err = capsys.readouterr().err
    assert "Read-only file system" in err and "choose a writable out= folder" in err and "Traceback" not in err
    assert list(out.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_directory_for_real(tmp_path, capsys):
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    try:
        assert main(["zeroshot", *TINY, f"out={out}"]) == 1
        err = capsys.readouterr().err
        assert "Permission denied" in err and "out=" in err and "Traceback" not in err
    finally:
        out.chmod(0o755)


def fewclip_subprocess(args, cwd, limit_bytes=None):
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, resource.RLIM_INFINITY))

    env = {**os.environ, "FEWCLIP_DEBUG": "0"}
    return subprocess.Popen([sys.executable, "-m", "fewclip.cli.main", *args], cwd=cwd, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit if limit_bytes else None)


def test_as_a_subprocess(files, tmp_path):
    """The real command line: an uncaught exception would print its trace here. The last case is a real
    failed write (a file size limit: the kernel refuses the write, EFBIG), not a simulated one."""
    cases = [
        (["sweep", str(files["bad_yaml"]), f"out={tmp_path / 's'}"], 2, "YAML syntax error"),
        (["sweep", str(files["evil_sweep"]), f"out={tmp_path / 's'}"], 2, "not allowed"),
        (["train", f"out={files['a_file']}"], 2, "is a file, not a folder"),
        (["zeroshot", *TINY, f"out={tmp_path / 'z'}"], 1, "file too large writing"),
    ]
    procs = [fewclip_subprocess(args, tmp_path, limit_bytes=2048 if code == 1 else None) for args, code, _ in cases]
    for (args, code, words), proc in zip(cases, procs):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == code, (args, err)
        assert "Traceback" not in out + err and words in err, (args, err)
    assert not files["marker"].exists()
    z = tmp_path / "z"
    assert (z / "config.yaml").is_file() and not (z / "metrics.json").exists()
    assert sorted(p.name for p in z.iterdir()) == ["config.yaml", "failed.json"]  # no temporary file, no lock

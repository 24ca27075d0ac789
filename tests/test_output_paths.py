"""Output paths that cannot be written as given: the message names the user's path (never fewclip's temporary
file) and the exit code is 2 (a bad input) where the path's shape is wrong, 1 where the place is unwritable."""
import errno
import os

import pytest

from fewclip.cli.main import main
from fewclip.utils.errors import describe
from fewclip.utils.io import atomic_write, atomic_write_text

TRAIN = ["train", "adapter=coop", "data=toy-shapes", "shots=1", "seed=1", "train.epochs=1", "train.augment_views=1",
         "adapter.n_ctx=2", "data.max_test=8", "backbone.device=cpu"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "coop"
    assert main([*TRAIN, f"out={out}"]) == 0
    return out


def one_error(capsys, command):
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    lines = [line for line in err.splitlines() if ": error: " in line]  # (the log's INFO lines are not errors)
    assert len(lines) == 1 and lines[0].startswith(f"fewclip {command}: error: "), err
    assert ".tmp" not in lines[0], lines[0]  # never the temporary file's name
    return lines[0]


def no_leftovers(folder):
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []


def test_export_to_an_existing_folder(run, tmp_path, capsys):
    folder = tmp_path / "exports"
    folder.mkdir()
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(folder)]) == 2
    line = one_error(capsys, "export")
    assert f"-o {folder} is a folder; a coop export is one file: give a file path, e.g. " \
           f"{folder / 'prompts.safetensors'}" in line
    assert list(folder.iterdir()) == [] and no_leftovers(tmp_path)


@pytest.mark.parametrize("where, words", [
    (lambda t: t / "a_file" / "prompts.safetensors", ["a_file already exists and is in the way", "move it"]),
    (lambda t: t / ("x" * 300 + ".safetensors"), ["file name too long", "choose a shorter path"]),
    (lambda t: "", ["-o (out=) is empty", "give the path to write"]),
])
def test_export_to_a_path_that_cannot_be_a_file(run, tmp_path, capsys, where, words):
    (tmp_path / "a_file").write_text("in the way")
    capsys.readouterr()
    assert main(["export", str(run), "-o", str(where(tmp_path))]) == 2
    line = one_error(capsys, "export")
    for w in words:
        assert w in line, (w, line)
    assert no_leftovers(tmp_path)


def test_export_to_a_read_only_place_is_a_failed_write(run, tmp_path, capsys, monkeypatch):
    real = os.open

    def read_only(path, *args, **kwargs):
        if str(path).startswith(str(tmp_path)) and args and args[0] & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real(path, *args, **kwargs)

    capsys.readouterr()
    monkeypatch.setattr(os, "open", read_only)
    assert main(["export", str(run), "-o", str(tmp_path / "p.safetensors")]) == 1
    line = one_error(capsys, "export")
    assert f"cannot write {tmp_path / 'p.safetensors'}: the file system is read-only" in line


def test_split_export_to_a_folder_names_it(tmp_path, capsys):
    """The same write under another command (every result file is written by fewclip.utils.io.atomic_write)."""
    folder = tmp_path / "splits"
    folder.mkdir()
    assert main(["split", "export", "data=toy-shapes", "shots=1", "seed=1", "format=zhou", f"out={folder}"]) == 2
    assert f"{folder} is a folder where a file is expected; give a file path" in one_error(capsys, "split")
    assert list(folder.iterdir()) == []


def test_atomic_write_names_the_path_when_the_rename_fails(tmp_path):
    target = tmp_path / "result.json"

    def write_then_a_folder_appears(tmp):
        with open(tmp, "w") as f:
            f.write("{}")
        target.mkdir()  # another process made a folder there meanwhile

    with pytest.raises(IsADirectoryError) as e:
        atomic_write(target, write_then_a_folder_appears)
    assert e.value.filename == str(target)
    assert describe(e.value) == (f"{target} is a folder where a file is expected; give a file path", 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]  # the temporary file is gone
    with pytest.raises(IsADirectoryError) as e:  # refused before anything is written
        atomic_write_text(target, "{}")
    assert e.value.filename == str(target)


def test_a_full_disk_and_a_read_only_folder_stay_failed_runs():
    assert describe(OSError(errno.ENOSPC, "No space left on device", "/x"))[1] == 1
    assert describe(OSError(errno.EROFS, "Read-only file system", "/x"))[1] == 1
    assert describe(OSError(errno.ENOTDIR, "Not a directory", "/x/y"))[1] == 2

"""TorchScript archives (OpenAI's published CLIP files) read without running code: the same state dict as
``torch.jit.load(...).state_dict()``, on archives made here with torch.jit.trace and torch.jit.script."""
import warnings

import pytest
import torch
import torch.nn as nn

from fewclip.backbones.backbone import load_weights_file
from fewclip.backbones.torchscript import TorchScriptError, archive_prefix, read_torchscript_state_dict


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.ln = nn.LayerNorm(4)
        self.seq = nn.Sequential(nn.Linear(4, 4, bias=False), nn.GELU(), nn.Linear(4, 2))
        self.register_buffer("table", torch.arange(6.0).view(2, 3))
        self.register_buffer("count", torch.tensor(77))
        self.mask = torch.ones(2)  # a plain attribute, not a buffer: no state-dict entry
        self.proj = nn.Parameter(torch.randn(2, 2))

    def forward(self, x):
        return self.seq(self.ln(self.lin(x))) @ self.proj + self.table[0, :2] + self.mask


def _save(module, how: str, dtype, path):
    """Trace or script in float32, then convert (as OpenAI's float16 archives were made) and save."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.jit.trace(module, torch.randn(1, 3)) if how == "trace" else torch.jit.script(module)
        m.to(dtype).save(str(path))
        return torch.jit.load(str(path)).state_dict()


@pytest.mark.parametrize("how", ["trace", "script"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_reader_equals_jit_load(tmp_path, how, dtype):
    torch.manual_seed(0)
    m = Tiny()
    expected = _save(m, how, dtype, tmp_path / "m.pt")
    got = read_torchscript_state_dict(tmp_path / "m.pt")
    assert list(got) == list(expected)
    for k in expected:
        assert got[k].dtype == expected[k].dtype and torch.equal(got[k], expected[k]), k
    assert "seq.0.bias" not in got and "count" in got and "mask" not in got
    assert expected["proj"].dtype == dtype
    assert torch.equal(load_weights_file(tmp_path / "m.pt")["proj"], m.proj.detach().to(dtype))


def test_only_torchscript_archives_are_taken_for_one(tmp_path):
    torch.save({"w": torch.ones(2)}, tmp_path / "plain.pt")  # a torch.save zip has no code/
    assert archive_prefix(tmp_path / "plain.pt") is None
    (tmp_path / "text.pt").write_text("not a zip")
    assert archive_prefix(tmp_path / "text.pt") is None
    with pytest.raises(TorchScriptError, match="not a TorchScript archive"):
        read_torchscript_state_dict(tmp_path / "plain.pt")

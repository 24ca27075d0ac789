"""Make the repository importable as `fewclip` when it is not pip-installed.

An install maps the top-level `datasets/` and `adapters/` folders to
`fewclip.datasets` and `fewclip.adapters` (pyproject's package-dir). Without an
install, the same mapping is made here: each folder is registered in
`sys.modules` under its `fewclip.` name, so relative imports inside it work.
"""
import importlib
import importlib.machinery
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _map_subpackage(name: str, folder: str) -> None:
    full = f"fewclip.{name}"
    try:
        importlib.import_module(full)
        return
    except ModuleNotFoundError as e:
        if e.name not in (full, "fewclip"):
            raise  # the package exists but something it imports is missing: show that
    import fewclip

    path = ROOT / folder
    init = path / "__init__.py"
    if init.is_file():
        spec = importlib.util.spec_from_file_location(full, init, submodule_search_locations=[str(path)])
    else:  # no __init__.py yet: an empty package whose submodules load from the folder
        spec = importlib.machinery.ModuleSpec(full, None, is_package=True)
        spec.submodule_search_locations = [str(path)]
    module = importlib.util.module_from_spec(spec)
    sys.modules[full] = module
    setattr(fewclip, name, module)
    try:
        if spec.loader is not None:
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[full]
        delattr(fewclip, name)
        raise


_map_subpackage("datasets", "datasets")
_map_subpackage("adapters", "adapters")


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tests use tiny models: one intra-op thread avoids OpenMP spin-waits on a busy 2-core CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def shapes():
    """The toy-shapes task (rendered once per test session)."""
    from fewclip.datasets import DataConfig, build_dataset

    return build_dataset(DataConfig(name="toy-shapes"))


@pytest.fixture(autouse=True)
def feature_store(tmp_path_factory, monkeypatch):
    """Each test has a feature store of its own (fewclip.store), never the user's ~/.cache: features
    stored by one test do not change what another one encodes."""
    root = tmp_path_factory.mktemp("feature-store")
    monkeypatch.setenv("FEWCLIP_CACHE", str(root))
    return root

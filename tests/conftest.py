"""The tests run against the installed fewclip (``pip install -e ".[test]"``, README's test command): the
top-level ``adapters/`` and ``datasets/`` folders are ``fewclip.adapters`` and ``fewclip.datasets`` only once
installed (pyproject's package-dir), and fewclip's own methods are found through its entry points."""
import importlib.util
import os

if importlib.util.find_spec("fewclip.adapters") is None:  # a clone that was never installed
    raise SystemExit('fewclip is not installed in this environment: pip install -e ".[test]" (README), then rerun')

import pytest

# One thread in every process the tests start as well: the commands run as subprocesses, and the runs made in this
# process, whose thread choice (fewclip.utils.threads) would otherwise be one thread per core and undo one_thread
# below after the first run. Two such processes on a busy 2-core CPU spin-wait several times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tests use tiny models: one intra-op thread avoids OpenMP spin-waits on a busy 2-core CPU."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session", autouse=True)
def toy_renders(tmp_path_factory):
    """Each toy-world split rendered once per test session: every run on toy-shapes (hundreds of them, each
    building its dataset afresh as a command does) would render the same pixels again, 0.3 to 5 s a time. A
    split is rendered by the first test process that needs it and saved in the session's temporary folder, which
    pytest-xdist's workers share, so the other workers read it from disk (toy-objects: 4.5 s of rendering, 0.02 s
    to read). The file is named by the task's generator identity (its spec and the rendering code's digest). The
    arrays are shared read-only, so no test can change another's images. Yields the real renderer:
    test_toyworld's determinism test renders afresh with it."""
    import numpy as np

    from fewclip.datasets.toytasks import ToyTask

    base = tmp_path_factory.getbasetemp()
    # an xdist worker's folder (popen-gw0) sits in the session's; a run without workers has the session's own
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "toy-renders"
    folder.mkdir(exist_ok=True)
    render = ToyTask.render_split
    rendered = {}

    def render_once(self, split):
        if split not in self._cache:
            key = (self.generator, split)
            if key not in rendered:
                path = folder / f"{self.generator.replace(':', '-')}-{split}.npy"
                try:
                    rendered[key] = np.load(path)
                except (OSError, ValueError):  # not there yet (or being written by another worker): render it
                    rendered[key] = render(self, split)
                    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
                    with open(tmp, "wb") as f:
                        np.save(f, rendered[key])
                    os.replace(tmp, path)
                rendered[key].flags.writeable = False
            self._cache[split] = rendered[key]
        return self._cache[split]

    ToyTask.render_split = render_once
    yield render
    ToyTask.render_split = render


@pytest.fixture(scope="session")
def shapes():
    """The toy-shapes task (rendered once per test session)."""
    from fewclip.datasets import DataConfig, build_dataset

    return build_dataset(DataConfig(name="toy-shapes"))


@pytest.fixture(autouse=True)
def feature_store(tmp_path_factory, monkeypatch):
    """Each test has a feature store of its own (fewclip.features.store), never the user's ~/.cache: features
    stored by one test do not change what another one encodes."""
    root = tmp_path_factory.mktemp("feature-store")
    monkeypatch.setenv("FEWCLIP_CACHE", str(root))
    return root


# The method x geometry matrices: every method in the geometries below in the default run, the whole matrix in
# CI's full run (-m "slow or not slow"). The cosine and the hyperbolic geometry between them exercise every
# geometry code path a method reaches (a learnable scale, the Lorentz model's curvature and time component,
# distances instead of inner products); the other five are the same paths with other constants.
FAST_GEOMETRIES = ("clip", "hyperbolic")
# Methods whose default recipe costs seconds per case (ProLIP: 300 views and a 7 x 7 search): the cosine only.
HEAVY_METHODS = ("prolip",)


def method_geometry_params(methods, geometries):
    """``pytest.param(method, geometry)`` for every pair, those outside ``FAST_GEOMETRIES`` marked slow."""
    def fast(m, g):
        return g == "clip" if m in HEAVY_METHODS else g in FAST_GEOMETRIES

    return [pytest.param(m, g, marks=() if fast(m, g) else pytest.mark.slow, id=f"{m}-{g}")
            for m in methods for g in geometries]

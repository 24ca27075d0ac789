"""The manual cannot rot: its runnable examples run, its module paths exist, every registered method (a plugin's
too) gets a generated page, and the built site's method page shows its options and finds it by search in
headless Chromium.

An example is run when a line ``<!-- runnable -->`` stands right before its fenced block (```bash or ```python):
the blocks of one file run in order in one temporary folder, on the embedded reference backbones, with
FEWCLIP_CACHE set there. Examples that need a dataset, a checkpoint or a GPU carry no marker.
"""
import dataclasses
import http.server
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from helpers.chromium import DevTools, needs_chromium

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
MARKER = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w+)\s*$")


def load_hook():
    spec = importlib.util.spec_from_file_location("method_pages", DOCS / "hooks" / "method_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runnable_blocks(path: Path):
    """[(language, code, line)] of the blocks marked runnable in ``path``; a marker not followed by a fence fails."""
    lines = path.read_text().split("\n")
    blocks = []
    for i, line in enumerate(lines):
        if line.strip() != MARKER:
            continue
        m = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        assert m and m.group(1) in ("bash", "python"), f"{path.name}:{i + 1}: {MARKER} must precede ```bash or ```python"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        blocks.append((m.group(1), "\n".join(lines[i + 2:end]) + "\n", i + 1))
    return blocks


MARKED = {p: b for p in [ROOT / "README.md", *PAGES] if (b := runnable_blocks(p))}


def test_examples_are_marked():
    assert sum(len(b) for b in MARKED.values()) >= 3, "the README's and the manual's runnable examples went missing"
    assert ROOT / "README.md" in MARKED and DOCS / "getting-started.md" in MARKED


def fewclip_commands(code: str):
    """The argument lists of a bash block made of ``fewclip ...`` lines only (comments and blank lines aside),
    or None where the block holds anything else (another program, a pipe, a variable), which only bash runs."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if words[0] != "fewclip" or any(w in ("|", "&&", "||", ";", ">") or "$" in w for w in words):
            return None
        commands.append(words[1:])
    return commands


# Pages whose examples the default run runs in this process (test_runnable_examples_run_in_process below): the
# same commands through fewclip's main, without a Python start-up and torch import per command. Their runs in
# bash and fresh interpreters, as a reader types them, are in the full run (-m "slow or not slow").
IN_PROCESS = [p for p, blocks in MARKED.items()
              if all(lang == "python" or fewclip_commands(code) is not None for lang, code, _ in blocks)]


@pytest.mark.parametrize("path", [pytest.param(p, marks=[pytest.mark.slow] if p in IN_PROCESS else [])
                                  for p in MARKED], ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_examples_exit_0(path, tmp_path):
    env = dict(os.environ, FEWCLIP_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    for lang, code, line in MARKED[path]:
        cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (f"{path.name}:{line}: the example exited {done.returncode}\n{code}\n"
                                      f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}")


@pytest.mark.parametrize("path", IN_PROCESS, ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_examples_run_in_process(path, tmp_path, monkeypatch):
    """The fast twin of test_runnable_examples_exit_0: each command of a bash block through fewclip's main, each
    Python block executed here, in order, in one temporary folder."""
    from fewclip.cli.main import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FEWCLIP_CACHE", str(tmp_path / "cache"))
    for lang, code, line in MARKED[path]:
        if lang == "python":
            exec(compile(code, f"{path.name}:{line + 1}", "exec"), {"__name__": "__main__"})
            continue
        for args in fewclip_commands(code):
            assert main(args) == 0, f"{path.name}:{line}: fewclip {' '.join(args)} did not exit 0"


def test_only_fewclip_lines_run_in_process():
    assert fewclip_commands("fewclip a b=1  # note\n\nfewclip c \\\n  d\n") == [["a", "b=1"], ["c", "d"]]
    for code in ("fewclip a | head -1\n", "cd runs\nfewclip a\n", "fewclip a out=$OUT\n", "fewclip a && ls\n"):
        assert fewclip_commands(code) is None, code
    assert ROOT / "README.md" in IN_PROCESS


# Names in the manual that look like modules but are something else (entry point groups, format tags, files).
NOT_MODULES = {"fewclip.formats", "fewclip.geometries", "fewclip.launchers", "fewclip.protocol", "fewclip.json"}


def _module_file(dotted: str):
    rel = dotted.replace("fewclip.adapters", "adapters", 1).replace("fewclip.datasets", "datasets", 1).replace(".", "/")
    return (ROOT / (rel + ".py")).exists() or (ROOT / rel / "__init__.py").exists()


def test_the_manual_names_files_and_modules_that_exist():
    """fewclip's own paths (``fewclip/...``, ``adapters/x.py``) and dotted modules in the docs exist (the layout moved
    once; a page that names the old place fails here)."""
    import fewclip

    stale = []
    for page in [ROOT / "README.md", *PAGES]:
        text = page.read_text()
        for m in re.findall(r"(?<![\w/.-])((?:fewclip|adapters)/[\w./-]*\w|scripts/\w+\.py)", text):
            if not (ROOT / m).exists() and not (ROOT / m.replace("fewclip/adapters", "adapters", 1)).exists():
                stale.append(f"{page.name}: {m}")
        for m in re.findall(r"(?<![\w/.-])(fewclip(?:\.\w+)+)", text):
            parts = m.split(".")
            if len(parts) == 2 and hasattr(fewclip, parts[1]):  # the top-level API: fewclip.train, ...
                continue
            if not any(_module_file(".".join(parts[:k])) or ".".join(parts[:k]) in NOT_MODULES
                       for k in range(len(parts), 1, -1)):
                stale.append(f"{page.name}: {m}")
    assert not stale, "the docs name paths or modules that do not exist:\n" + "\n".join(sorted(set(stale)))


def test_readme_is_short_and_links_into_the_manual():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.split("\n")) <= 200
    links = re.findall(r"\]\((docs/[^)#]+)", readme)
    assert links and all((ROOT / link).exists() for link in links), [x for x in links if not (ROOT / x).exists()]
    assert "mkdocs serve" in readme and 'pip install -e ".[test]" && python -m pytest -q' in readme


# -- the generated method pages ----------------------------------------------------------------------------------
def test_every_method_fact_names_a_registered_method_and_an_existing_test():
    from fewclip.adapter.base import ADAPTERS

    hook = load_hook()
    facts = hook.method_facts()
    assert set(facts) == set(ADAPTERS.names()), "docs/data/methods.yaml and the registry disagree"
    for name, f in facts.items():
        assert (ROOT / f["parity"]["test"]).exists(), f"{name}: {f['parity']['test']} does not exist"


def test_a_plugins_method_gets_the_same_page(tmp_path):
    """A method registered from outside fewclip (as a plugin's entry point would) gets a page from the same code:
    docstring, every option with help/type/default, train defaults, presets with sources, published numbers."""
    from fewclip.adapter.base import ADAPTERS, Adapter, AdapterConfig, register_adapter
    from fewclip.config.presets import PRESETS, Preset, Setting, register_presets

    @dataclasses.dataclass
    class FakeConfig(AdapterConfig):
        width: int = dataclasses.field(default=7, metadata={"help": "How wide the fake is."})
        mode: str = dataclasses.field(default="slow", metadata={"help": "slow or fast."})

    class Fake(Adapter):
        """A fake method for the docs test: learns a fake thing."""
        trained_by = "loop"
        train_defaults = {"lr": 0.123, "epochs": 3}

    Fake.__module__ = __name__
    register_adapter("fake_docs_test", FakeConfig, Fake)
    register_presets("fake_docs_test", Preset("authors", "their recipe", settings=(
        Setting("train.lr", 0.5, "Someone/Fake@0123456 train.py:9", "their learning rate"),)))
    csv = tmp_path / "results.csv"
    csv.write_text("method,backbone,dataset,protocol,shots,metric,value,source,note,train_dataset\n"
                   "fake_docs_test,ViT-B-16/openai,caltech101,fewshot,4,top1,88.8,Someone/Fake@0123456:README.md,,\n"
                   "coop,ViT-B-16/openai,caltech101,fewshot,4,top1,11.1,x,,\n")
    try:
        page = load_hook().method_page("fake_docs_test", csv_path=csv)
    finally:
        ADAPTERS.pop("fake_docs_test")
        PRESETS.pop("fake_docs_test")
    assert page.startswith("# `fake_docs_test`")
    assert "The manual cannot rot" in page  # this module's docstring: a plugin's module documents its method
    assert "| `adapter.width` | `int` | `7` | How wide the fake is. |" in page
    assert "| `adapter.mode` | `str` | `slow` | slow or fast. |" in page
    assert "| `train.lr` | `0.123` |" in page and "| `train.epochs` | `3` |" in page
    assert "| `authors` | `train.lr` | `0.5` | Someone/Fake@0123456 train.py:9 | their learning rate |" in page
    assert "| ViT-B-16/openai | caltech101 | fewshot | 4 | top1 | 88.8 |" in page and "11.1" not in page
    assert "No parity test recorded" in page


def test_a_builtin_page_carries_its_parity_and_geometry():
    page = load_hook().method_page("tip_adapter")
    assert "`tests/parity/test_cache_parity.py`: largest difference logits 8.8e-6" in page
    assert "exp(-beta d_L)" in page and "| `adapter.tie_break` |" in page
    assert "gaopengcuhk/Tip-Adapter@d0e2d6f" in page


# -- the built site in a browser ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, OMP_NUM_THREADS="1", NO_MKDOCS_2_WARNING="1"))
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return out


@pytest.mark.slow
def test_the_site_builds_strict_with_a_page_per_method(site):
    from fewclip.adapter.base import ADAPTERS

    index = json.loads((site / "search" / "search_index.json").read_text())
    locations = {d["location"] for d in index["docs"]}
    for name in ADAPTERS.names():
        assert (site / "methods" / name / "index.html").exists()
        assert f"methods/{name}/" in locations, f"the search index lacks {name}'s page"


@pytest.mark.slow
@needs_chromium
def test_a_method_page_shows_its_options_and_search_finds_it(site, tmp_path):
    handler_cls = type("Quiet", (http.server.SimpleHTTPRequestHandler,), {"log_message": lambda *a: None})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler_cls(*a, directory=str(site)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/methods/kgcoop/"
    browser = DevTools(tmp_path / "profile")
    try:
        target = browser.call("Target.createTarget", url="about:blank")["targetId"]
        browser.session = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.call("Page.enable")
        browser.call("Page.navigate", url=url)
        while browser.read().get("method") != "Page.loadEventFired":
            pass
        headers = browser.js("Array.from(document.querySelectorAll('article table'))"
                             ".map(t => Array.from(t.querySelectorAll('th')).map(h => h.textContent.trim()))")
        options = browser.js("Array.from(document.querySelectorAll('article td code')).map(c => c.textContent)")
        # Type into Material's search box as a user would, and wait for the worker's results.
        hits = browser.js("""(async () => {
            const box = document.querySelector('input.md-search__input');
            if (!box) return 'no search box';
            box.focus(); box.value = 'kgcoop';
            for (const t of ['focus', 'input', 'keyup']) box.dispatchEvent(new Event(t, {bubbles: true}));
            for (let i = 0; i < 300; i++) {
                const links = Array.from(document.querySelectorAll('.md-search-result__link')).map(a => a.href);
                if (links.length) return links;
                await new Promise(r => setTimeout(r, 100));
            }
            return [];
        })()""")
    finally:
        browser.close()
        server.shutdown()
    assert ["option", "type", "default", "help"] in headers, headers
    assert "adapter.weight" in options and "adapter.n_ctx" in options
    assert isinstance(hits, list) and any("/methods/kgcoop/" in h for h in hits), hits

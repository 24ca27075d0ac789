"""report.html: every table of report.md read back (from the file, and from Chromium's DOM when Chromium is
installed) against report.csv; figures embedded and decodable; nothing fetched; user strings escaped."""
import base64
import csv
import io
import json
import re
import subprocess
from html.parser import HTMLParser

import pytest
from PIL import Image

from fewclip.report import ReportOptions, write_report
from fewclip.report.html import blocks, render_html
from helpers.chromium import CHROMIUM, FLAGS, DevTools, needs_chromium

# Names a browser would take for markup if they were not escaped.
METHOD = 'co<b>op</b> & "x"'
DATASET = "sha<i>pes</i>'s"


def add_run(root, method, dataset, shots, seed, top1, *, dirname=None, config=None, **extra):
    d = root / (dirname or f"{method}-{dataset}") / f"{shots}shot" / f"seed{seed}"
    d.mkdir(parents=True)
    m = {"method": method, "dataset": dataset, "backbone": "toy-clip", "shots": shots, "seed": seed,
         "top1": top1, **extra}
    (d / "metrics.json").write_text(json.dumps(m))
    if config is not None:
        (d / "config.yaml").write_text(config)
    return d


COST = dict(train_time_s=1.5, wall_time_s=2.0, images_encoded=600, peak_rss_mib=700.0, trainable_parameters=1024)


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    for seed, top1 in zip((1, 2, 3), (70.0, 80.0, 90.0)):
        add_run(root, METHOD, DATASET, 16, seed, top1, dirname="m1-d1", **COST,
                config=f"adapter:\n  name: coop\n  note: '<script>alert(1)</script>'\nseed: {seed}\nshots: 16\n")
    for seed, top1 in zip((1, 2), (61.0, 64.5)):
        add_run(root, METHOD, "colors", 16, seed, top1, dirname="m1-d2", **COST)
        add_run(root, "linear_probe", DATASET, 4, seed, 40.0 + seed, dirname="m2-d1", **COST)
    add_run(root, "zeroshot", DATASET, 0, 1, 50.0, dirname="zs-d1", **COST)
    add_run(root, "zeroshot", "colors", 0, 1, 45.0, dirname="zs-d2", **COST)
    for seed in (1, 2):
        add_run(root, "coop", "colors", 16, seed, 70.0, dirname="b2n", protocol="base2new",
                evals={"base": {"top1": 80.0 + seed}, "new": {"top1": 60.0 + seed}})
    return root


class Tables(HTMLParser):
    """Every <table>: id, caption text, header texts and rows of cell texts; every <img>'s src."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.tables, self.images, self._cell, self._in_caption, self._in_head = [], [], None, False, False

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self.tables.append({"id": a.get("id"), "caption": "", "headers": [], "rows": []})
        elif tag == "caption":
            self._in_caption = True
        elif tag == "thead":
            self._in_head = True
        elif tag == "tr" and self.tables:
            self._row = []
        elif tag in ("td", "th"):
            self._cell = []
        elif tag == "img":
            self.images.append(a.get("src", ""))

    def handle_endtag(self, tag):
        if tag == "caption":
            self._in_caption = False
        elif tag == "thead":
            self._in_head = False
        elif tag in ("td", "th") and self._cell is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self.tables:
            if self._in_head:
                self.tables[-1]["headers"] = self._row
            else:
                self.tables[-1]["rows"].append(self._row)

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)
        elif self._in_caption:
            self.tables[-1]["caption"] += data


class Nesting(HTMLParser):
    """Every element closed, in order (void elements aside)."""

    VOID = {"meta", "img", "br", "hr", "link", "input"}

    def __init__(self):
        super().__init__()
        self.stack = []

    def handle_starttag(self, tag, attrs):
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack.pop() == tag, f"</{tag}> closes {self.stack[-1:]}"


def read_tables(page: str) -> Tables:
    parser = Tables()
    parser.feed(page)
    return parser


def csv_rows(path):
    return list(csv.DictReader(io.StringIO(path.read_text())))


def first_number(text):
    m = re.match(r"[+-]?\d+\.\d+", text)
    return None if m is None else m.group(0)


def check_tables_against_csv(tables, rows, markdown):
    """Every table of report.md is on the page in order, with a caption and a unique id, and its numbers are
    report.csv's, to the two decimals the tables show."""
    md_tables = [b for b in blocks(markdown) if b[0] == "table"]
    assert sum(len(rows) + 2 for *_, rows in md_tables) == sum(line.startswith("|") for line in markdown.splitlines())
    page = {t["id"]: t for t in tables}
    assert len(page) == len(tables), "table ids are unique"
    from_md, settings = tables[:len(md_tables)], tables[len(md_tables):]  # the settings' tables come last
    assert len(md_tables) >= 4 and [t["id"] for t in settings][:1] == ["table-runs"]
    assert all(t["id"].startswith("table-config-") for t in settings[1:])
    for t, (_, headers, _, md_rows) in zip(from_md, md_tables):
        assert t["caption"].strip() and t["id"].startswith("table-")
        assert len(t["headers"]) == len(headers) and len(t["rows"]) == len(md_rows)

    fewshot = {(r["dataset"], r["method"], r["shots"]): r for r in rows if r["protocol"] == "fewshot"}
    checked = {"mean": 0, "delta": 0, "base2new": 0}
    for t in from_md:
        h = t["headers"]
        if h[:2] != ["Dataset", "Method"]:
            continue
        if h[2:] and all(x.endswith("-shot") for x in h[2:]):
            gain = t["caption"].startswith("Gain over zero-shot")
            for row in t["rows"]:
                for head, text in zip(h[2:], row[2:]):
                    r = fewshot.get((row[0], row[1], head.removesuffix("-shot")))
                    if r is None:
                        assert text == "–"
                        continue
                    want = float(r["delta_zeroshot"] if gain else r["mean"])
                    assert first_number(text) == (f"{want:+.2f}" if gain else f"{want:.2f}"), (t["id"], row, head)
                    checked["delta" if gain else "mean"] += 1
        elif h[2:] == ["Shots", "Base", "New", "H"]:
            b2n = {(r["dataset"], r["method"], r["shots"], r["eval"]): r for r in rows if r["protocol"] == "base2new"}
            for row in t["rows"]:
                for ev, text in zip(("base", "new", "hm"), row[3:]):
                    assert first_number(text) == f"{float(b2n[(row[0], row[1], row[2], ev)]['mean']):.2f}"
                    checked["base2new"] += 1
    assert checked["mean"] >= 8 and checked["delta"] >= 4 and checked["base2new"] == 3, checked


def check_self_contained(page: str):
    nesting = Nesting()
    nesting.feed(page)
    assert nesting.stack == [] and page.startswith("<!DOCTYPE html>")
    assert not re.search(r"https?:", page, re.I), "the page names nothing on the network"
    assert not re.search(r"<script|<link|<iframe|<object|<embed|@import|url\(", page, re.I)
    for m in re.finditer(r'\b(?:src|href)="([^"]*)"', page):
        assert m.group(1).startswith(("data:", "#")), m.group(1)


def decoded_images(srcs):
    """Each data: URI decoded (PNG by Pillow; SVG as XML with an <svg> root)."""
    sizes = []
    for src in srcs:
        head, _, data = src.partition(",")
        raw = base64.b64decode(data, validate=True)
        if head == "data:image/png;base64":
            with Image.open(io.BytesIO(raw)) as im:
                im.load()
                sizes.append(im.size)
        else:
            assert head == "data:image/svg+xml;base64" and b"<svg" in raw
            sizes.append(None)
    return sizes


def test_page_holds_every_table_figure_and_setting(runs, tmp_path):
    report = write_report(runs, tmp_path / "out")
    path = report.paths["html"]
    assert path == tmp_path / "out" / "report.html"
    page = path.read_text(encoding="utf-8")
    got = read_tables(page)
    check_tables_against_csv(got.tables, csv_rows(report.paths["csv"]), report.markdown)
    check_self_contained(page)

    # The figures (accuracy vs. shots, cost vs. accuracy), as PNGs that decode.
    assert len(got.images) == 2
    assert all(w > 100 and h > 100 for w, h in decoded_images(got.images))

    # Escaped: the names read back as they are, and no markup of theirs reaches the page.
    assert "<b>op</b>" not in page and "<i>pes</i>" not in page and "<script>alert" not in page
    cells = {c for t in got.tables for r in t["rows"] for c in r}
    assert METHOD in cells and DATASET in cells

    # Run settings: what ran, the confidence interval's kind, each method's config.
    runs_table = next(t for t in got.tables if t["id"] == "table-runs")
    by_method = {(r[0], r[2]): r for r in runs_table["rows"]}
    assert by_method[("fewshot", METHOD)][3:] == [f"colors, {DATASET}", "16", "1, 2, 3", "5"]
    assert by_method[("base2new", "coop")][4:] == ["16", "1, 2", "2"]
    assert "t(0.975, n-1) * std / sqrt(n)" in page
    config = next(t for t in got.tables if t["id"].startswith("table-config-"))
    values = dict(map(tuple, config["rows"]))
    assert values["seed"] == "3 values: 1, 2, 3" and values["shots"] == "16"
    assert values["adapter.note"] == "<script>alert(1)</script>"
    assert "3 runs; 2 without a readable config.yaml" in config["caption"]


def test_new_tables_appear_without_a_change_here(tmp_path):
    """Whatever table report.md gains (published results, presets...) is on the page, captioned by its heading."""
    md = ("# fewclip report\n\n## Published results\n\nSome words.\n\n"
          "| Method | Published | Gap (SE) |\n|---|---:|---:|\n| CoOp | 71.92 | -0.4 |\n| a \\| b | 1.00 | 2 |\n\n"
          "| Second | table |\n|---|---|\n| x | y |\n\nSource: [CoOp](https://example.org/coop), [notes](notes.md).\n")
    page = render_html(md, tmp_path, runs=[])
    got = read_tables(page)
    # A link off the page is shown as text, never followed; a file beside the report stays a link.
    assert "<p>Source: CoOp (https://example.org/coop), <a href=\"notes.md\">notes</a>.</p>" in page
    assert [(t["id"], t["caption"]) for t in got.tables[:2]] == [
        ("table-published-results", "Published results"), ("table-published-results-table-2", "Published results"
                                                            " (table 2)")]
    assert got.tables[0]["headers"] == ["Method", "Published", "Gap (SE)"]
    assert got.tables[0]["rows"] == [["CoOp", "71.92", "-0.4"], ["a | b", "1.00", "2"]]


@pytest.mark.parametrize("formats, embedded", [(["svg"], "svg"), (["pdf"], None)])
def test_figure_formats(runs, tmp_path, formats, embedded):
    report = write_report(runs, tmp_path / "out", options=ReportOptions(format=formats))
    page = report.paths["html"].read_text(encoding="utf-8")
    got = read_tables(page)
    check_self_contained(page)
    if embedded:
        assert len(got.images) == 2 and decoded_images(got.images) == [None, None]
    else:  # a PDF cannot be an <img>: the page says which format would embed it
        assert got.images == [] and page.count("no PNG or SVG of") == 2


# ----------------------------------------------------------------------------
# In a real browser

@needs_chromium
def test_chromium_reads_back_the_tables(runs, tmp_path):
    report = write_report(runs, tmp_path / "out")
    url = report.paths["html"].as_uri()
    # The DOM as Chromium parsed it (--dump-dom): the same tables and numbers as report.csv.
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile1'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    got = read_tables(dom)
    check_tables_against_csv(got.tables, csv_rows(report.paths["csv"]), report.markdown)
    assert {c for t in got.tables for r in t["rows"] for c in r} >= {METHOD, DATASET}
    assert len(got.images) == 2

    # Loaded and drawn: every image decodes in the browser, at the PNG's size; the page asked for nothing.
    browser = DevTools(tmp_path / "profile2")
    try:
        target = browser.call("Target.createTarget", url="about:blank")["targetId"]
        browser.session = browser.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        browser.call("Page.enable")
        browser.call("Network.enable")
        browser.call("Page.navigate", url=url)
        requests = []
        while (msg := browser.read()).get("method") != "Page.loadEventFired":
            if msg.get("method") == "Network.requestWillBeSent":
                requests.append(msg["params"]["request"]["url"])
        result = browser.call("Runtime.evaluate", awaitPromise=True, returnByValue=True, expression=(
            "Promise.all(Array.from(document.images).map(i => i.decode().then("
            "() => [i.naturalWidth, i.naturalHeight], e => [0, String(e)])))"))["result"]["value"]
        n_tables = browser.call("Runtime.evaluate", returnByValue=True,
                                expression="document.querySelectorAll('table caption').length")["result"]["value"]
    finally:
        browser.close()
    assert [list(s) for s in decoded_images(got.images)] == result and all(w > 100 for w, _ in result)
    assert n_tables == len(got.tables)
    assert [u for u in requests if not u.startswith(("file:", "data:"))] == []

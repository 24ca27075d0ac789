import csv
import json
import logging
import math

import pytest

from fewclip.report import (
    NoRunsFoundError,
    aggregate,
    build_report,
    load_runs,
    summarize,
    t_critical_975,
    write_report,
)

T2 = 4.302653  # t_{0.975, 2}


def add_run(root, method, dataset, shots, seed, top1, backbone="toy-clip", name=None, **extra):
    d = root / backbone / dataset / method / f"{shots}shot" / (name or f"seed{seed}")
    d.mkdir(parents=True)
    m = {"method": method, "dataset": dataset, "backbone": backbone, "shots": shots,
         "seed": seed, "top1": top1, **extra}
    (d / "metrics.json").write_text(json.dumps(m))
    return d


@pytest.fixture
def runs(tmp_path):
    """Two datasets; coop 16-shot on both, coop 4-shot on "shapes" only."""
    for seed, top1 in zip((1, 2, 3), (70.0, 80.0, 90.0)):
        add_run(tmp_path, "coop", "shapes", 16, seed, top1)
    for seed, top1 in zip((1, 2, 3), (60.0, 62.0, 64.0)):
        add_run(tmp_path, "coop", "colors", 16, seed, top1)
    add_run(tmp_path, "coop", "shapes", 4, 1, 65.0)  # one seed
    for seed in (1, 2):  # same zero-shot value from two seeds
        add_run(tmp_path, "zeroshot", "shapes", 0, seed, 50.0)
    add_run(tmp_path, "zeroshot", "colors", 0, 1, 40.0)
    return tmp_path


def _t_cdf_minus_half(t, df, n=2000):
    """P(0 < T < t) for Student's t, by Simpson's rule on the density."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)  # noqa: E731
    h = t / n
    s = f(0) + f(t) + sum((4 if i % 2 else 2) * f(i * h) for i in range(1, n))
    return s * h / 3


@pytest.mark.parametrize("df", [*range(1, 31), 31, 45, 100, 1000])
def test_t_critical_matches_t_distribution(df):
    assert _t_cdf_minus_half(t_critical_975(df), df) == pytest.approx(0.475, abs=1e-4)


def test_summarize_hand_computed():
    mean, std, ci = summarize([70.0, 80.0, 90.0])
    assert mean == 80.0 and std == pytest.approx(10.0)
    assert ci == pytest.approx(T2 * 10 / math.sqrt(3), rel=1e-4)
    assert summarize([65.0]) == (65.0, None, None)


def test_cells_delta_and_average(runs):
    report = build_report(runs)
    c = report.cell("toy-clip", "shapes", "coop", 16)
    assert (c.mean, c.n, c.seeds) == (80.0, 3, (1, 2, 3))
    assert c.std == pytest.approx(10.0)
    assert c.ci95 == pytest.approx(T2 * 10 / math.sqrt(3), rel=1e-4)
    assert c.delta_zeroshot == pytest.approx(30.0)
    zs = report.cell("toy-clip", "shapes", "zeroshot", 0)
    assert (zs.mean, zs.std, zs.ci95, zs.delta_zeroshot) == (50.0, 0.0, 0.0, 0.0)
    assert report.cell("toy-clip", "colors", "coop", 16).delta_zeroshot == pytest.approx(22.0)

    avg = report.cell("toy-clip", "average", "coop", 16)
    assert avg.mean == pytest.approx(71.0)  # (80 + 62) / 2
    assert avg.delta_zeroshot == pytest.approx(26.0)  # (30 + 22) / 2
    assert (avg.n, avg.datasets, avg.complete) == (2, ("colors", "shapes"), True)
    partial = report.cell("toy-clip", "average", "coop", 4)
    assert (partial.mean, partial.datasets, partial.complete) == (65.0, ("shapes",), False)
    assert report.cell("toy-clip", "average", "zeroshot", 0).mean == pytest.approx(45.0)


def test_no_zeroshot_gives_no_delta(tmp_path):
    add_run(tmp_path, "coop", "shapes", 16, 1, 70.0)
    (c, avg) = build_report(tmp_path).cells
    assert c.delta_zeroshot is None and avg.delta_zeroshot is None
    assert "no gain over zero-shot" in build_report(tmp_path).markdown


def test_write_report_files(runs, tmp_path):
    out = tmp_path / "out"
    report = write_report(runs, out)
    for name in ("report.md", "report.csv", "report.json", "accuracy_vs_shots.png"):
        assert (out / name).is_file(), name
    assert (out / "accuracy_vs_shots.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".*.tmp"))

    md = (out / "report.md").read_text()
    assert md == report.markdown
    assert "80.00 [55.16, 100.00] (3)" in md and "65.00 (1)" in md  # one seed: mean alone; 80 ± 24.84 clipped
    assert "62.00 ± 4.97 (3)" in md  # an interval inside 0-100: mean ± half-width
    assert "+30.00" in md and "+26.00" in md
    assert "71.00" in md and "65.00 (1/2)†" in md and "(missing: colors)" in md
    assert "nan" not in md.lower()

    rows = list(csv.DictReader((out / "report.csv").open()))
    assert len(rows) == len(report.cells) == 5 + 3
    row = next(r for r in rows if (r["dataset"], r["shots"]) == ("shapes", "16"))
    assert float(row["mean"]) == 80.0 and float(row["std"]) == 10.0 and row["n"] == "3"
    assert float(row["ci95"]) == pytest.approx(24.8414, abs=1e-3)
    assert float(row["delta_zeroshot"]) == 30.0 and row["seeds"] == "1;2;3"
    single = next(r for r in rows if (r["dataset"], r["shots"]) == ("shapes", "4"))
    assert (single["std"], single["ci95"], single["n"]) == ("", "", "1")
    avg = next(r for r in rows if (r["dataset"], r["method"], r["shots"]) == ("average", "coop", "16"))
    assert float(avg["mean"]) == 71.0 and avg["datasets"] == "colors;shapes"
    assert "nan" not in (out / "report.csv").read_text().lower()

    text = (out / "report.json").read_text()
    assert "NaN" not in text
    data = json.loads(text)["backbones"]["toy-clip"]
    assert data["datasets"] == ["colors", "shapes"]
    assert data["results"]["shapes"]["coop"]["16"]["values"] == [70.0, 80.0, 90.0]
    assert data["results"]["shapes"]["coop"]["4"]["ci95"] is None
    assert data["results"]["average"]["coop"]["4"]["complete"] is False


def test_the_report_command_in_a_fresh_process(runs):
    """`fewclip report` as a user runs it (the default run's real process of the command; the manual's examples
    run it in this process): exit 0, the tables on stdout, the files beside the runs, no trace."""
    import subprocess
    import sys
    from pathlib import Path

    p = subprocess.run([str(Path(sys.executable).parent / "fewclip"), "report", str(runs)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr
    md = (runs / "report.md").read_text()
    assert md in p.stdout and "80.00 [55.16, 100.00] (3)" in md
    assert f"report: {runs / 'report.md'}" in p.stdout and (runs / "accuracy_vs_shots.png").is_file()


def test_the_report_and_the_dataset_listing_load_no_model(runs):
    """`fewclip report` and `fewclip datasets` import neither torch nor open_clip (seconds each): they answer at
    once (fewclip.cli.light)."""
    import subprocess
    import sys

    code = ("import sys\nfrom fewclip.cli.main import main\n"
            f"assert main(['report', {str(runs)!r}]) == 0 and main(['datasets']) == 0\n"
            "print(sorted(m for m in ('torch', 'open_clip', 'torchvision') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "w2-land" in p.stdout and "80.00 [55.16, 100.00] (3)" in p.stdout  # both commands printed their tables
    assert p.stdout.strip().splitlines()[-1] == "[]", p.stdout[-500:]


def test_default_out_dir_and_edge_shapes(tmp_path):
    """One dataset, one shot value, one seed, no zero-shot: still a report and a figure."""
    add_run(tmp_path, "lora", "shapes", 8, 0, 55.5)
    report = write_report(tmp_path)
    assert (tmp_path / "accuracy_vs_shots.png").is_file() and "55.50 (1)" in report.markdown


def test_several_backbones_get_a_figure_each(tmp_path):
    add_run(tmp_path, "coop", "shapes", 1, 1, 40.0, backbone="ViT-B/16")
    add_run(tmp_path, "coop", "shapes", 1, 1, 30.0, backbone="toy-clip")
    report = write_report(tmp_path, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert names == ["accuracy_vs_shots.png", "accuracy_vs_shots_ViT-B_16.png",
                     "accuracy_vs_shots_toy-clip.png"]
    assert "accuracy_vs_shots_toy-clip.png" in report.markdown


@pytest.mark.parametrize("content", [
    "{not json", "[1, 2]", '{"method": "coop"}',
    '{"method": "coop", "dataset": "d", "backbone": "b", "shots": 4, "seed": 1, "top1": NaN}',
    '{"method": "coop", "dataset": "d", "backbone": "b", "shots": "4", "seed": 1, "top1": 50}',
])
def test_malformed_metrics_skipped_with_warning(runs, content, caplog):
    bad = runs / "broken" / "metrics.json"
    bad.parent.mkdir()
    bad.write_text(content)
    with caplog.at_level(logging.WARNING, logger="fewclip.report"):
        report = build_report(runs)
    assert len(report.runs) == 10 and [s.path for s in report.skipped] == [bad]
    assert str(bad) in caplog.text
    assert "broken/metrics.json" in report.markdown


def test_duplicates_keep_first_in_path_order(tmp_path, caplog):
    add_run(tmp_path, "coop", "shapes", 16, 1, 10.0, name="a")
    add_run(tmp_path, "coop", "shapes", 16, 1, 99.0, name="b")
    add_run(tmp_path, "coop", "shapes", 16, 2, 20.0, name="c")
    (tmp_path / "no_metrics_here").mkdir()
    with caplog.at_level(logging.WARNING, logger="fewclip.report"):
        runs, skipped = load_runs(tmp_path)
    assert [r.top1 for r in runs] == [10.0, 20.0]
    assert len(skipped) == 1 and skipped[0].path.parent.name == "b"
    assert "duplicate" in caplog.text
    assert aggregate(runs)[0].mean == 15.0


def test_empty_dir_raises(tmp_path):
    (tmp_path / "run1").mkdir()
    with pytest.raises(NoRunsFoundError, match="metrics.json") as e:
        write_report(tmp_path)
    assert isinstance(e.value, ValueError) and str(tmp_path) in str(e.value)
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(NoRunsFoundError, match="does not exist"):
        build_report(tmp_path / "missing")
    (tmp_path / "run1" / "metrics.json").write_text("{}")
    with pytest.raises(NoRunsFoundError, match="1 metrics.json file"):
        build_report(tmp_path)


def test_cost_table_and_figure(tmp_path):
    """Runs that record their cost get a cost table (means over datasets and seeds, beside the average top-1) and
    a cost-vs-accuracy figure; runs without one are left out of it."""
    def cost(train, wall, images, rss, params, cuda=None):
        return dict(train_time_s=train, wall_time_s=wall, images_encoded=images, peak_rss_mib=rss,
                    peak_cuda_mib=cuda, trainable_parameters=params)

    add_run(tmp_path, "zeroshot", "shapes", 0, 1, 50.0, **cost(0.0, 0.5, 40, 700.0, 0))
    add_run(tmp_path, "zeroshot", "colors", 0, 1, 40.0, **cost(0.0, 0.7, 40, 702.0, 0))
    add_run(tmp_path, "coop", "shapes", 4, 1, 70.0, **cost(2.0, 3.0, 100, 800.0, 1024))
    add_run(tmp_path, "coop", "shapes", 4, 2, 72.0, **cost(4.0, 5.0, 100, 810.0, 1024))
    add_run(tmp_path, "coop", "colors", 4, 1, 60.0, **cost(6.0, 7.0, 130, 820.0, 1024))
    add_run(tmp_path, "lora", "shapes", 4, 1, 75.0, **cost(30.0, 31.0, 5000, 900.0, 5376, cuda=512.0))
    add_run(tmp_path, "lora", "colors", 4, 1, 65.0, **cost(32.0, 33.0, 5000, 910.0, 5376, cuda=514.0))
    add_run(tmp_path, "linear_probe", "shapes", 4, 1, 66.0)  # an older run: no cost recorded
    report = write_report(tmp_path, tmp_path / "out")
    by = {(c.method, c.shots): c for c in report.costs}
    assert set(by) == {("zeroshot", 0), ("coop", 4), ("lora", 4)}
    coop = by[("coop", 4)]
    assert (coop.n, coop.train_time_s, coop.wall_time_s, coop.images_encoded, coop.peak_memory_mib) == \
        (3, 4.0, 5.0, 110.0, 810.0)
    assert coop.trainable_parameters == 1024 and coop.memory == "rss"
    assert coop.top1 == pytest.approx((71.0 + 60.0) / 2)  # the average row: mean of the dataset means
    assert by[("lora", 4)].peak_memory_mib == 513.0 and by[("lora", 4)].memory == "cuda"  # the CUDA peak
    md = report.markdown
    assert "### Cost, `toy-clip`" in md
    cost_section = md[md.index("### Cost"):]
    table = [[cell.strip() for cell in line.strip("|").split("|")] for line in cost_section.splitlines()
             if line.startswith("| ")]
    header = table[0]
    row = dict(zip(header, next(r for r in table if r[0] == "coop")))
    assert row == {"Method": "coop", "Shots": "4", "Trainable params": "1,024", "Train time (s)": "4.00",
                   "Wall time (s)": "5.00", "Images encoded": "110", "Peak memory (MiB)": "810",
                   "Top-1 (%)": "65.50", "Runs": "3"}
    assert "![cost vs. accuracy, toy-clip](cost_vs_accuracy.png)" in md
    png = tmp_path / "out" / "cost_vs_accuracy.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads((tmp_path / "out" / "report.json").read_text())["backbones"]["toy-clip"]["cost"]
    assert data["coop"]["4"]["train_time_s"] == 4.0 and data["coop"]["4"]["runs"] == 3
    assert data["zeroshot"]["0"]["images_encoded"] == 40.0


def test_a_report_for_a_paper(tmp_path):
    """Three seeds far apart: the 95% interval passes 100% and 0%; the figure's bars and the table stay inside
    0-100. Two out folders merged, methods chosen and renamed, shots picked, PDF/SVG figures and LaTeX tables."""
    from matplotlib.figure import Figure

    from fewclip.cli.main import main
    from fewclip.report.plots import clipped_yerr

    a, b = tmp_path / "a", tmp_path / "b"
    for seed, top1 in zip((1, 2, 3), (60.0, 99.0, 100.0)):
        add_run(a, "coop", "shapes", 16, seed, top1)
        add_run(a, "coop", "shapes", 1, seed, top1 - 59.0)  # 1, 40, 41: the interval passes 0
    for seed in (1, 2, 3):
        add_run(b, "tip_adapter_f", "shapes", 16, seed, 80.0 + seed)
        add_run(b, "linear_probe", "shapes", 16, seed, 30.0 + seed)
    add_run(a, "zeroshot", "shapes", 0, 1, 50.0)
    rep = build_report([a, b])
    c16 = rep.cell("toy-clip", "shapes", "coop", 16)
    assert c16.mean + c16.ci95 > 100 and rep.cell("toy-clip", "shapes", "coop", 1).mean - c16.ci95 < 0
    below, above = clipped_yerr([c16, rep.cell("toy-clip", "shapes", "coop", 1)])
    assert c16.mean + above[0] == pytest.approx(100.0) and rep.cell("toy-clip", "shapes", "coop", 1).mean - below[1] == 0
    assert "[" in rep.markdown and "100.00]" in rep.markdown  # the clipped interval's ends
    assert isinstance(Figure, type)
    out = tmp_path / "paper"
    assert main(["report", str(a), str(b), "methods=[zeroshot,coop,tip_adapter_f]",
                 "rename={coop: CoOp, tip_adapter_f: Tip-Adapter-F}", "shots=[16]", "format=[png,pdf,svg]",
                 f"out={out}"]) == 0
    md = (out / "report.md").read_text()
    assert "| CoOp " in md and "| Tip-Adapter-F " in md and "| zeroshot " in md
    assert "linear_probe" not in md and "1-shot" not in md  # not chosen
    for name in ("accuracy_vs_shots.png", "accuracy_vs_shots.pdf", "accuracy_vs_shots.svg"):
        assert (out / name).stat().st_size > 0
    assert (out / "accuracy_vs_shots.pdf").read_bytes()[:4] == b"%PDF"
    tex = (out / "report.tex").read_text()
    assert r"\begin{tabular}" in tex and r"\toprule" in tex and "Tip-Adapter-F" in tex
    assert r"\textbf{" in tex  # the best 16-shot mean of the column
    rows = list(csv.DictReader((out / "report.csv").open()))
    assert {r["method"] for r in rows} == {"zeroshot", "CoOp", "Tip-Adapter-F"}


def test_report_help_lists_its_options_without_loading_models():
    import subprocess
    import sys

    code = ("import sys, fewclip.cli.main; fewclip.cli.main.main(['report', '--help']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "rename: {}  # method -> the name the tables and figures show" in out
    assert "format: [png]  # figure formats" in out and out.strip().endswith("False")


def test_a_pipe_in_a_name_stays_in_its_cell(tmp_path):
    """A method or dataset named with a '|' (a sweep variant's key, a folder of images) must not split the row
    of report.md's tables, and report.html and report.tex must show the name whole."""
    from fewclip.report.html import blocks

    for seed, top1 in zip((1, 2), (70.0, 74.0)):
        add_run(tmp_path / "runs", "coop|wide", "shapes|v2", 4, seed, top1)
        add_run(tmp_path / "runs", "zeroshot", "shapes|v2", 0, seed, 50.0)
    out = tmp_path / "out"
    write_report(tmp_path / "runs", out)
    md = (out / "report.md").read_text()
    tables = [b for b in blocks(md) if b[0] == "table"]
    assert tables
    for _, headers, _, rows in tables:
        for row in rows:
            assert len(row) == len(headers), (headers, row)
    cells = {c for *_, rows in tables for row in rows for c in row}
    assert any("coop|wide" in c for c in cells) and any("shapes|v2" in c for c in cells)
    tex = (out / "report.tex").read_text()
    assert "coop|wide" not in tex and r"coop\textbar{}wide" in tex
    assert "<td><code>coop|wide</code></td>" in (out / "report.html").read_text()

"""The published-results table (fewclip.published), `fewclip published`, and the report's comparison with it."""
import csv
import json
import math
import statistics
import subprocess
import sys

import pytest

import fewclip.adapters  # noqa: F401  (registers the built-in methods)
import fewclip.datasets  # noqa: F401  (registers the built-in datasets)
from fewclip.adapter.base import ADAPTERS
from fewclip.cli.main import main
from fewclip.data.base import DATASETS
from fewclip.published import (
    AVERAGE,
    COLUMNS,
    ELEVEN,
    PROTOCOLS,
    RESULTS_FILE,
    PublishedError,
    backbone_checksums,
    backbone_key,
    filter_rows,
    load_table,
    parse_options,
    shipped_table,
)
from fewclip.report import ReportOptions, build_report, write_report

VIT_SHA = "5806e77cd80f8b59890b7e101eabd078d9fb84e6937f9e85e4ecb61988df416f"  # backbones.csv: ViT-B-16.pt


def add_run(root, method, dataset, shots, seed, top1, backbone="ViT-B-16-quickgelu/openai", sha=None, **extra):
    d = root / backbone.replace("/", "_") / dataset / method / f"{shots}shot" / f"seed{seed}"
    d.mkdir(parents=True)
    m = {"method": method, "dataset": dataset, "backbone": backbone, "shots": shots, "seed": seed, "top1": top1,
         "backbone_info": {"name": backbone, "weights_sha256": sha}, **extra}
    (d / "metrics.json").write_text(json.dumps(m))
    return d


def add_base2new(root, method, dataset, seed, base, new, **kw):
    evals = {"base": {"top1": base}, "new": {"top1": new}}
    return add_run(root, method, dataset, 16, seed, base, protocol="base2new", evals=evals, **kw)


def published(method, dataset, protocol, shots, metric, backbone="ViT-B-16/openai"):
    rows = filter_rows(shipped_table(), [method], [dataset], [protocol], [backbone], [shots], [metric])
    assert len(rows) == 1, rows
    return rows[0].value


# ---------------------------------------------------------------------------
# The table


def test_shipped_table_parses_with_sources_and_no_duplicates():
    rows = load_table()
    assert len(rows) > 200
    with open(RESULTS_FILE, newline="") as f:
        raw = list(csv.DictReader(f))
    assert tuple(raw[0]) == COLUMNS and len(raw) == len(rows)
    keys = [tuple(r.values()) for r in raw]
    assert len(set(keys)) == len(keys)  # no row twice
    for r in rows:
        assert 0.0 <= r.value <= 100.0 and r.protocol in PROTOCOLS
        assert "@" in r.source and ":" in r.source  # owner/repo@commit:path (table)
        assert r.backbone in set(backbone_checksums().values())


def test_table_names_are_fewclips():
    rows = shipped_table()
    # a method scored again by a transductive plug-in is named as fewclip's reports name it: METHOD+MODE
    from fewclip.training.transductive import MODES

    for r in rows:
        method, _, mode = r.method.partition("+")
        assert method in ADAPTERS.names() and (not mode or mode in MODES), r.method
    assert {r.dataset for r in rows} - {AVERAGE} <= set(DATASETS.names())
    assert set(ELEVEN) <= set(DATASETS.names())
    # the tables the issue asks for: 11-dataset few-shot and base-to-new for ViT-B/16, and RN50 numbers
    assert {(r.protocol, r.dataset, r.backbone) for r in rows} >= {
        ("fewshot", AVERAGE, "ViT-B-16/openai"), ("base2new", AVERAGE, "ViT-B-16/openai"),
        ("fewshot", "imagenet", "RN50/openai"), ("domain_shift", "imagenet_a", "RN50/openai")}


@pytest.mark.parametrize("edit, match", [
    (lambda r: r.update(value="101"), r"percentage in \[0, 100\]"),
    (lambda r: r.update(value="nan"), r"percentage in \[0, 100\]"),
    (lambda r: r.update(source=""), "empty source"),
    (lambda r: r.update(protocol="few_shot"), "protocol must be one of"),
    (lambda r: r.update(metric="hm"), "metric under fewshot"),
    (lambda r: r.update(backbone="ViT-B-16"), "ARCH/TAG"),
])
def test_bad_table_is_one_clear_error(tmp_path, edit, match):
    row = dict(zip(COLUMNS, ["coop", "ViT-B-16/openai", "caltech101", "fewshot", "16", "top1", "90.0",
                             "a/b@c:README.md", "", ""]))
    edit(row)
    path = tmp_path / "t.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, COLUMNS)
        w.writeheader()
        w.writerow(row)
    with pytest.raises(PublishedError, match=match):
        load_table(path)


def test_duplicate_row_is_refused(tmp_path):
    line = "coop,ViT-B-16/openai,caltech101,fewshot,16,top1,90.0,a/b@c:README.md,,\n"
    path = tmp_path / "t.csv"
    path.write_text(",".join(COLUMNS) + "\n" + line + line)
    with pytest.raises(PublishedError, match="line 3: a duplicate of line 2"):
        load_table(path)


# ---------------------------------------------------------------------------
# Filtering and the command


def test_filter():
    rows = shipped_table()
    coop = filter_rows(rows, method=["coop"], protocol=["base2new"])
    assert coop and all(r.method == "coop" and r.protocol == "base2new" for r in coop)
    by_name = filter_rows(rows, backbone=["ViT-B-16-quickgelu/openai"])
    assert by_name == filter_rows(rows, backbone=[VIT_SHA]) == filter_rows(rows, backbone=["ViT-B-16/openai"])
    assert by_name and len(by_name) < len(rows)
    gda = filter_rows(rows, method=["gda"], dataset=["caltech101"], shots=[16], backbone=["RN50/openai"])
    assert [(r.protocol, r.metric) for r in gda] == [("fewshot", "top1")]
    assert filter_rows(rows, method=["no-such-method"]) == []
    assert backbone_key("ViT-B-16/x.pt", VIT_SHA) == "ViT-B-16/openai"
    assert backbone_key("toy-clip") == "toy-clip"


def test_options_parse():
    o = parse_options(["method=coop,cocoop", "protocol=few_shot", "shots=[1,16]", "sources=false"])
    assert (o.method, o.protocol, o.shots, o.sources) == (["coop", "cocoop"], ["fewshot"], [1, 16], False)
    for bad in (["shots=x"], ["protocol=nope"], ["colour=red"], ["sources=maybe"]):
        with pytest.raises(PublishedError):
            parse_options(bad)


def test_command_lists_filtered_rows(capsys):
    assert main(["published", "method=gda", "dataset=caltech101", "backbone=RN50/openai", "shots=16"]) == 0
    out = capsys.readouterr().out
    expected = published("gda", "caltech101", "fewshot", 16, "top1", "RN50/openai")
    assert f"{expected:.2f}" in out and "mrflogs/ICLR24@" in out and "1 published result(s)" in out
    assert "over the ten others" not in out
    assert main(["published", "protocol=cross_dataset", "method=coop"]) == 0
    out = capsys.readouterr().out
    assert "average (from imagenet)" in out and "63.88" in out and "over the ten others" in out
    assert main(["published", "colour=red"]) == 2
    assert "unknown argument 'colour=red'" in capsys.readouterr().err
    assert main(["published", "--help"]) == 0
    assert "backbone: []" in capsys.readouterr().out


def test_command_imports_no_torch():
    code = ("import sys; from fewclip.cli.main import main; main(['published', 'method=coop']); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# ---------------------------------------------------------------------------
# The report beside the published results


def test_report_shows_published_value_and_gap(tmp_path):
    seeds = {1: (97.0, 94.0), 2: (98.0, 95.0), 3: (99.0, 93.0)}
    for seed, (base, new) in seeds.items():
        add_base2new(tmp_path, "gda", "caltech101", seed, base, new)
    pub_base = published("gda", "caltech101", "base2new", 16, "base")
    pub_new = published("gda", "caltech101", "base2new", 16, "new")
    rep = write_report(tmp_path, options=None)
    got = {c.row.metric: c for c in rep.published}
    assert set(got) == {"base", "new"}  # the log gives no hm for one dataset
    bases = [b for b, _ in seeds.values()]
    se = statistics.stdev(bases) / math.sqrt(3)
    assert got["base"].mean == pytest.approx(98.0) and got["base"].n == 3
    assert got["base"].gap == pytest.approx((98.0 - pub_base) / se)
    assert got["new"].gap == pytest.approx((94.0 - pub_new) / (statistics.stdev([94.0, 95.0, 93.0]) / math.sqrt(3)))
    md = (tmp_path / "report.md").read_text()
    assert "## Published results" in md and f"{pub_base:.2f}" in md and f"{got['base'].gap:+.1f}" in md
    rows = list(csv.DictReader((tmp_path / "published.csv").open()))
    assert [r["metric"] for r in rows] == ["base", "new"]
    assert float(rows[0]["published"]) == pub_base and float(rows[0]["gap_se"]) == pytest.approx(got["base"].gap,
                                                                                                  abs=1e-3)


def test_report_matches_by_checksum_and_averages_eleven_datasets(tmp_path):
    # CoOp 16-shot on all 11 datasets, two seeds, on a local copy of OpenAI's ViT-B-16.pt (matched by sha256)
    per_seed = {1: 78.0, 2: 80.0}
    for i, ds in enumerate(ELEVEN):
        for seed, avg in per_seed.items():
            add_run(tmp_path, "coop", ds, 16, seed, avg + (i - 5), backbone="ViT-B-16-quickgelu/ViT-B-16.pt",
                    sha=VIT_SHA)
    add_run(tmp_path, "coop", "caltech101", 16, 3, 70.0, backbone="ViT-B-16-quickgelu/ViT-B-16.pt", sha=VIT_SHA)
    rep = build_report(tmp_path)
    avg = [c for c in rep.published if c.row.dataset == AVERAGE]
    assert len(avg) == 1 and avg[0].n == 2  # seed 3 is on one dataset only: not in the average
    expected = published("coop", AVERAGE, "fewshot", 16, "top1")
    se = statistics.stdev(per_seed.values()) / math.sqrt(2)
    assert avg[0].mean == pytest.approx(79.0) and avg[0].gap == pytest.approx((79.0 - expected) / se)
    assert f"{expected:.2f}" in rep.markdown


def test_average_hm_and_one_seed_is_na(tmp_path):
    for ds in ELEVEN:
        add_base2new(tmp_path, "zeroshot", ds, 1, 70.0, 74.0)
    for r in list(tmp_path.rglob("metrics.json")):  # a zero-shot run is at 0 shots
        m = json.loads(r.read_text())
        m["shots"] = 0
        r.write_text(json.dumps(m))
    rep = build_report(tmp_path)
    got = {c.row.metric: c for c in rep.published if c.row.dataset == AVERAGE}
    assert set(got) == {"base", "new", "hm"}
    assert got["hm"].mean == pytest.approx(2 * 70 * 74 / 144) and got["hm"].gap is None
    assert "| n/a |" in rep.markdown


def test_renamed_method_still_matches(tmp_path):
    for seed in (1, 2):
        add_base2new(tmp_path, "gda", "dtd", seed, 80.0 + seed, 60.0)
    rep = build_report(tmp_path, ReportOptions(rename={"gda": "GDA"}))
    assert {c.method for c in rep.published} == {"GDA"} and len(rep.published) == 2


def test_no_match_shows_nothing(tmp_path):
    add_run(tmp_path, "coop", "caltech101", 16, 1, 90.0, backbone="toy-clip")  # a backbone nobody published
    add_run(tmp_path, "coop", "toy-shapes", 16, 1, 90.0)  # a dataset nobody published
    add_run(tmp_path, "coop", "caltech101", 3, 1, 90.0)  # shots nobody published
    rep = write_report(tmp_path)
    assert rep.published == [] and "Published results" not in rep.markdown
    assert not (tmp_path / "published.csv").exists()
    add_base2new(tmp_path, "gda", "dtd", 1, 80.0, 60.0)
    assert build_report(tmp_path).published
    assert build_report(tmp_path, ReportOptions(published=False)).published == []


def test_domain_shift_runs_match_their_test_sets(tmp_path):
    targets = ("imagenet_v2", "imagenet_sketch", "imagenet_a", "imagenet_r")
    for seed, top1 in ((1, 63.0), (2, 64.0)):
        evals = {"source": {"top1": top1}, **{t: {"top1": 30.0 + seed} for t in targets}}
        add_run(tmp_path, "coop", "imagenet", 16, seed, top1, backbone="RN50-quickgelu/openai",
                protocol="domain_shift", evals=evals)
    rep = build_report(tmp_path)
    got = {c.row.dataset: c for c in rep.published}
    assert set(got) == {"imagenet", *targets}
    assert all(c.row.train_dataset == "imagenet" and c.n == 2 for c in got.values())
    src = got["imagenet"]
    assert src.mean == pytest.approx(63.5)
    assert src.gap == pytest.approx((63.5 - src.row.value) / 0.5)  # SE of (63, 64) is 0.5
    assert "imagenet (source)" in rep.markdown and "imagenet_a (from imagenet)" in rep.markdown


def test_cross_dataset_runs_match_the_mean_over_the_ten_other_datasets(tmp_path):
    from fewclip.published import ELEVEN

    targets = [d for d in ELEVEN if d != "imagenet"]
    for seed, shift in ((1, 0.0), (2, 1.0)):
        evals = {"source": {"top1": 71.0}, **{t: {"top1": 60.0 + i + shift} for i, t in enumerate(targets)}}
        add_run(tmp_path, "coop", "imagenet", 16, seed, 71.0, protocol="cross_dataset", evals=evals)
    rep = build_report(tmp_path)
    avg = [c for c in rep.published if c.row.protocol == "cross_dataset" and c.row.dataset == AVERAGE]
    assert len(avg) == 1 and avg[0].row.train_dataset == "imagenet" and avg[0].row.value == pytest.approx(63.88)
    assert avg[0].n == 2 and avg[0].mean == pytest.approx(64.5 + 0.5)  # seed means 64.5 and 65.5
    add_run(tmp_path, "coop", "imagenet", 16, 3, 71.0, protocol="cross_dataset",
            evals={"source": {"top1": 71.0}, **{t: {"top1": 99.0} for t in targets[:-1]}})  # one target missing
    again = [c for c in build_report(tmp_path).published if c.row.dataset == AVERAGE]
    assert again[0].n == 2  # the seed without all ten targets is not averaged

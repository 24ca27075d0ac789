"""What a report owes its reader: every planned run accounted for (finished, failed with its error, missing), the
mean per-class accuracy and the lines without learning beside top-1, cells that mix configs marked, and no foreign
file able to stop it."""
import csv
import json
import logging
import os
import re
import shutil

import pytest

from fewclip.cli.main import main
from fewclip.report import build_report, write_report
from fewclip.report.plots import method_colour
from fewclip.report.runs import CSV_COLUMNS

OLD_CSV_COLUMNS = ("backbone", "dataset", "method", "shots", "mean", "std", "ci95", "n", "delta_zeroshot", "seeds",
                   "datasets", "protocol", "eval")


def add_run(root, method, dataset, shots, seed, top1, backbone="toy-clip", **extra):
    d = root / backbone / dataset / method / f"{shots}shot" / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "metrics.json").write_text(json.dumps({"method": method, "dataset": dataset, "backbone": backbone,
                                                "shots": shots, "seed": seed, "top1": top1, **extra}))
    return d


# ---------------------------------------------------------------- foreign files never stop a report


@pytest.mark.parametrize("content, why", [
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"method": "coop", "dataset": "d", "backbone": "toy-clip", "shots": ' + str(10**30)
     + ', "seed": 1, "top1": 50}', "at most"),
    ('{"method": "coop", "dataset": "d", "backbone": "toy-clip", "shots": 4, "seed": 1e300, "top1": 50}', "at most"),
    ('{"method": "coop", "dataset": "d", "backbone": "toy-clip", "shots": 4, "seed": 1, "top1": 50, "per_class": '
     + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_one_foreign_file_is_skipped_with_one_warning_and_the_report_is_whole(tmp_path, content, why, caplog):
    add_run(tmp_path, "coop", "d", 4, 1, 60.0)
    bad = tmp_path / "foreign" / "metrics.json"
    bad.parent.mkdir()
    bad.write_text(content)
    with caplog.at_level(logging.WARNING, logger="fewclip.report"):
        report = write_report(tmp_path, tmp_path / "out")  # before: RecursionError / TypeError, no figures or html
    assert [s.path for s in report.skipped] == [bad] and why in report.skipped[0].reason
    assert [r.message for r in caplog.records if str(bad) in r.getMessage()] and \
        len([r for r in caplog.records if str(bad) in r.getMessage()]) == 1
    for name in ("report.md", "report.csv", "report.json", "accuracy_vs_shots.png", "report.html"):
        assert (tmp_path / "out" / name).is_file(), name


@pytest.mark.parametrize("config", ["a: " + "[" * 100_000 + "]" * 100_000 + "\n", "a:\n  " + "- " * 100_000 + "x\n"])
def test_a_deeply_nested_config_yaml_beside_a_run_is_left_out_of_the_page(tmp_path, config, caplog):
    d = add_run(tmp_path, "coop", "d", 4, 1, 60.0)
    (d / "config.yaml").write_text(config)
    with caplog.at_level(logging.WARNING, logger="fewclip.report"):
        write_report(tmp_path, tmp_path / "out")  # before: libyaml's composer overflowed the C stack (segfault)
    assert "nested more than" in caplog.text and str(d / "config.yaml") in caplog.text
    assert (tmp_path / "out" / "report.html").is_file()


def test_impossible_costs_are_left_out_not_an_overflow(tmp_path):
    for seed in (1, 2):
        add_run(tmp_path, "coop", "d", 4, seed, 50.0, wall_time_s=1.7e308, train_time_s=1.7e308, images_encoded=1e308)
    add_run(tmp_path, "coop", "d", 4, 3, 50.0, n_test_per_class={"a": 10**400, "b": 1})
    report = write_report(tmp_path, tmp_path / "out")  # before: OverflowError in fsum, no report
    assert report.cell("toy-clip", "d", "coop", 4).mean == 50.0 and not report.costs


def test_symlinked_run_folders_are_followed_and_a_link_cycle_ends(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    add_run(elsewhere, "coop", "d", 4, 1, 60.0)
    root = tmp_path / "root"
    add_run(root, "coop", "d", 4, 2, 70.0)
    (root / "linked").symlink_to(elsewhere / "toy-clip", target_is_directory=True)
    (root / "toy-clip" / "loop").symlink_to(root, target_is_directory=True)  # a cycle
    report = build_report(root)  # before: the linked run silently left out
    assert report.cell("toy-clip", "d", "coop", 4).values == (60.0, 70.0)
    only_link = tmp_path / "only_link"
    only_link.mkdir()
    (only_link / "run").symlink_to(elsewhere, target_is_directory=True)
    assert build_report(only_link).cell("toy-clip", "d", "coop", 4).n == 1  # before: "no runs found"


def test_a_metrics_json_without_a_run_record_is_marked(tmp_path):
    add_run(tmp_path, "coop", "d", 4, 1, 60.0)
    md = build_report(tmp_path).markdown
    assert "60.00 (1)◊" in md and "no run record" in md
    assert build_report(tmp_path).cells[0].unrecorded == 1


def test_a_newline_in_a_method_name_does_not_split_a_row(tmp_path):
    add_run(tmp_path, "co\nop", "d", 4, 1, 60.0)
    add_run(tmp_path, "tip", "d", 4, 1, 50.0)
    md = build_report(tmp_path).markdown
    table = md.split("## Backbone `toy-clip`", 1)[1].split("\n\n", 2)[1].splitlines()
    assert len(table) == 4 and all(line.startswith("|") and line.endswith("|") for line in table), table
    assert "| co op " in md


# ---------------------------------------------------------------- mean per-class accuracy and the lines


def test_mean_per_class_and_the_lines_without_learning_everywhere(tmp_path):
    # 50% of the test set in one class: answering it everywhere scores 50% top-1 and 33.33% per class
    counts = {"nominal": 50, "hole": 30, "stain": 20}
    add_run(tmp_path, "zeroshot", "textile", 0, 1, 50.0, per_class={"nominal": 100.0, "hole": 0.0, "stain": 0.0},
            n_test_per_class=counts)
    for seed, pc in ((1, {"nominal": 60.0, "hole": 70.0, "stain": 80.0}), (2, {"nominal": 40.0, "hole": 50.0,
                                                                             "stain": 60.0})):
        add_run(tmp_path, "coop", "textile", 4, seed, 65.0, per_class=pc, n_test_per_class=counts)
    add_run(tmp_path, "old", "textile", 4, 1, 10.0, per_class={"nominal": 30.0, "hole": 0.0, "stain": None},
            mean_per_class=15.0)  # recorded mean wins over the per-class dict
    report = write_report(tmp_path, tmp_path / "out", options=None)
    zs, coop = report.cell("toy-clip", "textile", "zeroshot", 0), report.cell("toy-clip", "textile", "coop", 4)
    assert zs.mean_per_class == pytest.approx(100 / 3) and zs.majority == pytest.approx(50.0)
    assert zs.chance == pytest.approx(100 / 3)
    assert coop.mean_per_class == pytest.approx(60.0) and coop.mean_per_class_n == 2
    assert report.cell("toy-clip", "textile", "old", 4).mean_per_class == 15.0

    md = (tmp_path / "out" / "report.md").read_text()
    assert "Mean per-class accuracy" in md and "| textile | majority class | 50.00 | 33.33 |" in re.sub(" +", " ", md)
    assert "uniform chance" in md
    rows = list(csv.DictReader((tmp_path / "out" / "report.csv").open()))
    assert tuple(CSV_COLUMNS[:len(OLD_CSV_COLUMNS)]) == OLD_CSV_COLUMNS  # old readers keep their columns
    row = next(r for r in rows if r["method"] == "coop" and r["dataset"] == "textile")
    assert float(row["mean_per_class"]) == 60.0 and float(row["majority"]) == 50.0
    js = json.loads((tmp_path / "out" / "report.json").read_text())
    entry = js["backbones"]["toy-clip"]["results"]["textile"]["coop"]["4"]
    assert entry["mean_per_class"] == 60.0 and entry["chance"] == pytest.approx(33.333333)
    from fewclip.report.latex import render_latex

    tex = render_latex(report.cells)
    assert "mean per-class accuracy" in tex and "Majority class" in tex and "50.0" in tex


def test_engine_records_mean_per_class_and_class_counts():
    import torch

    from fewclip.features.encode import accuracy

    labels = torch.tensor([0, 0, 0, 0, 1, 2])
    logits = torch.nn.functional.one_hot(torch.zeros(6, dtype=torch.long), 3).float()  # always class 0
    acc = accuracy(logits, labels, ["a", "b", "c"])
    assert acc["top1"] == pytest.approx(66.6667, abs=1e-3)
    assert acc["mean_per_class"] == pytest.approx(33.3333, abs=1e-3)
    assert acc["n_test_per_class"] == {"a": 4, "b": 1, "c": 1}


# ---------------------------------------------------------------- figures


def _line_colours(monkeypatch, tmp_path, options=None):
    """method -> the colour its line was drawn with, over every figure of a report."""
    from matplotlib.colors import to_hex

    from fewclip.report import plots

    drawn = {}
    real = plots._draw

    def spy(ax, here, methods, key, ci_key, handles, names=None):
        before = set(handles)
        real(ax, here, methods, key, ci_key, handles, names)
        for label in set(handles) - before:
            h = handles[label]
            line = h.lines[0] if hasattr(h, "lines") else h
            drawn[label] = to_hex(line.get_color())
        drawn.setdefault("_figures", set()).add(id(ax.figure))
        drawn.setdefault("_backbones", set()).update(c.backbone for c in here)

    monkeypatch.setattr(plots, "_draw", spy)
    write_report(tmp_path, tmp_path / "out", options=options)
    return drawn


def test_a_methods_colour_is_decided_by_its_name_not_its_order_nor_a_rename(tmp_path, monkeypatch):
    from fewclip.config.report import ReportOptions

    add_run(tmp_path, "coop", "d", 1, 1, 40.0)
    add_run(tmp_path, "lora", "d", 1, 1, 35.0)
    alone = _line_colours(monkeypatch, tmp_path)
    add_run(tmp_path, "aaa", "d", 1, 1, 30.0)  # sorts first: before, every other method's colour moved
    beside = _line_colours(monkeypatch, tmp_path)
    assert (alone["coop"], alone["lora"]) == (beside["coop"], beside["lora"]) == (method_colour("coop"),
                                                                                  method_colour("lora"))
    renamed = _line_colours(monkeypatch, tmp_path, ReportOptions(rename={"coop": "CoOp", "lora": "A-LoRA"}))
    assert (renamed["CoOp"], renamed["A-LoRA"]) == (alone["coop"], alone["lora"])


def test_several_backbones_each_in_the_main_figure(tmp_path, monkeypatch):
    add_run(tmp_path, "coop", "d", 1, 1, 40.0, backbone="a")
    add_run(tmp_path, "coop", "d", 1, 1, 30.0, backbone="b")
    drawn = _line_colours(monkeypatch, tmp_path)
    # the overview (both backbones) and one figure per backbone; before: accuracy_vs_shots.png was a's alone
    assert len(drawn["_figures"]) == 3 and drawn["_backbones"] == {"a", "b"}
    names = sorted(p.name for p in (tmp_path / "out").glob("accuracy_vs_shots*.png"))
    assert names == ["accuracy_vs_shots.png", "accuracy_vs_shots_a.png", "accuracy_vs_shots_b.png"]
    assert "![accuracy vs. shots, every backbone](accuracy_vs_shots.png)" in (tmp_path / "out" / "report.md").read_text()


# ---------------------------------------------------------------- a sweep's plan


SWEEP = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-shapes]
  methods: [zeroshot, coop, bad]
  shots: [1]
  seeds: [1, 2]
  args: [train.epochs=2, data.max_test=16, backbone.device=cpu]
  variants:
    coop: [adapter=coop, adapter.n_ctx=2]
    bad: [adapter=coop, adapter.n_ctx=2, train.lr=1e30, train.epochs=4, train.augment_views=2]
"""


@pytest.mark.slow
def test_a_sweep_report_names_every_run_that_did_not_finish_and_marks_mixed_configs(tmp_path, capsys):
    spec = tmp_path / "sweep.yaml"
    spec.write_text(SWEEP)
    out = tmp_path / "out"
    assert main(["sweep", str(spec), f"out={out}"]) == 1  # the two "bad" runs diverge
    md = (out / "report.md").read_text()
    # before: "3 runs" and no word of `bad`
    assert "The sweep planned 5 runs: 3 finished, 2 failed, 0 missing." in md
    assert "`bad` 2 of 2 failed" in md
    assert "- `bad` on toy-shapes at 1 shots: 2 of 2 planned runs did not finish: 2 failed (seeds 1, 2: " in md
    assert "training loss became" in md.split("- `bad` on toy-shapes", 1)[1].splitlines()[0]
    assert "– (0/2, 2 failed)" in md  # the cell is in the table, empty, not silently dropped
    plan = json.loads((out / "sweep_plan.json").read_text())
    assert sorted(plan["failed"]) == ["toy-clip/toy-shapes/bad/1shot/seed1", "toy-clip/toy-shapes/bad/1shot/seed2"]

    # a run's folder removed: missing, and its cell shows 1 of 2
    shutil.rmtree(out / "toy-clip/toy-shapes/coop/1shot/seed2")
    md = write_report(out).markdown
    assert "1 missing (seed 2)" in md and "(1/2)" in md

    # another config on the same folder: a run finished by the first sweep lands in the second one's table
    # (as when both run at once): marked, never mixed silently
    assert main(["sweep", str(spec), f"out={out}", "sweep.methods=[zeroshot,coop]"]) == 0
    keep = tmp_path / "keep"
    shutil.copytree(out / "toy-clip/toy-shapes/coop/1shot/seed1", keep)
    assert main(["sweep", str(spec), f"out={out}", "sweep.methods=[zeroshot,coop]", "sweep.args=[train.epochs=3,"
                 "data.max_test=16,backbone.device=cpu]"]) == 0
    shutil.rmtree(out / "toy-clip/toy-shapes/coop/1shot/seed1")
    shutil.copytree(keep, out / "toy-clip/toy-shapes/coop/1shot/seed1")
    report = write_report(out)
    cell = report.cell("toy-clip", "toy-shapes", "coop", 1)
    assert cell.other_config == 1
    assert "§" in report.markdown and "another config than this folder's sweep plan" in report.markdown
    assert "1 finished with another config" in report.markdown
    # the bad runs' folders are not in this plan: their runs are not listed as failed any more
    assert "`bad`" not in report.markdown.split("## Backbone", 1)[0]
    capsys.readouterr()
    os.environ.pop("FEWCLIP_DEBUG", None)


def test_a_sweep_whose_every_run_failed_still_gets_a_report_naming_them(tmp_path):
    from fewclip.runs.plan import new_plan, write_plan

    runs = [{"protocol": "fewshot", "backbone": "toy-clip", "dataset": "d", "method": "coop", "shots": 4, "seed": s,
             "dir": f"toy-clip/d/coop/4shot/seed{s}"} for s in (1, 2, 3)]
    plan = new_plan(runs, ["x", "y", "z"])
    plan["failed"] = {"toy-clip/d/coop/4shot/seed1": "CUDA out of memory\nTraceback ...",
                      "toy-clip/d/coop/4shot/seed2": "CUDA out of memory"}
    write_plan(tmp_path, plan)
    report = write_report(tmp_path)  # before: "no runs found"
    md = report.markdown
    assert "The sweep planned 3 runs: 0 finished, 2 failed, 1 missing." in md
    assert "– (0/3, 2 failed)" in md
    assert "2 failed (seeds 1, 2: CUDA out of memory), 1 missing (seed 3)" in md and "Traceback" not in md
    assert [p["status"] for p in json.loads((tmp_path / "report.json").read_text())["planned_runs"]] == [
        "failed", "failed", "missing"]
    assert (tmp_path / "report.html").is_file()


def test_a_damaged_plan_is_ignored_with_a_warning(tmp_path, caplog):
    add_run(tmp_path, "coop", "d", 4, 1, 60.0)
    (tmp_path / "sweep_plan.json").write_text('{"format": "fewclip.sweep_plan", "version": 1, "runs": [{"dir": 3}]}')
    with caplog.at_level(logging.WARNING, logger="fewclip.report"):
        report = build_report(tmp_path)
    assert "sweep_plan.json" in caplog.text and report.cell("toy-clip", "d", "coop", 4).planned is None


def test_a_cell_holding_a_run_the_plan_did_not_make_is_marked(tmp_path):
    """Fast twin of the sweep test above: runs whose identity is not the plan's (here: no record at all), or in
    folders the plan does not name, are marked in the table and counted apart."""
    from fewclip.runs.plan import new_plan, write_plan

    planned = [{"protocol": "fewshot", "backbone": "toy-clip", "dataset": "d", "method": "coop", "shots": 4,
                "seed": s, "dir": f"toy-clip/d/coop/4shot/seed{s}"} for s in (1, 2)]
    write_plan(tmp_path, new_plan(planned, ["x1", "x2"]))
    add_run(tmp_path, "coop", "d", 4, 1, 60.0)
    add_run(tmp_path, "tip", "d", 4, 1, 55.0)  # no plan names it
    report = build_report(tmp_path)
    assert report.cell("toy-clip", "d", "coop", 4).other_config == 1
    assert report.cell("toy-clip", "d", "tip", 4).other_config == 1
    md = report.markdown
    assert "**60.00** (1/2)§◊" in md and "55.00 (1)§◊" in md
    assert "The sweep planned 2 runs: 0 finished, 0 failed, 1 missing, 1 finished with another config (§)." in md


def test_a_run_records_mean_per_class_and_prints_it_beside_top1(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FEWCLIP_CACHE", str(tmp_path / "store"))
    out = tmp_path / "zs"
    assert main(["zeroshot", "data=toy-shapes", "data.max_test=16", "backbone.device=cpu", f"out={out}"]) == 0
    m = json.loads((out / "metrics.json").read_text())
    rates = [v for v in m["per_class"].values() if v is not None]
    assert m["mean_per_class"] == pytest.approx(sum(rates) / len(rates), abs=1e-3)
    assert sum(m["n_test_per_class"].values()) == m["n_test"] == 16
    assert f"(mean per-class {m['mean_per_class']:.2f}%)" in capsys.readouterr().out


def test_sweeps_of_several_protocols_in_one_folder_keep_their_own_plans(tmp_path):
    """sweep/base2new.yaml, cross-dataset.yaml and domain-shift.yaml all write to runs/protocols: each plan sits
    with its protocol's runs (OUT/<protocol>/), so none hides another's failures."""
    from fewclip.runs.plan import PLAN_FILE, new_plan, plan_folder, record_failures, write_plan

    def runs(protocol, method):
        base = "" if protocol == "fewshot" else f"{protocol}/"
        return [{"protocol": protocol, "backbone": "toy-clip", "dataset": "d", "method": method, "shots": 4,
                 "seed": 1, "dir": f"{base}toy-clip/d/{method}/4shot/seed1"}]

    few = new_plan(runs("fewshot", "coop"), ["f"])
    b2n = new_plan(runs("base2new", "cocoop"), ["b"], "base2new")
    write_plan(plan_folder(tmp_path, "fewshot"), few)
    write_plan(plan_folder(tmp_path, "base2new"), b2n)
    record_failures(plan_folder(tmp_path, "base2new"), b2n, [("base2new/toy-clip/d/cocoop/4shot/seed1", "boom")])
    assert (tmp_path / "base2new" / PLAN_FILE).is_file()
    add_run(tmp_path, "zeroshot", "d", 0, 1, 40.0)
    md = build_report(tmp_path).markdown
    assert "The sweep planned 2 runs: 0 finished, 1 failed, 1 missing." in md
    assert "### Planned runs that did not finish, `toy-clip` (Base-to-novel generalisation)" in md
    assert "- `cocoop` on d at 4 shots: 1 of 1 planned runs did not finish: 1 failed (seed 1: boom)" in md
    assert "- `coop` on d at 4 shots: 1 of 1 planned runs did not finish: 1 missing (seed 1)" in md

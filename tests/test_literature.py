"""The literature check's statistics (issue 31): Spearman's rho, the reproduction rule, the aggregation of sweep
runs, and the findings computed on the published table itself."""
import math
from pathlib import Path

import pytest

from fewclip.cli.main import main as cli_main
from fewclip.report.literature import (
    correlations,
    findings,
    harmonic,
    mean_over_backbones,
    measured_side,
    per_backbone_side,
    published_side,
    ranks,
    render,
    reproduced,
    spearman,
)
from fewclip.report.runs import RunResult
from helpers.scripts import load_script


def test_ranks_average_ties():
    assert ranks([10, 20, 20, 5]) == [2.0, 3.5, 3.5, 1.0]


def test_spearman_on_known_inputs():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # scipy.stats.spearmanr([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]).statistic
    assert spearman([1, 2, 3, 4, 5], [5, 6, 7, 8, 7]) == pytest.approx(0.8207826816681233, abs=1e-12)
    # without ties: 1 - 6 sum d^2 / (n (n^2 - 1)); d = (0, 2, -1, -1) -> 1 - 36 / 60
    assert spearman([1, 2, 3, 4], [1, 4, 2, 3]) == pytest.approx(1 - 6 * 6 / 60)
    assert math.isnan(spearman([1, 2], [2, 1])) and math.isnan(spearman([1, 2, 3], [5, 5, 5]))
    with pytest.raises(ValueError):
        spearman([1, 2, 3], [1, 2])


def test_reproduction_rule_needs_the_sign_and_a_factor_of_two():
    assert reproduced(-11.0, -6.0) and reproduced(-11.0, -21.9)
    assert not reproduced(-11.0, -5.0) and not reproduced(-11.0, -23.0) and not reproduced(-11.0, 6.0)
    assert reproduced(2.5, None) is None


def test_the_published_side_reproduces_every_finding_it_has_against_itself():
    pub = published_side()
    assert pub.values[("fewshot", 1)]["zeroshot"] == pub.values[("fewshot", 16)]["zeroshot"]
    assert pub.values[("base2new", "new")]["coop"] == pytest.approx(63.22)  # CoCoOp's Table 1, the first source
    assert "CLIP-SVD" in pub.sources[("fewshot", 1)]["coop"]
    f = {x.number: x for x in findings(pub.values, pub.values)}
    assert f[1].published[0] == pytest.approx(63.22 - 74.22)
    assert f[5].published == pytest.approx([70.62 - 68.09, 73.08 - 70.13, 75.75 - 73.59])
    assert f[7].published == [4.0]
    assert f[9].published == pytest.approx([63.33 - 58.16, (23.06 + 55.4 + 56.6 + 34.67 - 21.83 - 51.41 - 56.15
                                                            - 33.37) / 4])
    for n in range(1, 10):
        assert f[n].verdict is True, n
    assert f[8].published[0] == pytest.approx(70.3 - 65.36)  # StatA's TransCLIP row, the first zero-shot row
    rho = {c.setting: c for c in correlations(pub.values, pub.values)}
    assert rho["few-shot, 1 shot"].rho == pytest.approx(1.0)
    assert "zeroshot+transclip" in pub.values[("fewshot", 1)]  # transductive: finding 8 only, not ranked
    assert "zeroshot+transclip" not in rho["few-shot, 1 shot"].methods and "zeroshot" in rho["few-shot, 1 shot"].methods


def _run(method, dataset, backbone, shots, seed, top1, protocol="fewshot", evals=None):
    return RunResult(method=method, dataset=dataset, backbone=backbone, shots=shots, seed=seed, top1=top1,
                     path=Path("x"), protocol=protocol, evals=evals or {})


def test_measured_side_averages_seeds_then_tasks_then_backbones():
    runs = [_run("coop", "a", "b1", 1, 1, 60), _run("coop", "a", "b1", 1, 2, 70),  # task a: 65
            _run("coop", "b", "b1", 1, 1, 45),  # task b: 45 -> b1: 55
            _run("coop", "a", "b2", 1, 1, 75),  # b2: (75 + 55) / 2 = 65 -> coop 60
            _run("zeroshot", "a", "b1", 0, 1, 50), _run("zeroshot", "a", "b2", 0, 1, 40),
            _run("lpp", "a", "b1", 1, 1, 99),  # only on b1: left out of the average over backbones
            _run("zeroshot", "b", "b1", 0, 1, 40), _run("zeroshot", "b", "b2", 0, 1, 40),
            _run("coop", "b", "b2", 1, 1, 55),  # b2: 65
            _run("gda", "a", "b1", 1, 1, 90), _run("gda", "a", "b2", 1, 1, 90)]  # not on task b: left out
    got, notes = measured_side(runs)
    assert notes["backbones"] == ["b1", "b2"]
    assert got[("fewshot", 1)] == {"coop": pytest.approx(60.0), "zeroshot": pytest.approx(42.5)}
    assert got[("fewshot", 16)] == {"zeroshot": pytest.approx(42.5)}
    assert any("gda" in line and "1 of 2 tasks" in line for line in notes["incomplete"])
    b2n = [_run("coop", "a", "b1", 16, 1, 0, "base2new", {"base": 80.0, "new": 60.0}),
           _run("coop", "b", "b1", 16, 1, 0, "base2new", {"base": 90.0, "new": 70.0})]
    got, _ = measured_side(b2n)
    assert got[("base2new", "base")]["coop"] == pytest.approx(85.0)
    assert got[("base2new", "hm")]["coop"] == pytest.approx(harmonic(85.0, 65.0))
    ds = [_run("coop", "net", "b1", 16, 1, 0, "domain_shift", {"source": 70.0, "t1": 50.0, "t2": 40.0})]
    got, _ = measured_side(ds)
    assert got[("domain_shift", "targets")]["coop"] == pytest.approx(45.0)


def test_a_method_run_with_its_protocol_preset_is_compared_as_the_method():
    # the base-to-novel sweep runs GDA on its authors' base-to-new settings (gda[base2new]): compared as gda;
    # where the plain method ran too (b2), the plain run is the one compared and the preset's is named as left out
    runs = [_run("zeroshot", "a", "b1", 0, 1, 0, "base2new", {"base": 60.0, "new": 70.0}),
            _run("gda[base2new]", "a", "b1", 16, 1, 0, "base2new", {"base": 80.0, "new": 66.0}),
            _run("zeroshot", "a", "b2", 0, 1, 0, "base2new", {"base": 60.0, "new": 70.0}),
            _run("gda", "a", "b2", 16, 1, 0, "base2new", {"base": 76.0, "new": 62.0}),
            _run("gda[base2new]", "a", "b2", 16, 1, 0, "base2new", {"base": 99.0, "new": 99.0})]
    got, notes = measured_side(runs)
    assert got[("base2new", "base")]["gda"] == pytest.approx(78.0) and "gda[base2new]" not in got[("base2new", "base")]
    assert got[("base2new", "new")]["gda"] == pytest.approx(64.0)
    assert notes["presets"] == ["gda[base2new] (base2new)"]
    assert len(notes["presets_left_out"]) == 1 and "b2" in notes["presets_left_out"][0]


def test_each_finding_is_judged_on_each_backbone_too():
    # finding 1 (CoOp new - zero-shot new, published -11.0): b1 -10 (reproduced), b2 +2 (not); their mean -4 (not)
    def b2n(method, bb, new):
        return _run(method, "a", bb, 16 if method != "zeroshot" else 0, 1, 0, "base2new", {"base": 80.0, "new": new})

    runs = [b2n("zeroshot", "b1", 70.0), b2n("coop", "b1", 60.0), b2n("zeroshot", "b2", 60.0), b2n("coop", "b2", 62.0)]
    per_bb, notes = per_backbone_side(runs)
    assert sorted(per_bb) == ["b1", "b2"] and per_bb["b2"][("base2new", "new")]["coop"] == pytest.approx(62.0)
    assert mean_over_backbones(per_bb) == measured_side(runs)[0]
    pub = published_side()
    f1 = {b: findings(pub.values, t)[0] for b, t in per_bb.items()}
    assert f1["b1"].verdict is True and f1["b2"].verdict is False
    text = render(pub, mean_over_backbones(per_bb), notes, ["x"], per_bb)
    block = text[text.index("  1. "):text.index("  2. ")]
    assert "measured -4.00: not reproduced" in block and "reproduced on 1 of 2 backbones" in block
    assert "b1  -10.00: yes" in block and "b2  +2.00: no" in block
    assert "reproduced on" not in render(pub, mean_over_backbones(per_bb), notes, ["x"])  # the mean only


def test_cross_dataset_is_compared_on_imagenet_and_the_ten_other_datasets_mean():
    from fewclip.published import ELEVEN, PublishedRow

    def row(method, ds, value, source="paper A"):
        return PublishedRow(method, "ViT-B-16/openai", ds, "cross_dataset", 16, "top1", value, source,
                            train_dataset="imagenet")

    others = [d for d in ELEVEN if d != "imagenet"]
    rows = [row("coop", "imagenet", 71.0)] + [row("coop", d, 60.0 + i) for i, d in enumerate(others)]
    rows += [row("cocoop", "imagenet", 70.0)] + [row("cocoop", d, 66.0) for d in others]
    rows += [row("coop", d, 10.0, "a later paper's re-run") for d in others]  # not mixed into the first source's
    rows += [row("maple", "imagenet", 70.7)] + [row("maple", d, 66.0) for d in others[:-1]]  # one target missing
    rows += [row("promptsrc", "average", 65.81, "a README with the mean only")]
    pub = published_side(rows)
    assert pub.values[("cross_dataset", "targets")] == {"coop": pytest.approx(64.5), "cocoop": pytest.approx(66.0),
                                                        "promptsrc": pytest.approx(65.81)}
    assert pub.values[("cross_dataset", "source")]["maple"] == pytest.approx(70.7)
    assert pub.sources[("cross_dataset", "targets")]["coop"] == "paper A"
    runs = [_run(m, "w2-net", "b1", 16, 1, 0, "cross_dataset", {"source": src, "t1": t, "t2": t + 2})
            for m, src, t in (("zeroshot", 50.0, 40.0), ("coop", 60.0, 38.0), ("cocoop", 58.0, 41.0))]
    got, _ = measured_side(runs)
    assert got[("cross_dataset", "targets")] == {"zeroshot": pytest.approx(41.0), "coop": pytest.approx(39.0),
                                                 "cocoop": pytest.approx(42.0)}
    rho = {c.setting: c for c in correlations(pub.values, got)}
    assert rho["cross-dataset, targets"].methods == ["cocoop", "coop"]  # zero-shot has no published row here
    shipped = published_side().values[("cross_dataset", "targets")]  # ProText's README: the targets' means
    assert shipped == {"coop": 63.88, "cocoop": 65.74, "maple": 66.3, "promptsrc": 65.81, "zeroshot": 65.15}
    assert rho["cross-dataset, source"].methods == ["cocoop", "coop"]


def test_the_linear_probe_crossing_needs_four_shots_measured():
    pub = published_side().values
    only_one = {("fewshot", 1): {"zeroshot": 60.0, "linear_probe": 40.0}}
    f7 = {f.number: f for f in findings(pub, only_one)}[7]
    assert f7.measured == [None] and f7.verdict is None
    late = {("fewshot", k): {"zeroshot": 60.0, "linear_probe": 40.0 + 2 * k} for k in (1, 2, 4, 8, 16)}
    f7 = {f.number: f for f in findings(pub, late)}[7]
    assert f7.measured == [16.0] and f7.verdict is False  # 40 + 2 * 16 >= 60 first at 16 shots
    early = {("fewshot", k): {"zeroshot": 60.0, "linear_probe": 50.0 + 3 * k} for k in (1, 2, 4)}
    f7 = {f.number: f for f in findings(pub, early)}[7]
    assert f7.measured == [4.0] and f7.verdict is True


def test_the_check_reads_several_finished_grids_together_and_only_read_only(tmp_path, capsys):
    for bb in ("toy-clip", "toy-euclip"):
        out = tmp_path / bb / "fewshot" / "zs"
        assert cli_main(["train", "adapter=zeroshot", "shots=0", "data=toy-shapes", f"backbone={bb}", f"out={out}"]) == 0
    check = load_script("literature_check.py")
    capsys.readouterr()
    args = ["--read-only", "--protocols", "fewshot", "--out", str(tmp_path / "toy-clip"), "--out",
            str(tmp_path / "toy-euclip")]
    assert check.main(args) == 0
    assert "measured on toy-clip, toy-euclip" in capsys.readouterr().out
    assert check.main(["--out", "a", "--out", "b"]) == 2
    err = capsys.readouterr().err
    assert "needs --read-only" in err and len(err.strip().splitlines()) == 1

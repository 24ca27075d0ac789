"""The literature check (issue 31): run the sweeps a reference world needs, then print beside the published values
(fewclip/published/results.csv, with their sources) the Spearman rank correlation per setting and each of issue
31's findings 1-9 reproduced or not.

    OMP_NUM_THREADS=1 python scripts/literature_check.py                   # the full grid (resumable), then the check
    python scripts/literature_check.py --read-only                         # only read what has finished
    python scripts/literature_check.py --read-only --out runs/a --out runs/b  # two grids, each value their mean
    python scripts/literature_check.py 'sweep.backbones=[w2-clip]' 'sweep.seeds=[1]' \\
        --fewshot 'sweep.shots=[1,2,4]' --protocols fewshot,domain_shift   # a reduced grid

The sweeps are configs/sweep/literature-w2{,-base2new,-cross-dataset,-domain-shift}.yaml, run with fewclip's
sweep machinery (``fewclip.runs.sweep.run_sweep``: a finished run is not run again, so an interrupted check
resumes) into ``<out>/fewshot``, ``<out>/base2new``, ``<out>/cross-dataset`` and ``<out>/domain-shift``.
Positional arguments override every sweep; ``--fewshot``/``--base2new``/``--cross-dataset``/``--domain-shift`` ARG
override one. Exit 0 when the check printed, 1 when a sweep
run failed (the next call runs it again), 2 for bad arguments.
"""
import argparse
import logging
import sys
from pathlib import Path

SWEEPS = {"fewshot": ("sweep/literature-w2.yaml", "fewshot"),
          "base2new": ("sweep/literature-w2-base2new.yaml", "base2new"),
          "cross_dataset": ("sweep/literature-w2-cross-dataset.yaml", "cross-dataset"),
          "domain_shift": ("sweep/literature-w2-domain-shift.yaml", "domain-shift")}


def main(argv) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="sweep overrides for every protocol ('sweep.seeds=[1]')")
    ap.add_argument("--out", action="append", default=[],
                    help="the sweeps' parent folder (default runs/literature-w2); with --read-only it may be given\n"
                         "more than once: each method's value is then the mean over the folders (e.g. one per\n"
                         "backbone, as the issue's 4-backbone means)")
    ap.add_argument("--protocols", default="fewshot,base2new,cross_dataset,domain_shift",
                    help="which sweeps to run and read (default %(default)s)")
    ap.add_argument("--read-only", action="store_true", help="run nothing; read the finished runs")
    for p in SWEEPS:
        ap.add_argument(f"--{p.replace('_', '-')}", action="append", default=[], metavar="ARG",
                        help=f"an override for the {p} sweep only")
    args = ap.parse_args(argv)
    outs = args.out or ["runs/literature-w2"]
    if len(outs) > 1 and not args.read_only:
        print("literature_check: --out is given more than once; that reads several finished grids together and "
              "needs --read-only (run each grid with one --out first)", file=sys.stderr)
        return 2
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    bad = [p for p in protocols if p not in SWEEPS]
    if bad:
        print(f"literature_check: unknown protocol(s) {bad}; pick from {', '.join(SWEEPS)}", file=sys.stderr)
        return 2
    from fewclip.report.literature import load_sweep_runs, mean_over_backbones, per_backbone_side, published_side, render
    from fewclip.runs.sweep import load_sweep_config, run_sweep
    from fewclip.utils.errors import FewclipError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    folders, failed = [], 0
    if args.read_only:
        folders = [str(Path(out) / SWEEPS[p][1]) for out in outs for p in protocols]
        protocols = []  # nothing to run
    for p in protocols:
        config, sub = SWEEPS[p]
        folder = Path(outs[0]) / sub
        folders.append(str(folder))
        try:
            cfg = load_sweep_config([config, *args.overrides, *getattr(args, p)])
            counts = run_sweep(cfg, folder)
        except FewclipError as e:
            print(f"literature_check: the {p} sweep: {e}", file=sys.stderr)
            return 2
        failed += counts.get("failed", 0)
        print(f"{p}: {counts['planned']} runs, {counts['done_before']} done before, {counts.get('ran', 0)} ran, "
              f"{counts.get('failed', 0)} failed -> {folder}", flush=True)
    runs = load_sweep_runs(folders)
    if not runs:
        print(f"literature_check: no finished runs under {', '.join(folders)}; run without --read-only first",
              file=sys.stderr)
        return 1
    per_bb, notes = per_backbone_side(runs)
    print(render(published_side(), mean_over_backbones(per_bb), notes, folders, per_bb))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

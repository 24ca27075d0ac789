"""Benchmark a sweep on several workers, and a second sweep over stored features, in one run.

    python scripts/bench_sweep.py                        # the grid below, on this machine's CPU
    python scripts/bench_sweep.py seeds=1,2 shots=1,4    # a smaller grid
    python scripts/bench_sweep.py launchers=local1,local2 out=bench.json

The same CPU grid (toy-clip on toy-patterns and toy-colours; CoOp, zs_probe and the linear probe at
``shots=`` shots x ``seeds=`` seeds, plus zero-shot) runs as ``fewclip sweep`` in a fresh process per
launcher (``launchers=``, a comma list):

* ``local1``: one after another in the launching process (``launcher.workers=1``);
* ``local2``: two worker processes, one CPU thread each (``launcher.workers=2``);
* ``ray2``: Ray tasks on a local Ray cluster of 2 CPUs (``launcher=ray launcher.cpus=2``; needs
  ``fewclip[ray]``).

Each gets an empty feature store (``FEWCLIP_CACHE``) and out directory of its own, so each encodes its
images; the time is the whole command, process start, planning and report included, as a person waits for
it. Then the ``local1`` sweep runs again into a new out directory with the store it filled: every run runs
again (a new out directory), and its images come from the store. Printed: wall time per launcher and its
speed-up over ``local1``; images encoded (summed over the runs: what each run encoded itself, not what
it read from memory or the store) and time of the first and the second sweep; whether every run's
accuracy agreed with ``local1``'s. The first line names the machine. Timings on a shared machine move
with its load: the script says the load average before and after.
"""
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GRID = """\
sweep:
  backbones: [toy-clip]
  datasets: [toy-patterns, toy-colours]
  methods: [zeroshot, coop, zs_probe, linear_probe]
  shots: [{shots}]
  seeds: [{seeds}]
  args: [data.templates=single, backbone.device=cpu]
"""
LAUNCHERS = {
    "local1": ["launcher.workers=1"],
    "local2": ["launcher.workers=2"],
    "ray2": ["launcher=ray", "launcher.cpus=2"],
}


def parse(argv):
    opts = {"launchers": "local1,local2,ray2", "shots": "1,4,16", "seeds": "1,2,3", "out": None, "keep": None}
    for a in argv:
        key, _, value = a.partition("=")
        if key not in opts or not value:
            sys.exit(f"usage: python scripts/bench_sweep.py [{' '.join(k + '=...' for k in opts)}]; got {a!r}")
        opts[key] = value
    return opts


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{n} CPU core(s), {cpu}; Python {platform.python_version()}"


def sweep(spec: Path, out: Path, store: Path, args) -> float:
    env = {**os.environ, "FEWCLIP_CACHE": str(store), "FEWCLIP_DEBUG": "0"}
    cmd = [sys.executable, "-m", "fewclip.cli.main", "sweep", str(spec), f"out={out}", "log_level=warning", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return took


def runs(out: Path):
    found = {}
    for m in out.rglob("metrics.json"):
        d = json.loads(m.read_text())
        found[m.parent.relative_to(out).as_posix()] = d
    return found


def encoded_here(rs) -> int:
    """Images the runs encoded themselves (not read from a cache or the store)."""
    return sum(r["images_encoded"] - r["images_encoded_shared"] for r in rs.values())


def main(argv):
    opts = parse(argv)
    names = [n for n in opts["launchers"].split(",") if n]
    bad = [n for n in names if n not in LAUNCHERS]
    if bad or "local1" not in names:
        sys.exit(f"launchers= takes a comma list of {', '.join(LAUNCHERS)} and must include local1; got {bad or names}")
    root = Path(opts["keep"] or tempfile.mkdtemp(prefix="fewclip-bench-sweep-"))
    spec = root / "grid.yaml"
    spec.write_text(GRID.format(shots=opts["shots"], seeds=opts["seeds"]))
    print(f"machine: {machine()}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    results = {}
    for name in names:
        out, store = root / name / "out", root / name / "store"
        took = sweep(spec, out, store, LAUNCHERS[name])
        rs = runs(out)
        results[name] = {"seconds": took, "runs": len(rs), "encoded": encoded_here(rs),
                         "top1": {k: v["top1"] for k, v in rs.items()}}
        print(f"  {name}: {len(rs)} runs in {took:.1f} s", flush=True)
    again_out = root / "local1-again" / "out"
    took = sweep(spec, again_out, root / "local1" / "store", LAUNCHERS["local1"])
    rs = runs(again_out)
    again = {"seconds": took, "runs": len(rs), "encoded": encoded_here(rs),
             "from_store": sum(r["images_from_store"] for r in rs.values()),
             "top1": {k: v["top1"] for k, v in rs.items()}}
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")

    base = results["local1"]
    print(f"\nsweep of {base['runs']} runs (toy-clip; toy-patterns, toy-colours; zeroshot, coop, zs_probe, "
          f"linear_probe; shots {opts['shots']}; seeds {opts['seeds']}), CPU:\n")
    print("| launcher | wall time (s) | speed-up vs 1 worker | images encoded | same top-1 as local1 |")
    print("|---|---:|---:|---:|---|")
    for name, r in results.items():
        same = "yes" if r["top1"] == base["top1"] else "NO"
        print(f"| {name} | {r['seconds']:.1f} | {base['seconds'] / r['seconds']:.2f}x | {r['encoded']} | {same} |")
    same = "yes" if again["top1"] == base["top1"] else "NO"
    print("\nsecond sweep over the stored features (local1, new out directory, the store of the first):\n")
    print("| sweep | wall time (s) | images encoded | read from the store | same top-1 |")
    print("|---|---:|---:|---:|---|")
    print(f"| first | {base['seconds']:.1f} | {base['encoded']} | 0 | - |")
    print(f"| second | {again['seconds']:.1f} | {again['encoded']} | {again['from_store']} | {same} |")
    print(f"\nsecond / first wall time: {again['seconds'] / base['seconds']:.2f}")
    if opts["out"]:
        Path(opts["out"]).write_text(json.dumps({"machine": machine(), "launchers": results, "again": again},
                                                indent=2))
    if not opts["keep"]:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])

"""How long `fewclip --help` and each `fewclip COMMAND --help` take to start: CPU seconds (user + system of the
process and its children), the median of ``repeat=`` runs, beside a bare ``python -c pass`` measured in the same
run (the ratio is what holds on a busy machine).

    python scripts/bench_start.py [repeat=5]

Target (issue 21): `fewclip --help` and every `fewclip COMMAND --help` in at most 0.5 s of CPU. The help of
train, zeroshot, sweep and features prints their config, composed from torch-free dataclasses and, for a built-in
method, the adapter index (fewclip.cli.quickhelp); a plugin's method still imports the registry. The last line,
`fewclip datasets`, is a whole command that loads no model (fewclip.cli.light, as `fewclip report`).
"""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

COMMANDS = [["--help"], ["backbones", "--help"], ["datasets", "--help"], ["adapters", "--help"],
            ["cache", "--help"], ["report", "--help"], ["export", "--help"], ["predict", "--help"],
            ["import", "--help"], ["zeroshot", "--help"], ["train", "--help"], ["train", "adapter=lora", "--help"],
            ["sweep", "--help"], ["sweep", "launcher=slurm", "--help"], ["features", "--help"],
            ["published", "--help"], ["split", "--help"], ["datasets"]]


def cpu_seconds(argv) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(args) -> None:
    opts = dict(a.split("=", 1) for a in args)
    repeat = int(opts.get("repeat", 5))
    fewclip = str(Path(sys.executable).parent / "fewclip")
    base = statistics.median(cpu_seconds([sys.executable, "-c", "pass"]) for _ in range(repeat))
    print(f"load average {os.getloadavg()[0]:.1f}; CPU seconds, median of {repeat}; python -c pass: {base:.3f} s\n")
    print(f"{'command':<40} {'CPU s':>7} {'x python':>9}")
    for cmd in COMMANDS:
        t = statistics.median(cpu_seconds([fewclip, *cmd]) for _ in range(repeat))
        print(f"{'fewclip ' + ' '.join(cmd):<40} {t:7.3f} {t / base:9.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])

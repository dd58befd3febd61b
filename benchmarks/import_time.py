"""What `import autotune` costs beside torch's own import, measured side by side in fresh processes.

Each figure is the smallest of ``--runs`` fresh interpreters, alternating, by ``python -X importtime``'s
cumulative microseconds for the top-level module:

- ``import torch``: torch alone;
- ``import autotune``: autotune alone (its public names load on first use, so this loads no torch);
- ``import torch, autotune``: both, as a training script imports them; the ratio to torch alone is
  the figure the design holds to (at most 1.05);
- ``autotune.plan`` after torch: the first use of the planning machinery (the estimator, fake tensors).

    python benchmarks/import_time.py --runs 7
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys


def importtime(code: str, module: str) -> float:
    """Seconds ``module``'s import took inside a fresh interpreter running ``code``."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True).stderr
    found = [int(m.group(1)) for m in re.finditer(r"import time:\s+\d+ \|\s+(\d+) \| " + re.escape(module) + r"$", err, re.M)]
    return found[-1] / 1e6 if found else 0.0


def wall(code: str) -> float:
    out = subprocess.run([sys.executable, "-c", f"import time; t = time.perf_counter(); {code}; print(time.perf_counter() - t)"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    rows: dict[str, list[float]] = {"import torch": [], "import autotune": [], "import torch, autotune": [], "autotune.plan after torch": []}
    for _ in range(args.runs):
        rows["import torch"].append(importtime("import torch", "torch"))
        rows["import autotune"].append(importtime("import autotune", "autotune"))
        rows["import torch, autotune"].append(wall("import torch, autotune"))
        rows["autotune.plan after torch"].append(wall("import torch, autotune; t = time.perf_counter(); autotune.plan"))
    torch_alone = min(rows["import torch"])
    both = min(rows["import torch, autotune"])
    torch_wall = min(wall("import torch") for _ in range(args.runs))
    print(f"| measure | seconds (best of {args.runs}) | x torch |")
    print("|---|---|---|")
    print(f"| import torch | {torch_alone:.3f} | 1.00 |")
    print(f"| import autotune | {min(rows['import autotune']):.4f} | {min(rows['import autotune']) / torch_alone:.3f} |")
    print(f"| import torch, autotune (wall) | {both:.3f} | {both / torch_wall:.3f} (vs import torch, wall: {torch_wall:.3f} s) |")
    print(f"| first use of autotune.plan after torch (wall) | {min(rows['autotune.plan after torch']):.3f} | - |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The plot of ``time_to_step.py``'s results (docs/images/time_to_step.png): left, each
case's time to its first step as stacked phases (jaxckpt, jaxckpt with ``prefetch``,
orbax); right, the manager's start (with ``latest_step()`` and the restore of it)
against the number of steps retained. Reads the tables the benchmark prints.

    python benchmarks/plot_time_to_step.py PHASES.txt STEPS.txt [BEFORE_STEPS.txt] OUT.png
"""

from __future__ import annotations

import sys

PHASES = ("import", "manager start", "restore", "placement", "first step")


def rows(path: str) -> list[list[str]]:
    with open(path) as f:
        return [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in f
                if ln.startswith("|") and not ln.startswith("|---") and not ln.startswith("| state")
                and not ln.startswith("| steps")]


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases_txt, steps_txt, *before, out = sys.argv[1:]
    phases: dict[tuple[str, str], dict[str, list[float]]] = {}
    for state, cache, phase, a, b, c, _ in rows(phases_txt):
        if phase in PHASES:
            case = phases.setdefault((state, cache), {})
            for lib, v in zip(("jaxckpt", "jaxckpt + prefetch", "orbax"), (a, b, c)):
                case.setdefault(lib, []).append(float(v))
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.2), gridspec_kw={"width_ratios": [1.5, 1]})
    labels, y = [], 0.0
    colors = plt.get_cmap("tab10").colors
    for (state, cache), libs in phases.items():
        for lib, values in libs.items():
            start = 0.0
            for k, v in enumerate(values):
                left.barh(y, v, left=start, color=colors[k], label=PHASES[k] if y == 0 else None)
                start += v
            left.text(start + 0.03, y, f"{start:.2f} s", va="center", fontsize=8)
            labels.append(f"{state}, {cache}: {lib}")
            y += 1
        y += 0.6
    ticks = [i + 0.6 * (i // 3) for i in range(len(labels))]
    left.set_yticks(ticks, labels, fontsize=8)
    left.invert_yaxis()
    left.set_xlabel("seconds from the process's spawn to its first step")
    left.legend(fontsize=8, loc="lower right")
    left.set_title("Time to the first step, phase by phase (one process, local disk)", fontsize=10)
    for path, style in [(steps_txt, "-")] + [(p, ":") for p in before]:
        series: dict[str, list[tuple[int, float]]] = {}
        for n, store, manager, _, _, restored, _ in rows(path):
            series.setdefault(f"{manager}, {store}", []).append((int(n.replace(",", "")), float(restored)))
        for name, points in series.items():
            if style == ":" and "orbax" in name:
                continue
            right.plot(*zip(*points), style, marker="o", label=name + (" (before)" if style == ":" else ""))
    right.set_xscale("log")
    right.set_yscale("log")
    right.set_xlabel("steps retained in the directory")
    right.set_ylabel("start + latest_step() + restore [s]")
    right.set_title("The manager's start against the steps retained", fontsize=10)
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main()

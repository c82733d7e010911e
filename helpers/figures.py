"""The course's figures, drawn by code. ``python -m helpers.figures`` (``make images``) rebuilds every file in images/.

Notebooks call the same functions, so a figure in images/ and the one a notebook shows come from one source.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

from .bench import Result, load_results, select

IMAGES_DIR = Path(__file__).resolve().parent.parent / "images"
STYLE = {  # impl -> (label, colour, marker)
    "copy": ("copy (the limit)", "black", ""),
    "naive": ("eager PyTorch, one op per line", "tab:red", "v"),
    "torch": ("torch.softmax", "tab:blue", "s"),
    "row": ("Triton, one row per program", "tab:green", "o"),
    "online": ("Triton, looped online", "tab:purple", "D"),
    "looped": ("Triton, looped", "tab:purple", "D"),
}


def plot_bandwidth(ax, results: list[Result], impls: list[str], title: str) -> None:
    """GB/s against N (log scale) for each implementation, with the copy ceiling dashed."""
    ceiling = {r.N: r.copy_gbps for r in results}
    ns = sorted(ceiling)
    ax.plot(ns, [ceiling[n] for n in ns], "--", color="black", label=STYLE["copy"][0])
    for impl in impls:
        rows = sorted(select(results, impl=impl), key=lambda r: r.N)
        label, colour, marker = STYLE[impl]
        ax.plot([r.N for r in rows], [r.gbps for r in rows], marker=marker, color=colour, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("N (row length)")
    ax.set_ylabel("GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def recorded_label(results: list[Result]) -> str:
    first = results[0]
    return f"recorded on {first.gpu}, {first.date}, M*N = {first.M * first.N:,} elements"


def bandwidth_figure(results: list[Result], phase: str, impls: list[str], dtypes=("float32", "bfloat16")):
    """One panel per dtype: the plots of notebooks 01, 04 and 05."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        plot_bandwidth(ax, select(results, phase=phase, dtype=dtype), impls, f"softmax {phase}, {dtype}")
    fig.suptitle(recorded_label(results), fontsize=9)
    fig.tight_layout()
    return fig


FIGURES = {  # file name in images/ -> (phase, impls)
    "01_naive_vs_fused.png": ("forward", ["naive", "torch", "row"]),
}


def main() -> None:
    matplotlib.use("Agg")
    results = load_results()
    IMAGES_DIR.mkdir(exist_ok=True)
    for name, (phase, impls) in FIGURES.items():
        bandwidth_figure(results, phase, impls).savefig(IMAGES_DIR / name, dpi=110)
        print(f"wrote images/{name}")


if __name__ == "__main__":
    main()

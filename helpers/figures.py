"""The course's figures, drawn by code. ``python -m helpers.figures`` (``make images``) rebuilds every file in images/.

Notebooks call the same functions, so a figure in images/ and the one a notebook shows come from one source.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

from . import bench
from .bench import RESULTS_DIR, Result, load_results, load_tuning, select

IMAGES_DIR = Path(__file__).resolve().parent.parent / "images"
# the H100 tuning run of the row lengths where shapes were close: 32768 (tile or split) and 50257 (aligned or not)
ALIGNMENT_TUNING = RESULTS_DIR / "nvidia-h100-80gb-hbm3-tuning-32768-50257.csv"
STYLE = {  # impl -> (label, colour, marker)
    "copy": ("copy (the limit)", "black", ""),
    "naive": ("eager PyTorch, one op per line", "tab:red", "v"),
    "torch": ("torch.softmax", "tab:blue", "s"),
    "row": ("Triton, one row per program", "tab:green", "o"),
    "online": ("Triton, looped online", "tab:purple", "D"),
    "looped": ("Triton, looped", "tab:purple", "D"),
    "graph": ("Triton, graph walk (notebook 03)", "tab:orange", "^"),
    "helpers": ("this course (helpers.softmax)", "tab:green", "o"),
    "compile": ("torch.compile", "tab:cyan", "P"),
    "liger": ("Liger-Kernel", "tab:brown", "X"),
    "quack": ("QuACK (CuTe DSL)", "tab:pink", "*"),
    "launch": ("this course: its launch alone", "tab:olive", ""),
    "empty_like": ("an output's allocation alone", "tab:gray", ""),
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


def recorded_label(results: list[Result], impls) -> str:
    """The suptitle of a figure of ``impls``' results: where and when they were recorded (a date range where the
    lines come from runs of different days), and the elements a call moved."""
    plotted = [r for r in results if r.impl in impls]
    first, dates = plotted[0], sorted({r.date for r in plotted})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return f"recorded on {first.gpu}, {when}, M*N = {first.M * first.N:,} elements"


def bandwidth_figure(results: list[Result], phase: str, impls: list[str], dtypes=("float32", "bfloat16")):
    """One panel per dtype: the plots of notebooks 01, 04 and 05."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes, strict=True):
        plot_bandwidth(ax, select(results, phase=phase, dtype=dtype), impls, f"softmax {phase}, {dtype}")
    fig.suptitle(recorded_label(results, impls), fontsize=9)
    fig.tight_layout()
    return fig


# The forward graph of notebook 03: node -> (position, label); edges carry the local derivative d(head)/d(tail).
GRAPH_NODES = {
    "x": ((0.0, 0.0), "$x$"),
    "m": ((1.6, 1.2), "$m = \\max(x)$"),
    "z": ((3.2, 0.0), "$z = x - m$"),
    "e": ((5.4, 0.0), "$e = \\exp(z)$"),
    "d": ((7.0, 1.2), "$d = \\sum e$"),
    "r": ((8.8, 1.2), "$r = 1 / d$"),
    "y": ((10.6, 0.0), "$y = e \\cdot r$"),
}
GRAPH_EDGES = [  # (tail, head, local derivative)
    ("x", "m", "1 at the argmax"),
    ("x", "z", "1"),
    ("m", "z", "$-1$"),
    ("z", "e", "$e$"),
    ("e", "d", "1"),
    ("d", "r", "$-1/d^2$"),
    ("e", "y", "$r$"),
    ("r", "y", "$e$"),
]


def forward_graph_figure():
    """Softmax's forward pass as a computational graph, each edge labelled with its local derivative."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 3))
    for tail, head, derivative in GRAPH_EDGES:
        (x0, y0), (x1, y1) = GRAPH_NODES[tail][0], GRAPH_NODES[head][0]
        # arrows stop short of the boxes: 0.75 of a unit along the edge at either end
        length = ((x1 - x0) ** 2 + (y1 - y0) ** 2) ** 0.5
        ux, uy = (x1 - x0) / length * 0.75, (y1 - y0) / length * 0.75
        ax.annotate("", xy=(x1 - ux, y1 - uy), xytext=(x0 + ux, y0 + uy),
                    arrowprops=dict(arrowstyle="-|>", color="grey", shrinkA=0, shrinkB=0, lw=1.5))
        # labels beside the arrow: left of a rising edge, right of a falling one, above a flat one
        side = "right" if y1 > y0 else "left" if y1 < y0 else "center"
        shift = {"right": -0.15, "left": 0.15, "center": 0.0}[side]
        ax.text((x0 + x1) / 2 + shift, (y0 + y1) / 2 + 0.1, derivative, color="tab:red", ha=side, fontsize=10)
    for (x, y), label in GRAPH_NODES.values():
        ax.text(x, y, label, ha="center", va="center", fontsize=12,
                bbox=dict(boxstyle="round,pad=0.4", facecolor="white", edgecolor="tab:blue"))
    ax.set_xlim(-0.8, 11.4)
    ax.set_ylim(-0.6, 1.8)
    ax.axis("off")
    ax.set_title("softmax forward graph; red: local derivative of each edge (backward multiplies by it)", fontsize=10)
    fig.tight_layout()
    return fig


PEERS = ("helpers", "torch", "compile", "liger", "quack")  # notebook 06's figure: the course's op and its peers


def peer_results(results: list[Result]) -> list[Result]:
    """The rows of notebook 06's figure: PEERS at the row lengths the course's op was timed at (the teaching kernels'
    sweep times torch at more lengths, in another run)."""
    lengths = {r.N for r in results if r.impl == "helpers"}
    return [r for r in results if r.impl in PEERS and r.N in lengths]


def peers_figure(results: list[Result], dtypes=("float32", "bfloat16", "float16")):
    """Notebook 06: fraction of copy bandwidth against N, the course's op against its peers, forward and backward."""
    import matplotlib.pyplot as plt

    results = peer_results(results)
    fig, axes = plt.subplots(2, len(dtypes), figsize=(5.5 * len(dtypes), 7), squeeze=False, sharey=True)
    for row, phase in enumerate(("forward", "backward")):
        for ax, dtype in zip(axes[row], dtypes, strict=True):
            for impl in PEERS:  # QuACK where it is installed
                points = sorted(select(results, phase=phase, dtype=dtype, impl=impl), key=lambda r: r.N)
                if points:
                    label, colour, marker = STYLE[impl]
                    ax.plot([r.N for r in points], [r.gbps / r.copy_gbps for r in points], marker=marker,
                            color=colour, label=label)
            ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
            ax.axhline(0.9, color="grey", linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_ylim(0, 1.15)
            ax.set_title(f"{phase}, {dtype}")
            ax.grid(alpha=0.3)
            ax.set_xlabel("N (row length)")
        axes[row][0].set_ylabel("fraction of copy bandwidth")
    axes[0][0].legend(fontsize=8, loc="lower left")
    fig.suptitle(recorded_label(results, PEERS) + "  (dashed: the copy limit, dotted: 0.9 of it)", fontsize=9)
    fig.tight_layout()
    return fig


def tuning_figure(rows: list[dict], dtype: str = "float32"):
    """Notebook 06: what the tuning sweep saw. Left: one program per tile against a persistent grid (best of each,
    per N). Middle: rows per program at N = 256. Right: split piece size for long rows."""
    import matplotlib.pyplot as plt

    def best(filter_fn, key):
        out = {}
        for r in rows:
            if r["dtype"] == dtype and r["phase"] == "forward" and filter_fn(r):
                k = key(r)
                out[k] = max(out.get(k, 0.0), float(r["fraction"]))
        return dict(sorted(out.items()))

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    for persistent, label in (("0", "one program per tile"), ("1", "persistent grid")):
        curve = best(lambda r, p=persistent: r["segments"] == "1" and r["persistent"] == p, lambda r: int(r["N"]))
        axes[0].plot(list(curve), list(curve.values()), marker="o", label=label)
    axes[0].set_xscale("log", base=2)
    axes[0].set_title(f"tile kernels, forward {dtype}: grid")
    curve = best(lambda r: r["segments"] == "1" and r["N"] == "256", lambda r: int(r["rows"]))
    axes[1].plot(list(curve), list(curve.values()), marker="o", color="tab:green")
    axes[1].set_xscale("log", base=2)
    axes[1].set_title(f"N = 256, forward {dtype}: rows per program")
    axes[1].set_xlabel("rows per program")
    for n in sorted({int(r["N"]) for r in rows if r["segments"] != "1" and int(r["N"]) >= 50000}):
        curve = best(lambda r, n=n: r["segments"] != "1" and int(r["N"]) == n, lambda r: int(r["block_n"]))
        axes[2].plot(list(curve), list(curve.values()), marker="o", label=f"N = {n}")
    axes[2].set_xscale("log", base=2)
    axes[2].set_title(f"split rows, forward {dtype}: elements per program")
    axes[2].set_xlabel("elements per program (BLOCK_N)")
    for ax in axes:
        ax.set_ylim(0, 1.1)
        ax.grid(alpha=0.3)
        ax.set_ylabel("fraction of copy bandwidth")
    axes[0].set_xlabel("N (row length)")
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=8)
    fig.tight_layout()
    return fig


def best_by_alignment(rows: list[dict], n: int = 50257) -> dict[tuple[str, str], dict[bool, float]]:
    """From a tuning sweep: the best fraction of copy at row length ``n`` with pieces aligned to 16 bytes and without,
    per (phase, dtype)."""
    best: dict[tuple[str, str], dict[bool, float]] = {}
    for r in rows:
        if int(r["N"]) == n and r["segments"] != "1":
            by_alignment = best.setdefault((r["phase"], r["dtype"]), {})
            aligned = r.get("align", "1") != "1"
            by_alignment[aligned] = max(by_alignment.get(aligned, 0.0), float(r["fraction"]))
    return best


def alignment_figure(rows: list[dict], n: int = 50257):
    """Notebook 06: split kernels on rows of an odd length, pieces on 16-byte boundaries or not (best shape of each)."""
    import matplotlib.pyplot as plt

    best = best_by_alignment(rows, n)
    cases = sorted(best)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for offset, aligned, label in ((-0.2, False, "one-element loads"), (0.2, True, "aligned pieces, 16-byte loads")):
        ax.bar([i + offset for i in range(len(cases))], [best[c].get(aligned, 0.0) for c in cases], width=0.4,
               label=label)
    ax.set_xticks(range(len(cases)), [f"{phase}\n{dtype}" for phase, dtype in cases])
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title(f"split kernels, N = {n}: best shape of each kind ({rows[0]['gpu']})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


BANDWIDTH_FIGURES = {  # file name in images/ -> (phase, impls)
    "01_naive_vs_fused.png": ("forward", ["naive", "torch", "row"]),
    "04_backward.png": ("backward", ["torch", "row", "graph"]),
    "05_long_rows.png": ("forward", ["torch", "row", "online"]),
}


def main() -> None:
    matplotlib.use("Agg")
    IMAGES_DIR.mkdir(exist_ok=True)
    figures = {"03_forward_graph.png": forward_graph_figure()}
    results = load_results(bench.own_recorded(bench.results_path))  # this GPU's sweep after `make bench`
    for name, (phase, impls) in BANDWIDTH_FIGURES.items():
        figures[name] = bandwidth_figure(results, phase, impls)
    figures["06_against_peers.png"] = peers_figure(results)
    figures["06_tuning.png"] = tuning_figure(load_tuning(bench.own_recorded(bench.tuning_path, bench.TUNED_GPU)))
    figures["06_alignment.png"] = alignment_figure(load_tuning(ALIGNMENT_TUNING))
    from . import bench_attention, figures_calls

    figures.update(figures_calls.images())
    figures["10_attention.png"] = bench_attention.attention_figure(
        bench_attention.load_attention(bench.own_recorded(bench_attention.attention_path)))
    for name, fig in figures.items():
        fig.savefig(IMAGES_DIR / name, dpi=110)
        print(f"wrote images/{name}")


if __name__ == "__main__":
    main()

"""Notebook 07's figures, drawn by code from ``bench_calls``' recorded files: few rows over a vocabulary (latency and
the host's time per call) and softmax over other dims. ``python -m helpers.figures`` draws them with the rest.
"""

from __future__ import annotations

import matplotlib
import matplotlib.ticker

from . import bench_calls, everyday
from .bench import own_recorded, select
from .bench_calls import DECODE_M, HOST_SHAPES, DimResult, Latency
from .everyday import EverydayResult
from .figures import STYLE
from .plans import TILES_PER_SM


def latency_figure(rows: list[Latency], dtype: str = "bfloat16"):
    """Notebook 07: microseconds per call on the decode grid (few rows over a vocabulary), one panel per phase and row
    count, each implementation eager, the course's calls replayed from a CUDA graph (dashed), and one torch kernel
    copying the same bytes (dotted: ``bench_calls.copy_reference``)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(DECODE_M), figsize=(4.5 * len(DECODE_M), 7), squeeze=False, sharey=True)
    for row, phase in enumerate(("forward", "backward")):
        for ax, m in zip(axes[row], DECODE_M, strict=True):
            for impl, measure in [(impl, "eager") for impl in ("helpers", "torch", "compile", "liger", "quack")] + [
                    ("helpers", "graph")]:
                points = sorted(select(rows, phase=phase, dtype=dtype, M=m, impl=impl, measure=measure),
                                key=lambda r: r.N)
                if points:
                    label, colour, marker = STYLE[impl]
                    ax.plot([r.N for r in points], [r.us for r in points], marker=marker, color=colour,
                            linestyle="--" if measure == "graph" else "-",
                            label=label + (", CUDA graph" if measure == "graph" else ""))
            copies = sorted(select(rows, phase=phase, dtype=dtype, M=m, impl="copy", measure="eager"),
                            key=lambda r: r.N)
            if copies:
                ax.plot([r.N for r in copies], [r.us for r in copies], ":", color=STYLE["copy"][1],
                        label="torch, one kernel copying the same bytes")
            ax.set_xscale("log", base=2)
            ax.set_title(f"{phase}, {m} x N, {dtype}")
            ax.grid(alpha=0.3)
            ax.set_xlabel("N (vocabulary)")
        axes[row][0].set_ylabel("us per call (log scale)")
    # a log scale: 6 against 7 us stays visible beside torch.compile's 50-300 us
    axes[0][0].set_yscale("log")
    axes[0][0].yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    axes[0][0].set_yticks([5, 10, 20, 50, 100, 200])
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"recorded on {rows[0].gpu}, {rows[0].date}: eager is the GPU's time per call (do_bench)", fontsize=9)
    fig.tight_layout()
    return fig


def host_figure(rows: list[Latency]):
    """Notebook 07: the CPU's time to issue one call of a tiny tensor, per implementation, and the course's call in
    parts (its launch alone, its output's allocation)."""
    import matplotlib.pyplot as plt

    host = select(rows, measure="host")
    cases = [(phase, dtype, shape) for phase in ("forward", "backward") for dtype in sorted({r.dtype for r in host})
             for shape in HOST_SHAPES]
    impls = [impl for impl in ("helpers", "torch", "quack", "launch", "empty_like") if select(host, impl=impl)]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(impls)
    for i, impl in enumerate(impls):
        label, colour, _ = STYLE[impl]
        us = [next((r.us for r in select(host, impl=impl, phase=phase, dtype=dtype, M=shape[0], N=shape[1])), 0.0)
              for phase, dtype, shape in cases]
        ax.bar([c + i * width for c in range(len(cases))], us, width, color=colour, label=label)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(cases))],
                  [f"{phase}\n{dtype}\n{m} x {n}" for phase, dtype, (m, n) in cases], fontsize=8)
    ax.set_ylabel("us of CPU per call")
    ax.set_title(f"host time to issue one call, GPU kept busy; recorded on {host[0].gpu}, {host[0].date}", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    return fig


def other_dims_figure(rows: list[DimResult]):
    """Notebook 07: softmax over a dim that is not the last, fraction of copy bandwidth, forward and backward."""
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r.shape, r.dim, r.dtype) for r in rows))
    impls = [impl for impl in ("torch", "compile", "helpers") if any(r.impl == impl for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
    height = 0.8 / len(impls)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for k, impl in enumerate(impls):
            fractions = [next(r.gbps / r.copy_gbps for r in rows if (r.shape, r.dim, r.dtype) == case
                              and r.phase == phase and r.impl == impl) for case in cases]
            label, colour, _ = STYLE[impl]
            ax.barh([i + (k - (len(impls) - 1) / 2) * height for i in range(len(cases))], fractions, height,
                    color=colour, label=label)
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlim(0, 1.1)
        ax.set_xlabel("fraction of copy bandwidth")
        ax.set_title(phase)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(cases)), [f"dim {dim} of {shape}\n{dtype}" for shape, dim, dtype in cases])
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=len(impls))
    fig.suptitle(f"recorded on {rows[0].gpu}, {rows[0].date}  (dashed: the copy limit)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def speedups(rows: list[EverydayResult], phase: str) -> dict[str, float]:
    """Each everyday case's GPU time under torch over the course's, in ``phase``: above 1, the course is faster."""
    us = {(r.case, r.impl): r.gpu_us for r in rows if r.phase == phase}
    return {case: us[case, "torch"] / us[case, "helpers"] for case, impl in us if impl == "helpers"}


def everyday_figure(rows: list[EverydayResult]):
    """Notebook 07: every everyday case, torch's GPU time over the course's (log scale), forward and backward."""
    import matplotlib.pyplot as plt

    labels = {r.case: f"{r.case} ({r.shape}, dim {r.dim}, {r.dtype})" for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.3 * len(labels) + 1.2), sharey=True)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        ratio = speedups(rows, phase)
        colours = [STYLE["helpers"][1] if ratio[case] >= 1 else STYLE["torch"][1] for case in labels]
        ax.barh(range(len(labels)), [ratio[case] for case in labels], color=colours)
        ax.axvline(1.0, color="black", linewidth=1)
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}x"))
        ax.set_xlabel("torch's GPU time / the course's")
        ax.set_title(phase)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(labels)), list(labels.values()), fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"everyday calls (right of the line: the course is faster), recorded on {rows[0].gpu}, {rows[0].date}",
                 fontsize=9)
    fig.tight_layout()
    return fig


def load_turned() -> list[dict]:
    """The recorded probe of turned tiles (results/README.md, "Turned tiles"): each call before, after, and torch."""
    import csv

    from .bench import RESULTS_DIR

    with (RESULTS_DIR / "nvidia-h100-80gb-hbm3-turned-tiles.csv").open() as f:
        return list(csv.DictReader(f))


def turned_figure(rows: list[dict]):
    """Notebook 07: turned tiles against the path before them (rows, and the copies around them) and torch, fraction
    of copy bandwidth, forward and backward."""
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["case"], r["dtype"]) for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.42 * len(cases) + 1.4), sharey=True)
    bars = (("torch", STYLE["torch"][0], STYLE["torch"][1]), ("before", "the rows path before them", "tab:gray"),
            ("turned", "turned tiles", STYLE["helpers"][1]))
    height = 0.8 / len(bars)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for k, (variant, label, colour) in enumerate(bars):
            fractions = []
            for case in cases:
                found = {r["variant"]: r for r in rows if (r["case"], r["dtype"]) == case and r["phase"] == phase}
                turned = found["turned"]
                fractions.append(float(turned["fraction_of_copy"]) * float(turned["us"]) / float(turned["torch_us"])
                                 if variant == "torch" else float(found[variant]["fraction_of_copy"]))
            ax.barh([i + (k - 1) * height for i in range(len(cases))], fractions, height, color=colour, label=label)
        ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
        ax.set_xlabel("fraction of copy bandwidth")
        ax.set_title(phase)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(cases)), [f"{case} ({dtype})" for case, dtype in cases], fontsize=8)
    axes[0].invert_yaxis()
    fig.legend(*axes[0].get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=len(bars))
    fig.suptitle(f"recorded on {rows[0]['gpu']}, {rows[0]['date']}  (dashed: torch copying the same bytes, "
                 "below the GPU's peak on small tensors)", fontsize=9)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


def load_small_calls() -> list[dict]:
    """The recorded probe of small calls (results/README.md, "Small calls"): each call's tile as planned before
    ``plans.spread_tiles``, spread to 2, 4 or 8 tiles an SM, and torch."""
    import csv

    from .bench import RESULTS_DIR

    with (RESULTS_DIR / "nvidia-h100-80gb-hbm3-small-calls.csv").open() as f:
        return list(csv.DictReader(f))


def small_calls_figure(rows: list[dict], kept: str):
    """Notebook 07: each small call's GPU time over torch's, with the plan's tile and with the ``kept`` spread, against
    the call's elements, forward and backward."""
    import matplotlib.pyplot as plt

    us = {(r["dtype"], int(r["n_rows"]), int(r["n_cols"]), r["phase"], r["impl"]): float(r["us"]) for r in rows}
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, phase in zip(axes, ("forward", "backward"), strict=True):
        for impl, label, colour in (("plan before", "the plan's tile", "tab:gray"),
                                    (kept, f"spread tiles ({kept})", STYLE["helpers"][1])):
            for dtype, marker in (("float32", "o"), ("bfloat16", "s")):
                calls = [key for key in us if key[3:] == (phase, impl) and key[0] == dtype]
                ax.scatter([n_rows * n_cols for _, n_rows, n_cols, *_ in calls],
                           [us[key] / us[(*key[:4], "torch")] for key in calls], marker=marker, color=colour,
                           alpha=0.7, s=22, label=f"{label}, {dtype}")
        ax.axhline(1.0, color=STYLE["torch"][1], linewidth=1, label=STYLE["torch"][0])
        ax.set_xscale("log")
        ax.set_xlabel("elements in the call")
        ax.set_title(phase)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("GPU time / torch's (below 1: faster)")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"short rows, few tiles: recorded on {rows[0]['gpu']}, {rows[0]['date']}", fontsize=9)
    fig.tight_layout()
    return fig


def images() -> dict:
    """Notebook 07's files in images/ and their figures, from this GPU's records where ``make bench`` wrote them."""
    latency = bench_calls.load_latency(own_recorded(bench_calls.latency_path))
    other_dims = bench_calls.load_other_dims(own_recorded(bench_calls.other_dims_path))
    calls = everyday.load_everyday(own_recorded(everyday.everyday_path))
    return {"07_latency.png": latency_figure(latency), "07_host.png": host_figure(latency),
            "07_other_dims.png": other_dims_figure(other_dims), "07_everyday.png": everyday_figure(calls),
            "07_turned.png": turned_figure(load_turned()),
            "07_small_calls.png": small_calls_figure(load_small_calls(), f"{TILES_PER_SM} tiles an SM")}

"""Memory over simulated time for the orders compared (needs the optional ``plot`` extra).

One panel per graph, one line per order (all tensors solid, gathered
parameters dashed), x in milliseconds, y in GiB. matplotlib is imported only
here and only when a plot is asked for; without it :func:`require_matplotlib`
raises a one-line :class:`DcschedError` with the install command.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Mapping, Sequence

from dcsched.outputs import write_atomic
from dcsched.errors import DcschedError
from dcsched.sim.simulate import SimResult

INSTALL_HINT = "pip install 'dcsched[plot]'"


def require_matplotlib():
    """``matplotlib.pyplot`` on the non-interactive Agg backend, or a clear error."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DcschedError(f"a plot needs matplotlib, which is not installed (install it with: {INSTALL_HINT})") \
            from None
    return plt


def plot_format(path: str | os.PathLike) -> str:
    """The image format ``path``'s suffix names (png without one)."""
    return Path(path).suffix.lstrip(".").lower() or "png"


def check_plot_format(path: str | os.PathLike) -> None:
    """Refuse, before any work, a plot without matplotlib or in a format matplotlib cannot write."""
    plt = require_matplotlib()
    supported = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    fmt = plot_format(path)
    if fmt not in supported:
        raise DcschedError(f"{path}: cannot draw format '{fmt}' (choose one of: {', '.join(sorted(supported))})")


def _save(fig, plt, path: Path) -> Path:
    """Render ``fig`` in the format ``path``'s suffix names and write it atomically."""
    fmt = plot_format(path)
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=fmt, dpi=110)
    except ValueError as exc:
        raise DcschedError(f"{path}: cannot write a plot in format '{fmt}' ({exc})") from None
    finally:
        plt.close(fig)
    data = buffer.getvalue()
    write_atomic(path, lambda handle: handle.write(data))
    return path


def plot_sweep(path: str | os.PathLike, curves: Mapping[str, Sequence], title: str | None = None) -> Path:
    """Step time against memory budget, one panel per graph, from :func:`dcsched.report.sweep.sweep` rows.

    Unlimited memory is drawn as a dotted line at its step time.
    """
    plt = require_matplotlib()
    graphs = list(curves)
    fig, axes = plt.subplots(len(graphs), 1, figsize=(9, 3.2 * max(1, len(graphs))), squeeze=False)
    for ax, graph in zip(axes[:, 0], graphs):
        rows = curves[graph]
        finite = [r for r in rows if r.budget_bytes != float("inf")]
        ax.plot([r.budget_bytes / 2**30 for r in finite], [r.step_ms for r in finite], marker="o",
                label="overlap step time")
        for r in rows:
            if r.budget_bytes == float("inf"):
                ax.axhline(r.step_ms, linestyle=":", color="C1", label=f"unlimited ({r.step_ms:.3f} ms)")
        ax.axhline(rows[0].tight_lower_bound_ms, linestyle="--", color="C2",
                   label=f"lower bound ({rows[0].tight_lower_bound_ms:.3f} ms)")
        ax.set_title(f"{graph}: step time against memory budget ({rows[0].scope} scope)", fontsize=9)
        ax.set_xlabel("memory budget (GiB)")
        ax.set_ylabel("step time (ms)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _save(fig, plt, Path(path))


def plot_memory(path: str | os.PathLike, runs: Mapping[str, Sequence[tuple[str, SimResult]]],
                title: str | None = None) -> Path:
    """Draw memory over time, ``runs`` = {graph name: [(order label, result), ...]}; write ``path`` atomically.

    The file format follows the suffix (png, svg, pdf).
    """
    plt = require_matplotlib()
    graphs = list(runs)
    fig, axes = plt.subplots(len(graphs), 1, figsize=(13, 3.4 * max(1, len(graphs))), squeeze=False)
    try:
        for ax, graph in zip(axes[:, 0], graphs):
            for n, (label, result) in enumerate(runs[graph]):
                times, all_bytes, gathered = result.memory_timeline()
                color = f"C{n % 10}"
                ax.step(times, [b / 2**30 for b in all_bytes], where="post", color=color,
                        label=f"{label} (peak {result.peak_bytes / 2**30:.2f} GiB, step {result.step_ms:.2f} ms)")
                ax.step(times, [b / 2**30 for b in gathered], where="post", color=color, linestyle="--",
                        linewidth=0.8)
            ax.set_title(f"{graph}: memory over simulated time (solid: all tensors, dashed: gathered parameters)",
                         fontsize=9)
            ax.set_xlabel("time (ms)")
            ax.set_ylabel("memory (GiB)")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
            ax.grid(alpha=0.3)
        if title:
            fig.suptitle(title, fontsize=10)
        fig.tight_layout()
    except BaseException:
        plt.close(fig)
        raise
    return _save(fig, plt, Path(path))

"""The pure half of ``benchmarks/train_peers.py``: the rounds' order, the rows from the ranks' figures, the
ratios between rows and the table.

A rank's result for a configuration (``train_peers.worker``) holds, per round, each timed step's wall and CPU
milliseconds (``step_ms``, ``cpu_ms``: lists of lists), every loss it trained, and the profiled step's figures.
Every timed step starts from a barrier, so step k of a round took, for the job, the longest any rank took:
the row's step time is the median over the rounds of each round's median of those maxima.
"""

from __future__ import annotations

import random
import statistics

#: The peers that shard parameters, gradients and optimizer state (what dcsched does): a dcsched row's
#: ``vs best zero3`` is against the fastest of them of its own kind (eager or compiled).
ZERO3_PEERS = ("fsdp2", "fsdp2-prefetch", "fsdp2-compile", "fsdp2-compile-block", "simplefsdp", "deepspeed-zero3")
#: The peers whose compute Inductor compiles: the like of ``dcsched-*-inductor``; the others are eager.
COMPILED_PEERS = ("fsdp2-compile", "fsdp2-compile-block", "simplefsdp")


def round_order(names: list[str], round_: int, seed: int = 0) -> list[str]:
    """The order the configurations train in round ``round_``: ``names`` shuffled by a generator seeded with
    ``seed`` and the round alone, so every rank (and every rerun) takes the same order, and no configuration
    always follows the same one.

    >>> round_order(["a", "b", "c"], 0) == round_order(["a", "b", "c"], 0)
    True
    >>> sorted(round_order(["a", "b", "c"], 3))
    ['a', 'b', 'c']
    """
    order = list(names)
    random.Random(f"{seed}/{round_}").shuffle(order)
    return order


def compiled(name: str) -> bool:
    """Whether configuration ``name`` runs Inductor-compiled compute (``dcsched-*-inductor``, the compiled
    peers) rather than eager ops.

    >>> compiled("dcsched-overlap-plan-inductor"), compiled("dcsched-fsdp"), compiled("simplefsdp")
    (True, False, True)
    """
    return name.endswith("-inductor") or name in COMPILED_PEERS


def step_over_ranks(rounds_per_rank: list[list[list[float]]]) -> tuple[float, list[float]]:
    """``(step ms, each round's)`` from each rank's per-round step times: step k of a round takes the maximum
    over the ranks, a round its median step, the row the median round.

    >>> step_over_ranks([[[10.0, 12.0, 11.0], [9.0, 9.0, 9.0]], [[11.0, 10.0, 10.0], [8.0, 9.5, 30.0]]])
    (10.25, [11.0, 9.5])
    """
    rounds = []
    for steps in zip(*rounds_per_rank):  # one round, every rank's steps
        rounds.append(statistics.median(max(times) for times in zip(*steps)))
    return statistics.median(rounds), rounds


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def ranks_of(per_rank: list[dict], key: str, scale: float = 1.0, digits: int = 1) -> list:
    return [None if r.get(key) is None else round(r[key] * scale, digits) for r in per_rank]


def row_figures(per_rank: list[dict], ddp_losses: list[list[float]]) -> dict:
    """One configuration's figures from its ranks' results (see the module's docstring)."""
    step, rounds = step_over_ranks([r["step_ms"] for r in per_rank])
    diffs = [abs(a - b) for own, theirs in zip((r["losses"] for r in per_rank), ddp_losses)
             for a, b in zip(own, theirs)]
    first = [r.get("first_step_s") for r in per_rank]
    return {
        "step_ms": round(step, 1),
        "cpu_ms": [round(statistics.median(x for steps in r["cpu_ms"] for x in steps), 1) for r in per_rank],
        "peak_mib": ranks_of(per_rank, "peak_bytes", 2 ** -20),
        "collectives": per_rank[0]["collectives"],
        "asynchronous": per_rank[0]["asynchronous"],
        "first_step_s": None if None in first else round(max(first), 2),
        "loss_diff_vs_ddp": max(diffs) if diffs else None,
        "steps_compared": len(diffs),
        "round_step_ms": [round(x, 1) for x in rounds],
        "rank_step_ms": [round(statistics.median(x for steps in r["step_ms"] for x in steps), 1) for r in per_rank],
        "held_mib": ranks_of(per_rank, "held_bytes", 2 ** -20),
        "step_rise_mib": ranks_of(per_rank, "step_rise_bytes", 2 ** -20),
        "collectives_by_kind": per_rank[0]["collectives_by_kind"],
        "dcsched_collectives": per_rank[0]["dcsched_collectives"],
        "losses": [r["losses"] for r in per_rank],
    }


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's step against DDP's (``vs_ddp``) and, for dcsched's rows, against the fastest ZeRO-3 peer of its
    own kind, eager or compiled (``vs_best_zero3``, that peer in ``best_zero3``), among rows of the same model;
    rows without a step (errors) get none. Returns ``rows``, changed in place.

    >>> rows = add_ratios([{"config": "ddp", "model": "m", "step_ms": 100.0},
    ...                    {"config": "fsdp2", "model": "m", "step_ms": 150.0},
    ...                    {"config": "fsdp2-prefetch", "model": "m", "step_ms": 120.0},
    ...                    {"config": "simplefsdp", "model": "m", "step_ms": 110.0},
    ...                    {"config": "dcsched-fsdp", "model": "m", "step_ms": 132.0}])
    >>> rows[-1]["vs_ddp"], rows[-1]["vs_best_zero3"], rows[-1]["best_zero3"]
    (1.32, 1.1, 'fsdp2-prefetch')
    """
    timed = [row for row in rows if row.get("step_ms")]
    for row in timed:
        ddp = next((r for r in timed if r["config"] == "ddp" and r["model"] == row["model"]), None)
        row["vs_ddp"] = round(row["step_ms"] / ddp["step_ms"], 2) if ddp else None
        if not row["config"].startswith("dcsched-"):
            continue
        peers = [r for r in timed if r["config"] in ZERO3_PEERS and r["model"] == row["model"]
                 and compiled(r["config"]) == compiled(row["config"])]
        best = min(peers, key=lambda r: r["step_ms"], default=None)
        row["best_zero3"] = best["config"] if best else None
        row["vs_best_zero3"] = round(row["step_ms"] / best["step_ms"], 2) if best else None
    return rows


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, list):
        return "/".join(_cell(v) for v in value)
    if isinstance(value, float) and value < 1e-2:
        return f"{value:.1e}"
    return str(value)


COLUMNS = (("config", "config"), ("model", "model"), ("step_ms", "step ms"), ("vs_ddp", "vs ddp"),
           ("vs_best_zero3", "vs best zero3"), ("cpu_ms", "CPU ms/step (r0/r1)"), ("peak_mib", "peak MiB (r0/r1)"),
           ("collectives", "collectives/step"), ("asynchronous", "async"), ("first_step_s", "first step s"),
           ("loss_diff_vs_ddp", "max |loss-ddp|"))


def _cells(row: dict) -> list[str]:
    cells = [_cell(row.get(key)) for key, _ in COLUMNS]
    if row.get("vs_best_zero3") is not None:
        cells[4] = f"{row['vs_best_zero3']} ({row['best_zero3']})"
    return cells


def table(rows: list[dict]) -> str:
    """The rows as an aligned text table; a row with an ``error`` shows it after its name and model.

    >>> lines = table([{"config": "ddp", "model": "m", "step_ms": 9.5, "vs_ddp": 1.0},
    ...                {"config": "x", "model": "m", "error": "no"}]).splitlines()
    >>> lines[0].split("  ")[:4], lines[1].split(), lines[2].split()
    (['config', 'model', 'step ms', 'vs ddp'], ['ddp', 'm', '9.5', '1.0'], ['x', 'm', 'no'])
    """
    heads = [title for _, title in COLUMNS]
    cells = [_cells(row) for row in rows]
    widths = [max(len(h), *(len(c[i]) for c, row in zip(cells, rows) if "error" not in row or i < 2))
              for i, h in enumerate(heads)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(heads, widths)).rstrip()]
    for row, cell in zip(rows, cells):
        shown = cell[:2] + [row["error"]] if "error" in row else cell
        lines.append("  ".join(c.ljust(w) for c, w in zip(shown, widths)).rstrip())
    return "\n".join(lines)

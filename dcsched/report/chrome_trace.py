"""Chrome / Perfetto trace of simulated timelines (open in ui.perfetto.dev or chrome://tracing).

Each simulated order becomes one process: a ``compute`` track (thread 1)
with every node that takes time and every stall waiting for communication,
a ``communication`` track (thread 2) with the all-gathers and reduce-grads,
and a ``memory`` counter (all tensors and gathered parameters, bytes).
Timestamps are microseconds, as the trace format wants.

>>> import torch, torch.fx
>>> from dcsched.runtime import ops
>>> from dcsched.sim.simulate import simulate
>>> g = torch.fx.Graph()
>>> w = g.placeholder("w")
>>> ag = g.call_function(ops.allgather_param, (w, 0, 0)); ag.meta.update(device_time=1.0, tensor_size=8)
>>> wt = g.call_function(ops.wait_allgather, (ag, 0, 0)); wt.meta.update(device_time=0.0, tensor_size=8)
>>> _ = g.output((wt,))
>>> trace = chrome_trace([("forward / before", simulate(g))])
>>> sorted({e["ph"] for e in trace["traceEvents"]})
['C', 'M', 'X']
"""

from __future__ import annotations

import json
import os
from typing import Iterable

from dcsched.outputs import write_atomic
from dcsched.sim.simulate import SimResult

COMPUTE_TID = 1
COMM_TID = 2


def _us(ms: float) -> float:
    return round(ms * 1000.0, 3)


def _process_events(pid: int, label: str, result: SimResult) -> list[dict]:
    if not result.memory:
        raise ValueError("chrome_trace needs results simulated with detail=True")
    events = [
        {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": label}},
        {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}},
        {"ph": "M", "pid": pid, "tid": COMPUTE_TID, "name": "thread_name", "args": {"name": "compute"}},
        {"ph": "M", "pid": pid, "tid": COMM_TID, "name": "thread_name", "args": {"name": "communication"}},
    ]
    for pos, name in enumerate(result.order):
        kind = result.kinds[pos]
        start, end, reach = result.start_ms[pos], result.end_ms[pos], result.reach_ms[pos]
        if kind in ("allgather", "reduce"):
            events.append({"ph": "X", "pid": pid, "tid": COMM_TID, "name": name, "cat": kind,
                           "ts": _us(start), "dur": _us(end - start),
                           "args": {"position": pos, "issued_us": _us(reach)}})
            continue
        if start > reach:
            events.append({"ph": "X", "pid": pid, "tid": COMPUTE_TID, "name": f"stall ({name})", "cat": "stall",
                           "ts": _us(reach), "dur": _us(start - reach),
                           "args": {"position": pos, "waiting_node": name}})
        if end > start:
            events.append({"ph": "X", "pid": pid, "tid": COMPUTE_TID, "name": name, "cat": kind,
                           "ts": _us(start), "dur": _us(end - start), "args": {"position": pos}})
    times, all_bytes, gathered = result.memory_timeline()
    previous = None
    for t, total, gbytes in zip(times, all_bytes, gathered):
        if (total, gbytes) == previous:
            continue
        previous = (total, gbytes)
        events.append({"ph": "C", "pid": pid, "name": "memory", "ts": _us(t),
                       "args": {"all tensors": total, "gathered params": gbytes}})
    return events


def chrome_trace(runs: Iterable[tuple[str, SimResult]]) -> dict:
    """The trace of several simulated orders, one process each, labelled in the trace UI."""
    events: list[dict] = []
    labels = []
    for pid, (label, result) in enumerate(runs, start=1):
        events.extend(_process_events(pid, label, result))
        labels.append(label)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "dcsched simulate", "processes": labels,
                          "units": "ts/dur in microseconds; memory counter in bytes"}}


def write_trace(path: str | os.PathLike, runs: Iterable[tuple[str, SimResult]]) -> None:
    """Write :func:`chrome_trace` to ``path`` atomically."""
    text = json.dumps(chrome_trace(runs)).encode()
    write_atomic(path, lambda handle: handle.write(text))

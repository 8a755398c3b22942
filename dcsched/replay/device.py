"""Devices, and the memory a replay needs: estimates and the check that a step fits."""

from __future__ import annotations

import math
import os

import torch
import torch.fx

from dcsched.bundle.core import Bundle
from dcsched.errors import DcschedError
from dcsched.graph.specs import flat_nodes, recorded_bytes
from dcsched.units import format_bytes


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """``'auto'`` (CUDA when there is a GPU, else CPU), ``'cpu'``, ``'cuda'`` or ``'cuda:N'``.

    Raises :class:`DcschedError` for a device that is not there.

    >>> resolve_device("cpu")
    device(type='cpu')
    """
    text = str(name).strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except RuntimeError:
        raise DcschedError(f"unknown device '{name}' (use auto, cpu, cuda or cuda:N)") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise DcschedError(f"replay runs on cpu or cuda, not '{name}'")
    if not torch.cuda.is_available():
        why = "built without CUDA" if torch.version.cuda is None else "sees no GPU"
        raise DcschedError(f"device '{name}' is not there: this torch ({torch.__version__}) {why}; "
                           "use `device='cpu'`")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DcschedError(f"device '{name}' is not there: {torch.cuda.device_count()} GPU(s) visible")
    return device


def estimate_bytes(bundle: Bundle, world_size: int = 1) -> dict[str, int]:
    """A lower bound of the step's memory, from the bundle alone (bytes).

    ``param_shards`` (this rank's shards), ``largest_gathered`` (one parameter
    all-gathered), ``inputs``, ``saved`` (what the forward outputs, the tensors
    saved for the backward included) and their ``total``.
    """
    shards = sum(-(-p.numel // world_size) * p.dtype.itemsize for p in bundle.params)
    gathered = max((p.nbytes for p in bundle.params), default=0) if world_size > 1 else 0
    inputs = sum(math.prod(i.shape) * i.dtype.itemsize for i in bundle.inputs)
    saved = 0
    for node in bundle.forward.nodes:
        if node.op == "output":
            for value in flat_nodes(node.args):
                if value.op != "placeholder":
                    saved += recorded_bytes(value)
    total = shards + gathered + inputs + saved
    return {"param_shards": shards, "largest_gathered": gathered, "inputs": inputs, "saved": saved,
            "total": total}


def free_bytes(device: torch.device) -> int | None:
    """Bytes free for tensors on ``device`` (None when unknown)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(bundle: Bundle, device: torch.device, world_size: int = 1,
               available: int | None = None) -> dict[str, int]:
    """Raise :class:`DcschedError` before allocating anything if the step cannot fit on ``device``.

    ``available`` overrides the free memory the device reports (bytes).
    """
    estimate = estimate_bytes(bundle, world_size)
    available = free_bytes(device) if available is None else available
    if available is not None and estimate["total"] > available:
        parts = ", ".join(f"{key.replace('_', ' ')} {format_bytes(value)}"
                          for key, value in estimate.items() if key != "total" and value)
        raise DcschedError(f"the step needs at least {format_bytes(estimate['total'])} ({parts}) but only "
                           f"{format_bytes(available)} is free on {device}; nothing was allocated")
    return estimate

"""``dcsched profile``: a training script -> a profiled graph bundle."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from dcsched.costmodels.options import ProfileOptions
from dcsched.errors import DcschedError
from dcsched.outputs import check_outputs
from dcsched.units import format_bytes, format_ms
from dcsched.cli.app import SCRIPT, SCRIPT_ARGS, app, console, err_console, safe_text
from dcsched.cli.options import option


def _join_process_group() -> None:
    """Under torchrun (several ranks), join the process group: collectives are measured there, and the run's
    world size is the group's."""
    from dcsched.runtime import distributed
    if distributed.launched():
        import torch
        distributed.init("cuda" if torch.cuda.is_available() else "cpu")


def _rank() -> int:
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@app.command()
def profile(
    script: Path = SCRIPT,
    script_args: Optional[List[str]] = SCRIPT_ARGS,
    output: Path = typer.Option(Path("graph.pt"), "-o", "--output", help="Bundle to write."),
    module: Optional[str] = typer.Option(None, "--module",
                                         help="Class name of the compiled module to capture when the script "
                                              "compiles several (default: the one with the most parameters)."),
    cost_model: str = option(ProfileOptions, "cost_model", "--cost-model"),
    calibration: Optional[Path] = option(ProfileOptions, "calibration", "--calibration"),
    gpu: Optional[str] = option(ProfileOptions, "gpu", "--gpu"),
    iters: int = option(ProfileOptions, "iters", "--iters", min=1),
    warmup: int = option(ProfileOptions, "warmup", "--warmup", min=0),
    world_size: Optional[int] = option(ProfileOptions, "world_size", "--world-size", min=1),
    bandwidth_gbps: Optional[float] = option(ProfileOptions, "bandwidth_gbps", "--bandwidth"),
    latency_us: Optional[float] = option(ProfileOptions, "latency_us", "--latency"),
    meta: bool = typer.Option(False, "--meta",
                              help="Plan without the weights: run the script with the meta device as the default "
                                   "device (shapes, no storage), so a model of any size is captured in little "
                                   "memory; needs a cost model that runs nothing (--cost-model analytic --gpu ...). "
                                   "The bundle is planned, not measured: it can be scheduled, not replayed."),
    master_dtype: Optional[str] = typer.Option(
        None, "--master-dtype", help="Mixed precision (FSDP2's MixedPrecisionPolicy, param_dtype = the script's "
                                     "dtype): the parameter shards (master weights, the optimizer's states) in this "
                                     "dtype, e.g. fp32 for a bf16 script; gathers and compute stay as captured. "
                                     "Needs a cost model that runs nothing (analytic, calibrated)."),
    reduce_dtype: Optional[str] = typer.Option(
        None, "--reduce-dtype", help="With --master-dtype: reduce the gradients in this dtype (a cast before each "
                                     "reduce-scatter; default: the script's dtype)."),
    force: bool = typer.Option(False, "--force", help="Replace the output file if it exists (refused otherwise)."),
    progress: bool = option(ProfileOptions, "progress", "--progress/--no-progress"),
) -> None:
    """Capture a training script's compiled model as forward and backward aten graphs with ZeRO-3 ops, profile every node and write a graph bundle.

    The script runs as __main__ with torch.compile intercepted and stops after the first forward and backward of the compiled module. Compute times are measured here (CUDA events on a GPU, perf_counter on the CPU) or, with --cost-model analytic, estimated for --gpu. All-gathers and gradient reduce-scatters are modelled as bytes*(W-1)/W / bandwidth + latency (latency and bandwidth from the interconnect table for --gpu and W unless given), and measured by the measured cost model under torchrun. W is --world-size in one process; under torchrun it is the process group's size, and a --world-size that differs is refused. Times are stored in milliseconds, sizes in bytes.

    Example: dcsched profile examples/gpt.py -o gpt.pt --cost-model analytic --gpu h100 -- --layers 4
    """  # noqa: E501
    from dcsched.bundle import core as bundle_io  # torch, imported only when the command runs
    from dcsched.profile.capture import capture_script_step
    from dcsched.profile.measure import PLANNED, profile_bundle, profile_topology

    check_outputs({"-o": output}, inputs=[script], force=force)
    options = ProfileOptions(cost_model=cost_model, iters=iters, warmup=warmup, world_size=world_size,
                             bandwidth_gbps=bandwidth_gbps, latency_us=latency_us, gpu=gpu, progress=progress,
                             calibration=calibration)
    options.check()
    if meta and cost_model == "measured":
        raise DcschedError("--meta captures shapes without data, so nothing can be run and timed: use "
                           "--cost-model analytic --gpu h100 (or calibrated)")
    policy = _policy(master_dtype, reduce_dtype, cost_model)
    _join_process_group()
    from dcsched.runtime.distributed import shutdown
    try:
        topology = profile_topology(options)  # once, here: refuses a --world-size the group does not have
        if progress:
            err_console.print(f"capturing {safe_text(script)} ...", highlight=False)
        captured = capture_script_step(script, list(script_args or []), module, meta=meta)
        if policy is not None:
            from dcsched.train.mixed_precision import with_master_dtype
            with_master_dtype(captured.bundle, *policy)
        bundle = profile_bundle(captured.bundle, options, params=captured.params, inputs=captured.inputs,
                                topology=topology)
    except BaseException:
        shutdown(together=False)
        raise
    rank = _rank()  # before leaving the process group: after it every rank reads as rank 0
    shutdown()
    if meta:
        bundle.provenance.update(planned=True, data=PLANNED)
    bundle.provenance["script"] = str(script)
    bundle.provenance["script_args"] = list(script_args or [])
    if rank != 0:
        return
    bundle_io.save(bundle, output, overwrite=force)

    fw, bw = bundle.forward, bundle.backward
    total = {name: sum(float(n.meta.get("device_time", 0.0)) for n in g.nodes) for name, g in bundle.graphs.items()}
    param_bytes = sum(p.nbytes for p in bundle.params)
    console.print(f"wrote {safe_text(output)}: {safe_text(captured.module_name)}, {len(bundle.params)} parameters "
                  f"({format_bytes(param_bytes)}), forward {len(fw.nodes)} nodes ({format_ms(total['forward'])}), "
                  f"backward {len(bw.nodes) if bw is not None else 0} nodes "
                  f"({format_ms(total.get('backward', 0.0))}); {bundle.provenance['device']}, "
                  f"world size {bundle.provenance['world_size']}{_comm_figures(bundle.provenance)}", highlight=False)


def _policy(master_dtype: str | None, reduce_dtype: str | None, cost_model: str) -> tuple | None:
    """``(master dtype, reduce dtype or None)`` from ``--master-dtype`` / ``--reduce-dtype``, or None; refuses a
    reduce dtype alone, an unknown name, or the measured cost model (which would run the script's tensors, not the
    policy's shards)."""
    if master_dtype is None:
        if reduce_dtype is not None:
            raise DcschedError("--reduce-dtype needs --master-dtype (the mixed-precision policy's master weights)")
        return None
    from dcsched.train.mixed_precision import dtype_named
    policy = dtype_named(master_dtype), dtype_named(reduce_dtype) if reduce_dtype is not None else None
    if cost_model == "measured":
        raise DcschedError("--master-dtype changes the shards' dtype after the capture, so nothing of it can be run "
                           "and timed: use --cost-model analytic --gpu h100 (or calibrated)")
    return policy


def _comm_figures(provenance: dict) -> str:
    """``, collectives 15 us + bytes at 360 GB/s (h100, 1 node: ...)``; ``, collectives measured (latency 40 us)``
    where they were measured."""
    latency, bandwidth = provenance.get("comm_latency_ms"), provenance.get("comm_bandwidth_GBps")
    if latency is None:
        return ""
    if bandwidth is None:
        return f", collectives measured (latency {latency * 1e3:.3g} us)"
    return f", collectives {latency * 1e3:g} us + bytes at {bandwidth:g} GB/s ({provenance.get('comm_link')})"

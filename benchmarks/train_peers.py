"""dcsched against its peers on 2 gloo ranks: FSDP2 (eager, with asynchronous prefetch, compiled whole and per
block), a SimpleFSDP-style compiled model, DDP and DeepSpeed ZeRO-3.

One command spawns the ranks (``torch.multiprocessing``, gloo, one torch thread each) once per model
(``dcsched.examples`` GPT and Llama, 4 layers, d_model 256, 128 tokens by default; the same seeded weights in
every configuration), builds every configuration on every rank and trains them in turn: each of ``--runs``
rounds (default 5) takes the configurations in its own shuffled order (seeded by ``--seed`` and the round,
the same on every rank) and gives each ``--warmup`` untimed steps, then ``--steps`` timed ones, each after a
barrier. A step is forward, backward, the optimizer's step (AdamW, lr 1e-4) and ``zero_grad`` (DeepSpeed: its
engine's ``backward`` and ``step``, ZeRO-3 with the Hugging Face integration's "auto" bucket sizes for the
model's width); each rank trains on its own seeded batches (``--batch`` is the global batch, split over the
ranks), the same batches for every configuration. The peers' setups are in ``benchmarks/peer_recipes.py``,
the rows' arithmetic and the table in ``benchmarks/peer_table.py``.

Per configuration:

* step ms: each timed step's wall time (``time.perf_counter``) is the maximum over the ranks (the steps start
  together, from a barrier), a round's figure the median of its steps, the row's the median of the rounds;
  ``vs ddp``: that against DDP's; ``vs best zero3`` (dcsched's rows): against the fastest ZeRO-3 peer of the
  same kind (eager rows against ``fsdp2``, ``fsdp2-prefetch``, ``deepspeed-zero3``; ``-inductor`` rows
  against ``fsdp2-compile``, ``fsdp2-compile-block``, ``simplefsdp``), named in the cell;
* CPU ms (per rank): the median over every timed step of the process's CPU time (``time.process_time``: every
  thread of the rank);
* peak MiB: the bytes the configuration holds when a step starts (its parameters, buffers, gradients and
  optimizer state as this rank stores them, shards where sharded, each storage once; DDP's gradient buckets;
  DeepSpeed's partitions) plus the highest the step's own CPU allocations rise above that, from the torch
  profiler's memory events over one extra step (every allocation and free of torch's CPU allocator,
  gathered parameters, activations, collective buffers and inductor's buffers included);
* collectives per step: the gloo collectives that one step issues (the profiler's ``gloo:*`` events: every
  framework's, DDP's C++ reducer included); dcsched's own count
  (``dcsched.runtime.distributed.collectives_issued``) is in the JSON beside it;
* async: which of a dcsched configuration's collectives run asynchronously in the forward / the backward
  (``gathers+reduces``, ``gathers``, ``reduces``, ``none``), as its backend chose for each graph's budget
  (``dcsched.train.backend.asynchrony``);
* first step s (the slower rank's): construction (build, shard or wrap, optimizer) + compile + the first step,
  from a barrier (each rank has compiled a tiny module first, with inductor where a configuration uses it, so
  no configuration pays for the compiler's imports; inductor has a fresh cache directory, so compiles are
  cold; DeepSpeed's import is not counted either, its JIT-built ops are when they are first built);
* max |loss - ddp|: the largest difference of this configuration's losses from DDP's at the same steps, over
  every step it trained (warm-up, profiled and timed steps, all rounds) and both ranks.

    python benchmarks/bench_train.py --peers             # GPT: dcsched overlap-plan (eager, inductor), fsdp, every peer
    python benchmarks/bench_train.py --peers --model gpt --model llama --model hf-llama   # the table in docs/train.md
    python benchmarks/bench_train.py --peers --model gpt --config dcsched-none --config ddp --json
    python benchmarks/bench_train.py --peers --model llama --checkpointing none,full,selective \
        --algo fsdp --config dcsched-fsdp --config dcsched-overlap-plan --config fsdp2   # the recipes' table

``--checkpointing`` trains every configuration under each form in turn (one spawn of the ranks per form):
the Llama's blocks checkpointed with ``torch.utils.checkpoint`` inside the model's forward, so FSDP2 and DDP
train the same checkpointed blocks dcsched captures. ``--model hf-llama`` is transformers' ``LlamaForCausalLM``
of the example Llama's size (``--set``; built from its config, nothing downloaded), its layers checkpointed by
``gradient_checkpointing_enable`` (``--checkpointing full``: ``use_reentrant=False``; ``reentrant``):

    python benchmarks/bench_train.py --peers --model hf-llama --checkpointing none,full --algo fsdp \
        --config dcsched-fsdp --config dcsched-overlap-plan --config fsdp2

``--mp-policy bf16`` trains dcsched and FSDP2 under ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` (``benchmarks/peer_recipes.py``); DDP, the losses' reference, stays fp32.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # peer_recipes, peer_table, beside this file
from peer_table import COMPILED_PEERS, add_ratios, round_order, row_figures, table  # noqa: E402

#: ``dcsched.examples.CHECKPOINTING``: the Llama's activation checkpointing forms (not imported here: the
#: parent spawns the ranks before it needs dcsched).
CHECKPOINTING = ("none", "full", "reentrant", "selective")
#: The forms each model takes: Hugging Face's ``gradient_checkpointing_enable`` checkpoints whole layers,
#: non-reentrant (full) or reentrant.
FORMS_OF = {"gpt": ("none",), "llama": CHECKPOINTING, "hf-llama": ("none", "full", "reentrant")}
#: The models' size (``dcsched.examples.build``), overridable with ``--set KEY=N``.
SIZE = {"n_layers": 4, "d_model": 256, "n_heads": 4, "vocab": 512, "seq": 128}
#: dcsched's rows in a default run: the planner with eager compute and with inductor's (each against its kind
#: of peer), and FSDP2's policy on dcsched's runtime.
DEFAULT_DCSCHED = ("dcsched-overlap-plan", "dcsched-overlap-plan-inductor", "dcsched-fsdp")
#: Algorithms ``--config dcsched-ALGO[-inductor]`` names without ``--algo``.
KNOWN_ALGOS = ("none", "fast-free", "overlap", "overlap-plan", "fsdp")
PEERS = ("fsdp2", "fsdp2-prefetch", "fsdp2-compile", "fsdp2-compile-block", "simplefsdp", "ddp", "deepspeed-zero3")
LR = 1e-4
#: Distinct batches each rank cycles through (step k of every configuration takes batch k mod this).
BATCHES = 16


def model_sizes(parser: argparse.ArgumentParser, items: list[str], defaults: dict) -> dict:
    """``defaults`` updated by each ``--set KEY=N`` of ``items`` (a parser error names a bad one)."""
    sizes = dict(defaults)
    for item in items:
        key, _, value = item.partition("=")
        if key not in defaults or not value.isdigit() or int(value) < 1:
            parser.error(f"--set {item}: KEY=N with KEY one of {', '.join(defaults)} and N a positive integer")
        sizes[key] = int(value)
    return sizes


def checkpointing_forms(parser: argparse.ArgumentParser, text: str, models: list[str]) -> list[str]:
    """The forms ``--checkpointing`` names, in order, each once (a parser error names a bad one, or one a model
    does not take: the example GPT checkpoints nothing, the Hugging Face Llama no selective form)."""
    forms = list(dict.fromkeys(form.strip() for form in text.split(",")))
    unknown = [form for form in forms if form not in CHECKPOINTING]
    if unknown:
        parser.error(f"--checkpointing {unknown[0]!r}: choose from {', '.join(CHECKPOINTING)}")
    for model in models:
        refused = [form for form in forms if form not in FORMS_OF[model]]
        if refused:
            parser.error(f"--checkpointing {refused[0]} is not a form --model {model} takes "
                         f"(it takes {', '.join(FORMS_OF[model])})")
    return forms


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_train.py --peers", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=tuple(FORMS_OF),
                        help="repeatable; default gpt (the full comparison: --model gpt --model llama); hf-llama: "
                             "transformers' LlamaForCausalLM of the same size, built from its config")
    parser.add_argument("--algo", action="append", default=[],
                        help=f"a further dcsched algorithm (repeatable) beside {', '.join(DEFAULT_DCSCHED)}, "
                             "its rows under each --compute")
    parser.add_argument("--compute", action="append", choices=("eager", "inductor"),
                        help="dcsched's --compute for the --algo rows (repeatable; default eager); inductor rows are "
                             "dcsched-ALGO-inductor")
    parser.add_argument("--config", action="append",
                        help="run only these configurations (repeatable), e.g. dcsched-none, fsdp2, ddp")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per round (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per round before them (default 1)")
    parser.add_argument("--runs", type=int, default=5, help="interleaved rounds (default 5), each in its own "
                        "shuffled order of the configurations")
    parser.add_argument("--seed", type=int, default=0, help="the rounds' shuffles' seed (default 0)")
    parser.add_argument("--batch", type=int, default=8, help="global batch, split over the ranks (default 8)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=N",
                        help=f"the model's size, default {SIZE}")
    parser.add_argument("--timeout", type=float, default=600.0, help="process-group timeout, seconds")
    parser.add_argument("--memory-budget", default=None, metavar="SIZE",
                        help="dcsched's --memory-budget for its configurations (e.g. 40MiB, unlimited, fsdp; "
                             "default: none, training's own default: on the CPU fsdp for overlap-plan, unlimited "
                             "for the others)")
    parser.add_argument("--checkpointing", default="none", metavar="FORMS",
                        help="activation checkpointing of the Llama's blocks, a comma-separated list of "
                             f"{', '.join(CHECKPOINTING)} (default none): every configuration trains the model "
                             "under each form in turn, FSDP2 and DDP the same checkpointed blocks; hf-llama: "
                             "gradient_checkpointing_enable, full (use_reentrant=False) or reentrant")
    parser.add_argument("--mp-policy", choices=("none", "bf16"), default="none",
                        help="mixed precision of the sharded configurations, dcsched.shard's and fully_shard's "
                             "mp_policy: bf16 is MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) "
                             "(DDP, the losses' reference, trains in fp32; DeepSpeed is not run)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    if min(args.steps, args.runs, args.batch, args.world_size) < 1 or args.warmup < 0:
        parser.error("--steps, --runs, --batch and --world-size must be at least 1, --warmup at least 0")
    if args.batch % args.world_size:
        parser.error(f"--batch {args.batch} does not split over {args.world_size} ranks")
    args.size = model_sizes(parser, args.set, SIZE)
    args.models = args.model or ["gpt"]
    args.forms = checkpointing_forms(parser, args.checkpointing, args.models)
    args.form = args.forms[0]
    names, candidates = configuration_names(args.algo, args.compute or ["eager"])
    if args.config:
        unknown = [c for c in args.config if c not in candidates]
        if unknown:
            parser.error(f"--config {unknown[0]}: choose from {', '.join(candidates)} (add algorithms with --algo)")
        names = list(dict.fromkeys(args.config))
    if "ddp" not in names:  # the losses are compared with DDP's
        names.append("ddp")
    args.configs = names
    return args


def configuration_names(algos: list[str], computes: list[str]) -> tuple[list[str], list[str]]:
    """The configurations a run trains by default, and every name ``--config`` may pick: dcsched's default rows,
    each of ``algos`` under each of ``computes``, then :data:`PEERS`; ``--config`` also takes every
    :data:`KNOWN_ALGOS` algorithm under either compute.

    >>> names, candidates = configuration_names(["none"], ["eager"])
    >>> names[:4], names[4:] == list(PEERS)
    (['dcsched-overlap-plan', 'dcsched-overlap-plan-inductor', 'dcsched-fsdp', 'dcsched-none'], True)
    >>> "dcsched-fast-free-inductor" in candidates
    True
    """
    def row(algo: str, compute: str) -> str:
        return f"dcsched-{algo}" + ("" if compute == "eager" else f"-{compute}")
    own = [row(algo, compute) for algo in algos for compute in computes]
    names = list(dict.fromkeys([*DEFAULT_DCSCHED, *own, *PEERS]))
    every = [row(algo, compute) for algo in dict.fromkeys([*KNOWN_ALGOS, *algos]) for compute in ("eager", "inductor")]
    return names, list(dict.fromkeys([*names, *every]))


# --------------------------------------------------------------------------- configurations (in a rank)


class Config:
    """One way of training the model on this rank: :meth:`setup` builds it, :meth:`step` trains one step."""

    def __init__(self, name: str, family: str, args, per_rank: int) -> None:
        self.name, self.family, self.args, self.per_rank = name, family, args, per_rank
        self.count, self.extra_state = 0, 0

    def setup(self) -> None:
        from dcsched.examples import build
        from peer_recipes import mixed_precision
        form = {"checkpointing": self.args.form} if self.args.form != "none" else {}
        if self.family == "hf-llama":
            from peer_recipes import hf_llama
            model = hf_llama(self.args.size, self.args.form)
        else:
            model, _, _ = build(self.family, seed=0, batch=self.per_rank, **self.args.size, **form)
        model.train()
        self.model = model
        self.optimizer = None
        name = self.name
        if name.startswith("dcsched-"):
            import dcsched
            algo = name[len("dcsched-"):]
            compute = "inductor" if algo.endswith("-inductor") else "eager"
            algo = algo.removesuffix("-inductor")
            dcsched.shard(model, mp_policy=mixed_precision(self.args.mp_policy, fsdp2=False))
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            options = {"memory_budget": self.args.memory_budget} if self.args.memory_budget else {}
            self.backend = dcsched.backend(algo=algo, compute=compute, **options)
            self.run = torch.compile(model, backend=self.backend, dynamic=False)
        elif name.startswith("fsdp2"):
            from peer_recipes import compile_blocks, fsdp2
            if name == "fsdp2-compile-block":
                compile_blocks(model)  # torchtitan: compile each block, then shard
            fsdp2(model, mixed_precision(self.args.mp_policy, fsdp2=True), prefetch=name == "fsdp2-prefetch")
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            self.run = torch.compile(model, dynamic=False) if name == "fsdp2-compile" else model
        elif name == "simplefsdp":
            if self.args.mp_policy != "none":
                raise ValueError("--mp-policy: the SimpleFSDP row is set up in fp32 only")
            from peer_recipes import simple_fsdp, simplefsdp_compile_options
            simple_fsdp(model, torch.distributed.get_world_size())
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)  # steps the DTensor shards
            self.run = torch.compile(model, fullgraph=True, dynamic=False, options=simplefsdp_compile_options())
        elif name == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            self.run = DistributedDataParallel(model)
            self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            # The reducer's flat gradient buckets hold every gradient, allocated once, in C++.
            self.extra_state = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        elif name == "deepspeed-zero3":
            if self.args.mp_policy != "none":
                raise ValueError("--mp-policy: DeepSpeed's bf16 section is not set up by this benchmark")
            import deepspeed
            optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
            # ZeRO-3 with the Hugging Face integration's "auto" sizes for the model's width (DeepSpeed's own
            # defaults preallocate a 5e8-element reduce bucket, 1.9 GiB, whatever the model).
            width = self.args.size["d_model"]
            zero = {"stage": 3, "reduce_bucket_size": width * width,
                    "stage3_prefetch_bucket_size": int(0.9 * width * width),
                    "stage3_param_persistence_threshold": 10 * width}
            config = {"train_micro_batch_size_per_gpu": self.per_rank, "gradient_accumulation_steps": 1,
                      "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10 ** 9}
            self.run, self.optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        else:
            raise ValueError(f"unknown configuration {name}")

    def step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
        self.count += 1
        if self.family == "hf-llama":  # its loss shifts the labels itself
            import dcsched
            # dcsched traces a checkpointed layer's side effects whole (docs/train.md, "Recipes")
            with dcsched.tracing_checkpoints() if self.name.startswith("dcsched-") else contextlib.nullcontext():
                loss = self.run(input_ids=batch[0], labels=batch[0]).loss
        else:
            loss = self.run(*batch)
        if self.name == "deepspeed-zero3":
            self.run.backward(loss)
            self.run.step()
        else:
            loss.backward()
            if self.name == "simplefsdp" and self.count == 1:  # the optimizer steps the shards: check, once
                from peer_recipes import check_sharded_gradients
                check_sharded_gradients(self.model, torch.distributed.get_world_size())
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    def asynchronous(self) -> str | None:
        """Which of dcsched's collectives run asynchronously, forward / backward (``gathers+reduces``,
        ``gathers``, ``reduces`` or ``none`` each), as the backend chose for its budget; None for the other
        configurations."""
        programs = getattr(getattr(self, "backend", None), "programs", None)
        if not programs:
            return None
        program = programs[-1]
        runtime, graph_ids = program.runtime, program.bundle.graph_ids
        ways = []
        for name in ("forward", "backward"):
            issue = runtime.issue_in(graph_ids[name])
            kinds = [kind for kind, on in (("gathers", issue.async_gather), ("reduces", issue.async_reduce)) if on]
            ways.append("+".join(kinds) or "none")
        return " / ".join(ways)

    def held_bytes(self) -> int:
        """Bytes of the training state this rank holds between steps, each storage once."""
        seen: dict[int, int] = {}
        for tensor in _state_tensors(self):
            if tensor.device.type != "cpu":
                continue
            storage = tensor.untyped_storage()
            if storage.nbytes():
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values()) + self.extra_state


def _local(tensor):
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _tensors_of(value, depth: int):
    """Tensors in ``value``: itself, or inside its lists, tuples, dicts and attributes, ``depth`` levels down."""
    if isinstance(value, torch.Tensor):
        yield _local(value)
        ds_tensor = getattr(value, "ds_tensor", None)  # a DeepSpeed ZeRO-3 parameter's own partition
        if isinstance(ds_tensor, torch.Tensor):
            yield ds_tensor
        return
    if depth <= 0 or isinstance(value, (str, bytes, int, float, torch.nn.Module, type)) or callable(value):
        return
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set)):
        items = list(value)
    else:
        items = list(getattr(value, "__dict__", {}).values())
    for item in items:
        yield from _tensors_of(item, depth - 1)


def _state_tensors(config: Config):
    model = config.model
    for parameter in model.parameters():
        yield from _tensors_of(parameter, 1)
        if parameter.grad is not None:
            yield _local(parameter.grad)
    yield from (_local(b) for b in model.buffers())
    optimizer = config.optimizer
    if config.name == "deepspeed-zero3":  # its ZeRO optimizer keeps fp32 partitions and flat buffers
        yield from _tensors_of(optimizer, 3)
        optimizer = getattr(optimizer, "optimizer", optimizer)
    yield from _tensors_of(dict(optimizer.state), 3)


def _profiled_step(config: Config, batch) -> dict:
    """One step under the torch profiler: its gloo collectives and its allocation high-water above its start."""
    from torch.profiler import ProfilerActivity, profile

    from dcsched.runtime.distributed import collectives_issued
    held = config.held_bytes()
    issued = collectives_issued()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = config.step(batch)
    issued = collectives_issued() - issued
    collectives: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith("gloo:"):
            collectives[event.name] = collectives.get(event.name, 0) + 1
    allocations = allocation_events(prof)
    rise = 0
    if allocations:
        start = allocations[0][2] - allocations[0][1]  # the allocator's count before the step's first event
        rise = max(0, max(event[2] for event in allocations) - start)
    return {"loss": loss, "collectives": sum(collectives.values()), "collectives_by_kind": collectives,
            "asynchronous": config.asynchronous(),
            "dcsched_collectives": issued if config.name.startswith("dcsched-") else None,
            "held_bytes": held, "step_rise_bytes": rise, "peak_bytes": held + rise}


def allocation_events(prof) -> list[tuple[int, int, int, int, list[str]]]:
    """The CPU allocator's events a torch profile recorded, in time order: ``(start ns, bytes (negative: a
    free), bytes allocated after it, address, the names of the ops it happened in, innermost first)``."""
    from torch._C._profiler import _EventType

    events = []
    pending = list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.tag == _EventType.Allocation and event.extra_fields.device.type == "cpu":
            fields, names, parent = event.extra_fields, [], event.parent
            while parent is not None:
                names.append(parent.name)
                parent = parent.parent
            events.append((event.start_time_ns, fields.alloc_size, fields.total_allocated, fields.ptr, names))
    events.sort(key=lambda e: e[0])
    return events


# --------------------------------------------------------------------------- one rank


def _batches(rank: int, per_rank: int, size: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1000 + rank)
    out = []
    for _ in range(BATCHES):
        tokens = torch.randint(0, size["vocab"], (per_rank, size["seq"] + 1), generator=generator)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def _deepspeed_missing() -> str | None:
    """Why DeepSpeed cannot run here, or None."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if importlib.util.find_spec("deepspeed") is None:
        return "not importable (pip install deepspeed, DS_BUILD_OPS=0)"
    try:
        import deepspeed  # noqa: F401
    except Exception as exc:  # noqa: BLE001 (any failure to import is reported, not raised)
        return f"not importable: {type(exc).__name__}: {exc}".splitlines()[0][:200]
    torch.set_num_threads(1)  # DeepSpeed's CPU accelerator may set its own
    return None


def _warm_compilers(inductor: bool) -> None:
    """Compile and train a tiny module once (TorchDynamo, AOT autograd, and inductor where a configuration
    uses it), so that no configuration's first step pays for importing and initialising the compiler stack,
    whichever comes first."""
    import dcsched  # noqa: F401 (its import, too, is not any configuration's)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 1))
    torch.compile(module, backend="inductor" if inductor else "aot_eager", dynamic=False)(
        torch.randn(4, 8)).sum().backward()
    torch._dynamo.reset()


def _fresh_inductor_cache(root: str, name: str) -> None:
    """Give configuration ``name`` an Inductor cache of its own (a directory under ``root``, and the in-memory
    code caches emptied; compiled code already in use keeps its kernels), so its first step compiles cold
    whichever configurations compiled before it in this process: kernels another configuration built are not
    reused."""
    from torch._inductor.utils import clear_caches
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(root, name))
    clear_caches()


def worker(rank: int, world_size: int, port: int, family: str, args, out_dir: str) -> None:
    """mp.spawn target: train every configuration of ``family`` in rounds; results to ``out_dir/rank<r>.json``."""
    import torch.distributed as dist

    from dcsched.runtime import distributed
    os.dup2(2, 1)  # the parent's stdout carries the table or JSON alone
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    distributed.init("cpu", timeout=datetime.timedelta(seconds=args.timeout))  # gloo, from the environment above
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.recompile_limit = 64
    _warm_compilers(any(name in COMPILED_PEERS or name.endswith("-inductor") for name in args.configs))
    inductor_root = os.environ.get("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="dcsched-peers-inductor-"))
    per_rank = args.batch // world_size
    batches = _batches(rank, per_rank, args.size)
    results: dict[str, dict] = {}
    configs: dict[str, Config] = {}
    for name in args.configs:
        results[name] = {"losses": [], "step_ms": [], "cpu_ms": []}
        if name == "deepspeed-zero3":
            missing = _deepspeed_missing()
            if missing:
                results[name]["error"] = missing
                continue
        configs[name] = Config(name, family, args, per_rank)

    def train(config: Config) -> float:
        loss = config.step(batches[config.count % BATCHES])
        results[config.name]["losses"].append(loss)
        return loss

    try:
        for round_ in range(args.runs):
            for name in round_order(list(configs), round_, args.seed):  # the same order on every rank
                config, result = configs[name], results[name]
                if "error" in result:
                    continue
                if rank == 0:
                    print(f"[{family}] round {round_ + 1}/{args.runs}: {name}", file=sys.stderr, flush=True)
                try:
                    dist.barrier()
                    if round_ == 0:  # construction, compile and the first step
                        _fresh_inductor_cache(inductor_root, name)
                        start = time.perf_counter()
                        config.setup()
                        train(config)
                        result["first_step_s"] = time.perf_counter() - start
                    for _ in range(args.warmup):
                        train(config)
                    if round_ == 0:
                        profiled = _profiled_step(config, batches[config.count % BATCHES])
                        result["losses"].append(profiled.pop("loss"))
                        result.update(profiled)
                    wall, cpu = [], []
                    for _ in range(args.steps):
                        dist.barrier()  # every rank starts the step together: the slowest rank's time is the step's
                        start, start_cpu = time.perf_counter(), time.process_time()
                        train(config)
                        wall.append((time.perf_counter() - start) * 1e3)
                        cpu.append((time.process_time() - start_cpu) * 1e3)
                    result["step_ms"].append(wall)  # each step's, the parent takes the maximum over ranks
                    result["cpu_ms"].append(cpu)
                except Exception as exc:  # noqa: BLE001 (a failed configuration is a row, the rest go on)
                    traceback.print_exc()
                    while exc.__cause__ is not None:  # torch.compile wraps the backend's own error
                        exc = exc.__cause__
                    result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    finally:
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- the parent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn(family: str, args) -> list[dict]:
    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory(prefix="dcsched-peers-") as out_dir:
        # A fresh inductor cache: compiled configurations' first steps compile cold, as a first run does,
        # rather than reading kernels an earlier run left on disk.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(out_dir, "inductor-cache"))
        mp.spawn(worker, args=(args.world_size, _free_port(), family, args, out_dir), nprocs=args.world_size,
                 join=True)
        return [json.loads(Path(out_dir, f"rank{r}.json").read_text()) for r in range(args.world_size)]


def rows_for(family: str, ranks: list[dict], args, load: float) -> list[dict]:
    """One row per configuration from the ranks' results (``peer_table.row_figures``)."""
    label = f"{family} {args.size['n_layers']}x{args.size['d_model']} seq {args.size['seq']} batch {args.batch}"
    if args.forms != ["none"]:
        label += f" ckpt {args.form}"
    if args.mp_policy != "none":
        label += f" mp {args.mp_policy}"
    ddp = [rank["ddp"]["losses"] for rank in ranks]
    rows = []
    for name in args.configs:
        per_rank = [rank[name] for rank in ranks]
        row: dict = {"config": name, "model": label}
        error = next((r["error"] for r in per_rank if "error" in r), None)
        if error is None and any(not r["step_ms"] for r in per_rank):
            error = "no timed steps"
        if error is not None:
            row["error"] = error
        else:
            row.update(row_figures(per_rank, ddp))
            row.update({"runs": args.runs, "steps": args.steps, "warmup": args.warmup, "load": load,
                        "checkpointing": args.form, "mp_policy": args.mp_policy})
        rows.append(row)
    return add_ratios(rows)


def main(argv=None) -> list[dict]:
    args = arguments(argv)
    rows = []
    for family in args.models:
        for form in args.forms:
            args.form = form
            load = round(os.getloadavg()[0], 1)
            rows += rows_for(family, _spawn(family, args), args, load)
    out = json.dumps(rows, indent=2) if args.json else table(rows)
    print(out)
    sys.stdout.flush()
    return rows


if __name__ == "__main__":
    main()

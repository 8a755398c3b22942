"""Activation checkpointing in a captured step: what the partitioner is told before, and what it made undone after.

A checkpointed region (``torch.utils.checkpoint.checkpoint``, Hugging Face's
``gradient_checkpointing_enable``, a selective policy) reaches AOT autograd as
nodes tagged for recomputation; the min-cut partitioner then copies them into
the backward graph, which recomputes them from the saved region inputs (and
from the parameters, which ZeRO-3 re-gathers there). Two things need help on the
way to a bundle:

* Region ids. dcsched tags parameter views for recomputation too
  (:func:`dcsched.profile.recording._mark_param_views_for_recompute`), and the
  partitioner saves a recomputed node that a recomputed node of a *later* region
  reads (``ac_graph_id`` greater: the boundary between two checkpointed blocks).
  Parameter views, in a block or not, get :data:`PARAM_VIEWS_REGION`, above every
  region's id, so none of them is saved (it would keep a view of a gathered buffer
  the forward frees), whether a block or the backward's own transposes read it.
* Random ops. A recomputed op tagged ``nondeterministic_seeded`` makes the
  partitioner save the generator's state in the forward and replay it in the
  backward (``run_and_save_rng_state`` / ``run_with_rng_state``), which no bundle
  can hold. An op that draws nothing (attention with ``dropout_p=0``, dropout
  with ``p=0`` or ``train=False``) is unwrapped again after partitioning
  (:func:`unwrap_rng_replays`); one that does draw (real dropout in a
  checkpointed block) is saved instead of recomputed (:func:`save_random_ops`),
  so the backward reads the forward's draw: the same numbers, that op's output
  kept where eager checkpointing would recompute it.

Python side effects inside a checkpointed region (the ``kernels`` package's
layer wrapper sets and resets a global around every wrapped forward) are traced
under ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``
(:func:`tracing_checkpoints`): applied once, after the forward, and not again
when the backward recomputes the region, as every compiled backward does.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from typing import Iterator

import torch
import torch.fx

#: The checkpoint-region id of parameter views: above any id torch hands out.
PARAM_VIEWS_REGION = sys.maxsize


@contextlib.contextmanager
def tracing_checkpoints() -> Iterator[None]:
    """While it lasts, TorchDynamo traces checkpointed regions with Python side effects into the graph.

    The side effects are applied once, after the forward, and not again when the backward recomputes the
    region (``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``); without it TorchDynamo
    stops at such a region (a graph break: ``dcsched profile`` refuses it, ``dcsched.backend`` runs the
    region eagerly, outside the schedule). ``dcsched profile``, ``dcsched train`` and :func:`dcsched.capture`
    trace under it; a script calling ``torch.compile(model, backend=dcsched.backend(...))`` itself wraps its
    compiled calls (their first, which traces) in it.

    Parameters
    ----------
    None

    Returns
    -------
    contextlib.AbstractContextManager
        Restores TorchDynamo's setting on exit.

    Examples
    --------
    >>> import torch, dcsched
    >>> with dcsched.tracing_checkpoints():
    ...     torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint
    True
    """
    config = torch._dynamo.config
    if not hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):  # pragma: no cover (older torch)
        yield
        return
    with config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        yield


def _recomputed(node: torch.fx.Node) -> bool:
    from torch.utils.checkpoint import CheckpointPolicy
    return node.meta.get("recompute") in (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)


def _argument(target, args, kwargs, name: str):
    """The value of the argument ``name`` of a call of ``target`` (its default where not passed); None if the
    schema has no such argument."""
    schema = getattr(target, "_schema", None)
    if schema is None:
        return None
    for i, argument in enumerate(schema.arguments):
        if argument.name == name:
            if name in kwargs:
                return kwargs[name]
            if i < len(args):
                return args[i]
            return argument.default_value if argument.has_default_value() else None
    return None


def draws_random(target, args, kwargs) -> bool:
    """Whether a call of the op ``target`` draws random numbers.

    Ops tagged ``nondeterministic_seeded`` draw unless they are attention with ``dropout_p`` 0 or dropout with
    ``p`` 0 or ``train`` False.

    >>> aten = torch.ops.aten
    >>> draws_random(aten._scaled_dot_product_flash_attention_for_cpu.default, (1, 2, 3), {"dropout_p": 0.0})
    False
    >>> draws_random(aten._scaled_dot_product_flash_attention_for_cpu.default, (1, 2, 3, 0.1), {})
    True
    >>> draws_random(aten.native_dropout.default, (1, 0.1, True), {}), draws_random(aten.mm.default, (1, 2), {})
    (True, False)
    """
    if torch.Tag.nondeterministic_seeded not in getattr(target, "tags", ()):
        return False
    dropout_p = _argument(target, args, kwargs, "dropout_p")
    if dropout_p is None and target in (torch.ops.aten.native_dropout.default,):
        if _argument(target, args, kwargs, "train") is False:
            return False
        dropout_p = _argument(target, args, kwargs, "p")
    return not (isinstance(dropout_p, (int, float)) and dropout_p == 0)


def save_random_ops(joint: torch.fx.Graph) -> int:
    """Mark every recomputed op of ``joint`` that draws random numbers MUST_SAVE; returns how many.

    Its output is then saved for the backward rather than recomputed under a replayed generator state.
    """
    from torch.utils.checkpoint import CheckpointPolicy
    saved = 0
    for node in joint.nodes:
        if node.op == "call_function" and _recomputed(node) and draws_random(node.target, node.args, node.kwargs):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            for user in node.users:  # a tuple is never saved: its items are
                if user.target is operator.getitem:
                    user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            saved += 1
    return saved


def _is_rng_replay(node: torch.fx.Node, hop_name: str) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", str(node.target)) == hop_name


def unwrap_rng_replays(forward: torch.fx.GraphModule, backward: torch.fx.GraphModule) -> int:
    """Undo the partitioner's generator-state replay for ops that draw nothing; returns how many.

    The partitioner rewrote each recomputed ``nondeterministic_seeded`` op as ``run_and_save_rng_state(op,
    ...)`` in the forward (its state appended to the saved outputs, in order) and ``run_with_rng_state(state,
    op, ...)`` in the backward (the state a ``rng_state_output_<i>`` placeholder, in the same order). Where the
    op draws nothing, both become the plain op and the state leaves the forward's outputs and the backward's
    inputs. Called on the partitioner's own result, before AOT autograd counts the saved tensors.
    """
    fw_graph, bw_graph = forward.graph, backward.graph
    fw_output = next(iter(fw_graph.find_nodes(op="output")))
    outputs = list(fw_output.args[0])
    states = [value for value in outputs if isinstance(value, torch.fx.Node) and value.target is operator.getitem
              and _is_rng_replay(value.args[0], "run_and_save_rng_state")]
    placeholders = [node for node in bw_graph.find_nodes(op="placeholder")
                    if node.name.startswith("rng_state_output")]
    if len(states) != len(placeholders):
        return 0  # not the layout this expects: left as it is (the bundle's op list then refuses the HOPs)
    unwrapped = 0
    for state, placeholder in zip(states, placeholders):
        saving = state.args[0]
        op, args = saving.args[0], saving.args[1:]
        replays = [user for user in placeholder.users if _is_rng_replay(user, "run_with_rng_state")]
        if draws_random(op, args, saving.kwargs) or len(replays) != len(placeholder.users):
            continue
        # The op's result (its value and shapes: what profiling sizes) is the meta of the forward's getitem of
        # it; the backward's replay was made without one.
        meta = next((dict(user.meta) for user in saving.users if user.args[1] == 1), {})
        _replace_with_plain_op(fw_graph, saving, op, args, saving.kwargs, meta, result_index=1)
        for replay in replays:
            _replace_with_plain_op(bw_graph, replay, replay.args[1], replay.args[2:], replay.kwargs, meta)
        outputs = [value for value in outputs if value is not state]
        fw_output.args = (tuple(outputs),)
        fw_graph.erase_node(state)
        if not saving.users:
            fw_graph.erase_node(saving)
        bw_graph.erase_node(placeholder)
        unwrapped += 1
    if unwrapped:
        forward.recompile()
        backward.recompile()
    return unwrapped


def _replace_with_plain_op(graph: torch.fx.Graph, wrapped: torch.fx.Node, op, args, kwargs, meta: dict,
                           result_index: int | None = None) -> None:
    """``wrapped`` (a replay HOP's call) becomes ``op(*args, **kwargs)`` with ``meta``; ``result_index``: the
    HOP returned (state, result) and its users take ``[result_index]``."""
    with graph.inserting_before(wrapped):
        plain = graph.call_function(op, tuple(args), dict(kwargs))
    plain.meta = dict(meta)
    if result_index is None:
        wrapped.replace_all_uses_with(plain)
        graph.erase_node(wrapped)
        return
    for user in list(wrapped.users):
        if user.target is operator.getitem and user.args[1] == result_index:
            user.replace_all_uses_with(plain)
            graph.erase_node(user)

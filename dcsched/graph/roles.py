"""What each node of a ZeRO-3 graph does, read from its op (never its name alone).

A node's role is one of :class:`Role`. The communication ops are the kinds of
:mod:`dcsched.collectives`, recognised by their op name in either the
``dcsched`` or DeepSpeed's ``dc`` namespace, so graphs built by DeepSpeed and by
dcsched are treated alike; a kind's row gives its role.

>>> import torch, torch.fx
>>> from dcsched.runtime import ops
>>> g = torch.fx.Graph()
>>> p = g.placeholder("p")
>>> ag = g.call_function(ops.allgather_param, (p, 0, 3))
>>> role_of(p), role_of(ag), ds_id_of(ag)
(<Role.PLACEHOLDER: 'placeholder'>, <Role.ALLGATHER: 'allgather'>, 3)
"""

from __future__ import annotations

import enum
import operator

import torch
import torch.fx

from dcsched import collectives

COMM_NAMESPACES = collectives.NAMESPACES


class Role(str, enum.Enum):
    """What a node of a ZeRO-3 graph does (:func:`role_of`); the value is the name reports and views use.

    Examples
    --------
    >>> Role("allgather") is Role.ALLGATHER, Role.WAIT.value
    (True, 'wait')
    """

    PLACEHOLDER = "placeholder"
    COMPUTE = "compute"
    ALLGATHER = "allgather"
    WAIT = "wait"
    RELEASE = "release"
    REDUCE = "reduce"
    OUTPUT = "output"


#: Roles of the inserted ZeRO-3 ops (the roles a collective kind may have); their args[2] is the ds_id.
COMM_ROLES = frozenset(Role(role) for role in collectives.ROLE_MEMORY)
#: Comm roles whose output is a view of their input (allocating nothing) ...
_VIEW_ROLES = frozenset(Role(r) for r, memory in collectives.ROLE_MEMORY.items() if memory in ("view", "frees"))
#: ... and of those, the ones DeepSpeed's last-use analysis counts as aliasing (a release does not).
_ALIASING_ROLES = frozenset(Role(r) for r, memory in collectives.ROLE_MEMORY.items() if memory == "view")


def qualified_name(target) -> str:
    """``'aten.mm.default'``-style name of a call target (what bundles store).

    >>> qualified_name(torch.ops.aten.mm.default)
    'aten.mm.default'
    >>> qualified_name(operator.getitem)
    'operator.getitem'
    """
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._opname}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"{target._qualified_op_name.replace('::', '.')}"
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"higher_order.{target.name()}"
    if isinstance(target, str):
        return target
    module = getattr(target, "__module__", None) or ""
    if module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{getattr(target, '__name__', repr(target))}"


def _comm_op(target) -> str | None:
    """The op name ('allgather_param', ...) if ``target`` is a ZeRO-3 comm op."""
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        namespace, _, name = target._schema.name.partition("::") if isinstance(
            target, torch._ops.OpOverload) else target._qualified_op_name.partition("::")
        if namespace in COMM_NAMESPACES and collectives.find(name) is not None:
            return name
    return None


def collective_of(node: torch.fx.Node) -> collectives.CollectiveKind | None:
    """The collective kind (its row of :mod:`dcsched.collectives`) ``node`` runs, or None."""
    name = _comm_op(node.target) if node.op == "call_function" else None
    return collectives.by_op(name) if name else None


def role_of_target(op: str, target) -> Role:
    if op == "placeholder":
        return Role.PLACEHOLDER
    if op == "output":
        return Role.OUTPUT
    name = _comm_op(target) if op == "call_function" else None
    return Role(collectives.by_op(name).role) if name else Role.COMPUTE


_ROLE_MEMO: dict = {}
collectives.on_change(_ROLE_MEMO.clear)  # a kind registered or taken out changes what its op's nodes do


def role_of(node: torch.fx.Node) -> Role:
    """What ``node`` does in a ZeRO-3 graph, read from its op (dcsched's or DeepSpeed's ``dc`` ops alike).

    Parameters
    ----------
    node : torch.fx.Node

    Returns
    -------
    Role
        ``PLACEHOLDER``, ``OUTPUT``, ``ALLGATHER``, ``WAIT``, ``RELEASE``,
        ``REDUCE`` or ``COMPUTE`` (everything else).

    Examples
    --------
    >>> import torch, torch.fx
    >>> from dcsched.runtime import ops
    >>> g = torch.fx.Graph()
    >>> w = g.placeholder("w")
    >>> role_of(w), role_of(g.call_function(ops.allgather_param, (w, 0, 0)))
    (<Role.PLACEHOLDER: 'placeholder'>, <Role.ALLGATHER: 'allgather'>)
    """
    # Memoised by (op, target): views of 10^5-node graphs ask this several times per node.
    key = (node.op, node.target)
    try:
        return _ROLE_MEMO[key]
    except KeyError:
        role = _ROLE_MEMO[key] = role_of_target(node.op, node.target)
        return role
    except TypeError:  # an unhashable target
        return role_of_target(node.op, node.target)


def ds_id_of(node: torch.fx.Node) -> int | None:
    """The parameter id of a comm node (its ``id`` argument), else None."""
    return comm_ids(node)[1] if role_of(node) in COMM_ROLES else None


def comm_ids(node: torch.fx.Node) -> tuple[int, int]:
    """``(graph_id, ds_id)`` of a node known to be a comm node (its ``graph_id`` and ``id`` arguments)."""
    args = node.args
    return (int(args[1]) if len(args) > 1 else int(node.kwargs["graph_id"]),
            int(args[2]) if len(args) > 2 else int(node.kwargs["id"]))


def n_users_of(node: torch.fx.Node) -> int | None:
    """``n_users`` of a release: the parameter's buffer is freed at that many releases."""
    if role_of(node) is Role.RELEASE:
        return int(node.args[3]) if len(node.args) > 3 else int(node.kwargs["n_users"])
    return None


def is_aliasing(node: torch.fx.Node) -> bool:
    """Whether the node's output aliases an input, as DeepSpeed's ``get_last_uses`` sees it.

    ``wait_allgather`` and every op whose schema returns a Tensor with an alias
    annotation (views, in-place ops) alias; an op with no schema counts as
    aliasing. ``release_param`` and ``operator.getitem`` do not.
    """
    if node.op != "call_function":
        return False
    role = role_of(node)
    if role in _VIEW_ROLES:
        return role in _ALIASING_ROLES
    if node.target is operator.getitem:
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    for ret in schema.returns:
        if ret.alias_info is not None and isinstance(ret.type, torch.TensorType):
            return True
    return False


#: Ops that return a view although their schema declares no alias (``_unsafe_view``
#: is ``view`` hidden from autograd: AOT graphs reshape matmul results with it).
_UNANNOTATED_VIEWS = frozenset({torch.ops.aten._unsafe_view.default})


#: Arguments that, at 0 (or False for ``train``), make a seeded op draw no random numbers: SDPA's
#: ``dropout_p`` (the attention kernels are tagged random whether or not they drop), the RNN ops'
#: ``dropout``, dropout's ``train``.
_NO_DRAW_WHEN = {"dropout_p": 0, "dropout": 0, "train": False}


def is_random(node: torch.fx.Node) -> bool:
    """Whether the node draws from the device's global random generator when it runs.

    An aten op whose schema is tagged ``torch.Tag.nondeterministic_seeded``
    (``native_dropout``, ``rand``, ``rand_like``, ``randn``, ``bernoulli``,
    ``randint``, ``uniform_``, ...), unless its arguments say it draws
    nothing: an attention op with ``dropout_p=0``, a dropout with
    ``train=False``. Each such op takes the next numbers of one stream, so
    two of them swapped draw each other's numbers (:mod:`dcsched.graph.nxview`
    keeps them in order).

    >>> import torch.fx
    >>> g = torch.fx.Graph()
    >>> x = g.placeholder("x")
    >>> drop = g.call_function(torch.ops.aten.native_dropout.default, (x, 0.1, True))
    >>> off = g.call_function(torch.ops.aten.native_dropout.default, (x, 0.1, False))
    >>> [is_random(n) for n in (x, drop, off, g.call_function(torch.ops.aten.relu.default, (x,)))]
    [False, True, False, False]
    """
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded not in target.tags:
        return False
    for position, argument in enumerate(target._schema.arguments):
        if argument.name not in _NO_DRAW_WHEN:
            continue
        if position < len(node.args) and not argument.kwarg_only:
            value = node.args[position]
        else:
            value = node.kwargs.get(argument.name, argument.default_value)
        if isinstance(value, (bool, int, float)) and value == _NO_DRAW_WHEN[argument.name]:
            return False
    return True


def is_view_like(node: torch.fx.Node) -> bool:
    """Nodes that allocate nothing and keep their source alive (for the simulator).

    Views and in-place ops (aten ops whose schema returns an alias),
    ``operator.getitem``, wait and release.
    """
    if node.op != "call_function":
        return False
    if node.target is operator.getitem or role_of(node) in _VIEW_ROLES:
        return True
    if node.target in _UNANNOTATED_VIEWS:
        return True
    schema = getattr(node.target, "_schema", None)
    return schema is not None and any(ret.alias_info is not None for ret in schema.returns)

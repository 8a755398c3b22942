"""Test oracles: deliberately simple, literal statements of the scheduling rules.

Each function restates one algorithm as DeepSpeed 0.19.8 behaves with no
memory budget (``list``: the rule of ``docs/schedulers.md``), recomputing
everything every round with plain sets and lists. They are slow (quadratic or
worse) and exist only so that tests can check the fast, incremental
schedulers against them, on graphs of any size. They are not registered.

Where dcsched deliberately differs from DeepSpeed (kwargs are dependencies;
no recursion limit; an all-gather nobody reads is its own last use) the
oracles follow dcsched.

>>> from dcsched.synthetic import random_graph
>>> from dcsched.graph.nxview import to_networkx
>>> from scheduling import scheduled
>>> view = to_networkx(random_graph(1))
>>> fast_free_oracle(view) == scheduled("fast-free", view)
True
"""

from __future__ import annotations

import networkx as nx

from dcsched.graph.form import GraphForm
from dcsched.graph.lastuse import last_use_indices


def last_uses(view: nx.DiGraph) -> dict[str, str]:
    """``{value: its last use}`` for every node of the networkx view that has a reader (DeepSpeed's
    ``get_last_uses`` on the view, by :func:`dcsched.graph.lastuse.last_use_indices`)."""
    form = GraphForm(view)
    last_use, _ = last_use_indices(form.preds, form.aliasing)
    return {form.names[i]: form.names[u] for i, u in enumerate(last_use) if u is not None}


def last_uses_by_user(view: nx.DiGraph) -> dict[str, list[str]]:
    """``{user: the values whose last use it is}``, in DeepSpeed's order (users with none omitted)."""
    form = GraphForm(view)
    _, by_user = last_use_indices(form.preds, form.aliasing)
    return {form.names[u]: [form.names[v] for v in values] for u, values in sorted(by_user.items()) if values}


def _input_order(view: nx.DiGraph) -> list[str]:
    return sorted(view.nodes, key=lambda name: view.nodes[name]["position"])


def _role(view, name) -> str:
    return view.nodes[name]["role"]


def _cost(view, name, key):
    value = view.nodes[name].get(key)
    return 0 if value is None else value


def requirements(pred: dict, target: str, scheduled: set, also_scheduled=()) -> list[str]:
    """Unscheduled ancestors of ``target`` and itself, depth-first post-order, inputs in reading order.

    ``pred`` maps each node to its inputs in reading order; nodes in
    ``scheduled`` or ``also_scheduled`` count as scheduled.
    """
    also = set(also_scheduled)
    seen: set = set()
    ordered: list[str] = []

    def skip(name):
        return name in scheduled or name in also or name in seen

    if skip(target):
        return ordered
    seen.add(target)
    stack = [(target, list(pred[target]))]
    while stack:
        node, inputs = stack[-1]
        while inputs:
            nxt = inputs.pop(0)
            if not skip(nxt):
                seen.add(nxt)
                stack.append((nxt, list(pred[nxt])))
                break
        else:
            stack.pop()
            ordered.append(node)
    return ordered


def fast_free_oracle(view: nx.DiGraph) -> list[str]:
    """DeepSpeed 0.19.8's ``fast_free_schedule`` (no budget), literally."""
    nodes = _input_order(view)
    pred = {n: list(view.pred[n]) for n in nodes}
    last_use = last_uses(view)
    is_ag = {n: _role(view, n) == "allgather" for n in nodes}

    scheduled = [n for n in nodes if _role(view, n) == "placeholder"]
    done = set(scheduled)
    pending_ags = [n for n in nodes if is_ag[n] and n not in done]
    releases: dict = {}
    for n in nodes:
        if _role(view, n) == "release":
            releases.setdefault(view.nodes[n]["ds_id"], []).append(n)

    def ags_in(names):
        return {n for n in names if is_ag[n]}

    ags_in_path = {ag: ags_in(requirements(pred, last_use.get(ag, ag), done)) for ag in pending_ags}
    reduce_nodes = [n for n in nodes if _role(view, n) == "reduce"]
    reduce_sets = {r: ags_in(requirements(pred, r, done)) for r in reduce_nodes}
    output = view.graph["output"]
    output_nodes = [p for p in view.pred[output] if _role(view, p) != "reduce"] if output else []
    output_sets = {o: ags_in(requirements(pred, o, done)) for o in output_nodes}

    def run(names):
        for n in names:
            scheduled.append(n)
            done.add(n)

    while pending_ags:
        counts = {ag: len(ags_in_path[ag]) for ag in pending_ags}
        fewest = min(counts.values())
        tasks = []
        for ag in [ag for ag in pending_ags if counts[ag] == fewest]:
            until_ag = requirements(pred, ag, done)
            last = last_use.get(ag, ag)
            diff = requirements(pred, last, done, until_ag)
            until_free = until_ag + diff
            for rel in releases.get(view.nodes[ag]["ds_id"], []):
                for dep in requirements(pred, rel, done, until_free):
                    if dep not in until_free:
                        until_free.append(dep)
            tasks.append({
                "ag": ag,
                "free_cost": sum(_cost(view, n, "device_time") for n in diff),
                "ag_acc": sum(_cost(view, n, "tensor_size") for n in until_ag if is_ag[n]),
                "free_acc": sum(_cost(view, n, "tensor_size") for n in diff if is_ag[n]),
                "n_ags": len([n for n in until_free if is_ag[n]]),
                "until_ag": until_ag,
                "until_free": until_free,
            })
        frees = [t for t in tasks if t["free_acc"] == 0]
        if frees:
            best = sorted(frees, key=lambda t: (t["n_ags"], t["ag_acc"], t["free_cost"], t["ag"]))[0]
            chosen_nodes = best["until_free"]
        else:
            best = sorted(tasks, key=lambda t: (t["free_acc"], t["n_ags"], t["ag_acc"], t["free_cost"],
                                                t["ag"]))[0]
            chosen_nodes = best["until_ag"]
        run(chosen_nodes)
        newly_gathered = [n for n in chosen_nodes if is_ag[n]]
        for ag in newly_gathered:
            if ag in pending_ags:
                pending_ags.remove(ag)
            ags_in_path.pop(ag, None)
            for others in ags_in_path.values():
                others.discard(ag)
        for sets, targets in ((reduce_sets, reduce_nodes), (output_sets, output_nodes)):
            ready = []
            for t in targets:
                sets[t] -= set(newly_gathered)
                if not sets[t]:
                    ready.append(t)
            for t in ready:
                run(requirements(pred, t, done))
    run([n for n in nodes if n not in done])
    return scheduled


def simple_prefetch_oracle(view: nx.DiGraph) -> list[str]:
    """DeepSpeed 0.19.8's ``simple_prefetch``, literally."""
    nodes = _input_order(view)
    is_ag = {n: _role(view, n) == "allgather" for n in nodes}
    pred = {n: list(view.pred[n]) for n in nodes}
    users = {n: list(view.succ[n]) for n in nodes}
    position = {n: view.nodes[n]["position"] for n in nodes}
    for n in nodes:
        users[n].sort(key=position.__getitem__)

    def sweep(scheduled: list, done: set, stack: list) -> None:
        # Run everything that becomes runnable without another all-gather (last found first).
        while stack:
            node = stack.pop()
            for user in users[node]:
                if not is_ag[user] and all(p in done for p in pred[user] if p != node):
                    stack.append(user)
            scheduled.append(node)
            done.add(node)

    def runnable(done: set) -> list:
        return [n for n in nodes if n not in done and all(p in done for p in pred[n])]

    committed = [n for n in nodes if not list(pred[n])]
    tentative = list(committed)
    tentative_done = set(tentative)
    sweep(tentative, tentative_done, [n for n in runnable(tentative_done) if not is_ag[n]])
    while len(tentative) < len(nodes):
        trials = []
        for ag in runnable(tentative_done):
            # Try the all-gather: what would the sweep run after it?
            first = [u for u in users[ag]
                     if not is_ag[u] and all(p in tentative_done for p in pred[u] if p != ag)]
            unblocked: list = []
            sweep(unblocked, _Overlay(tentative_done, {ag}), first)
            trials.append((ag, sum(_cost(view, n, "device_time") for n in unblocked), unblocked))
        best_ag, _, unblocked = sorted(trials, key=lambda t: t[1], reverse=True)[0]
        held = tentative[len(committed):]
        # dcsched: an all-gather that reads held work goes right after it (DeepSpeed's order would be invalid).
        split = max([k + 1 for k, n in enumerate(held) if n in set(pred[best_ag])], default=0)
        committed = committed + held[:split] + [best_ag] + held[split:]
        tentative = committed + unblocked
        tentative_done = set(tentative)
    return tentative


class _Overlay:
    """A set seen as ``base`` plus some additions, without copying ``base``."""

    def __init__(self, base: set, added: set):
        self.base, self.added = base, added

    def __contains__(self, item) -> bool:
        return item in self.added or item in self.base

    def add(self, item) -> None:
        self.added.add(item)


def list_oracle(view: nx.DiGraph) -> list[str]:
    """The ``list`` rule, literally: smallest memory delta among the runnable nodes, ties by input order."""
    nodes = _input_order(view)
    pred = {n: list(view.pred[n]) for n in nodes}
    done: set = set()
    order: list[str] = []
    gathered: dict = {}
    released: dict = {}

    def delta(n):
        role = _role(view, n)
        if role == "allgather":
            return _cost(view, n, "tensor_size")
        if role == "release":
            ds = view.nodes[n]["ds_id"]
            n_users = view.nodes[n]["n_users"] or 1
            if released.get(ds, 0) + 1 >= n_users:
                return -gathered.get(ds, 0)
        return 0

    while len(order) < len(nodes):
        ready = [n for n in nodes if n not in done and all(p in done for p in pred[n])]
        best = min(ready, key=lambda n: (delta(n), view.nodes[n]["position"]))
        role = _role(view, best)
        ds = view.nodes[best]["ds_id"]
        if role == "allgather":
            gathered[ds] = _cost(view, best, "tensor_size")
            released[ds] = 0
        elif role == "release":
            count = released.get(ds, 0) + 1
            if count >= (view.nodes[best]["n_users"] or 1):
                gathered.pop(ds, None)
                count = 0
            released[ds] = count
        order.append(best)
        done.add(best)
    return order


def simulate_oracle(compiled, idx: list[int]) -> dict:
    """The simulator's model as one literal loop over ``idx`` (node numbers) of a
    :class:`~dcsched.sim.simulate.CompiledGraph`: every clock and byte counter advanced node by node,
    last reads found by scanning. What :meth:`CompiledGraph.simulate_with_frees` must give."""
    from dcsched.graph.form import ALLGATHER, RELEASE, REDUCE

    kind, reads, ds_id, n_users = compiled.kind, compiled.reads, compiled.ds_id, compiled.n_users
    n = len(idx)
    last = [-1] * len(compiled.names)
    released, current, count = {}, {}, {}
    for pos, i in enumerate(idx):
        for r in reads[i]:
            last[r] = pos
        if kind[i] == ALLGATHER:
            current[ds_id[i]], count[ds_id[i]] = i, 0
        elif kind[i] == RELEASE and ds_id[i] in current:
            count[ds_id[i]] += 1
            if count[ds_id[i]] >= n_users[i]:
                released[current.pop(ds_id[i])] = pos
    free = [-1] * len(compiled.names)
    for r in compiled.owners:
        p = released.get(r, last[r])
        if compiled.part_of[r] >= 0:
            p = max(p, last[compiled.part_of[r]])
        if p < 0 and not compiled.is_input[r]:
            p = max(pos for pos, i in enumerate(idx) if i == r)
        free[r] = p
    free_all, free_gathered = [0] * n, [0] * n
    for r in compiled.owners:
        if free[r] >= 0:
            free_all[free[r]] += compiled.owned[r]
            if kind[r] == ALLGATHER:
                free_gathered[free[r]] += compiled.owned[r]
    mem, gmem, tc, tq = compiled.resident_bytes, 0, 0.0, 0.0
    out = {"memory": [], "gathered": [], "reach": [], "start": [], "end": []}
    done = {}
    for pos, i in enumerate(idx):
        if compiled.alloc[i]:
            mem += compiled.alloc[i]
            if kind[i] == ALLGATHER:
                gmem += compiled.alloc[i]
        out["memory"].append(mem)
        out["gathered"].append(gmem)
        out["reach"].append(tc)
        if kind[i] in (ALLGATHER, REDUCE):
            s = max(tc, tq)
            tq = done[i] = s + compiled.duration[i]
            out["start"].append(s)
            out["end"].append(tq)
        else:
            tc = max([tc] + [done[g] for g in compiled.gates[i]])
            out["start"].append(tc)
            tc += compiled.duration[i]
            out["end"].append(tc)
        if free_all[pos]:
            mem -= free_all[pos]
            gmem -= free_gathered[pos]
    out["step"] = max(tc, tq)
    out["free"] = free
    return out


def output_last_of(literal):
    """dcsched's statement of a rule over a literal oracle: the same order with the output node last.

    DeepSpeed's code may rank the output before a chain nothing reads (the
    generated code then returns before that chain runs); dcsched moves it to
    the end (``dcsched.graph.form.output_last``) and changes nothing else.
    """
    from dcsched.graph.form import output_last
    return lambda view: output_last(view, literal(view))

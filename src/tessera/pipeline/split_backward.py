"""A chunk's backward in two parts: the input gradient (I) now, the weight gradients (W) later.

Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024): the previous stage waits only for
the gradient of this stage's input, so a schedule runs that part (I) first and the weight
gradients (W), which nobody waits for, later, in what would be a bubble.

How the autograd graph of one (chunk, micro-batch) is cut. Walking the graph from the output:

- the *input path* is every node on a path to the stage input's gradient accumulator;
- each parameter's gradient flows from the input path into a *branch* of nodes that leads only
  to parameters (a linear's weight: the matrix product's node on the input path, then the
  transpose to the weight). The input-path nodes where a parameter's branches start are its
  *entries*; parameters that share an entry are one group.

``backward_input`` (I) runs ``torch.autograd.grad`` of the output with respect to the stage
input alone (``retain_graph=True``): the engine runs the input path and skips every branch
(a matrix product's node computes the input's gradient, not the weight's), so no parameter's
gradient accumulator runs and no gradient hook fires. Prehooks on the entries record the
gradient arriving at each. ``backward_weight`` (W) then runs, per group,
``torch.autograd.backward`` from the entries with the recorded gradients and the group's
parameters as ``inputs``: only the entries and the branches run, and the parameters'
accumulators run as in a plain backward, so ``.grad`` accumulates in place and the
post-accumulate-grad hooks of data parallelism and ZeRO fire there, at W. A group with several
entries where one lies below another on the input path would see the lower one's gradient
twice (recorded, and again through the upper one): W replaces what reaches an entry with what
it recorded.

One autograd call per group costs a graph walk and Python work each (W about three times its
arithmetic on CPU), so W runs consecutive groups in one call where that call runs the same
nodes: groups of one entry each, no entry of one below an entry of another on the input path
(q, k and v reading one normed input; the MLP's two input projections). From an entry, the
call runs only what leads to its ``inputs``; an entry below another would draw the input path
between them in, and its gradient twice. Which entries lie below which is one pass over the
input path after I, in the nodes' order of creation (``_entries_below``).

Memory between I and W. The tensors autograd saves in the chunk's forward are packed into
holders (``SavedActivations``, installed around the forward). Each unpack in I records which
node read the holder; after I the holders read only by input-path nodes that W does not run
are emptied. What W still holds: the tensors saved by the entries and the branches (a linear's
input, a norm's normalized input, the weights themselves), the recorded gradients at the
entries (one per weight group: a linear's output gradient) and what nodes that split their own
backward made for W (below: sequence parallelism's gathered inputs). The stage output, its
gradient and the stage input's gradient (sent at I) are not kept.

A chunk whose input needs no gradient (chunk 0: token ids) has no input path: its I does
nothing and its W is the whole backward from the output (so W keeps the output and its
gradient, and issues a plain backward's collectives, once).

Nodes that split their own backward. A custom autograd Function is one node: one that
computes an input's gradient and weights' gradients together is both on the input path and the
weights' entry, so I would run its whole backward (the engine dropping the weights' gradients)
and W all of it again (dropping the input's). Sequence parallelism's gather-then-linears node
and the chunked loss's head (``parallel.sequence_parallel``, ``parallel.chunked_loss``) take
part instead: their forward sets ``ctx.split_phase = None`` and ``ctx.split_kept = None``.
Around its autograd call, I sets ``split_phase`` to ``INPUT`` on the entries that have one,
and W to ``WEIGHT`` on its batch's (None again after each call; a plain backward sees None
and runs whole). At ``INPUT`` the node returns only its inputs' gradients (None for the
weights) and may leave in ``split_kept`` a tuple of tensors that W's weight gradients need in
place of its saved tensors; at ``WEIGHT`` it returns only the weights' gradients (None for the
inputs), from ``split_kept`` when set (emptying it) or from its saved tensors. The holders
read in I only by nodes that kept a tuple are emptied after I like the input path's; the
tuples' tensors (``PendingWeightGrad.made``) are held until W instead. Gather-then-linears
keeps its gathered input, so its W issues no collective and repeats no input-gradient
product; the chunked head keeps nothing and W computes its logits once more (its module doc).

Recomputation (``torch.utils.checkpoint``, non-reentrant): the tensors a checkpointed region
saves are packed by checkpoint's own hooks, not these. I recomputes the region's forward (as a
plain backward does) and checkpoint drops each recomputed tensor once it is read; W reads a
linear's input again, so the region is recomputed once more in W (all of W's autograd calls
run in one ``GraphExecGroup``, so once, not once per call; what W does not read of that
recomputation lives until the chunk's W ends). Keeping the first recomputation until W would
hold what recomputation exists to drop, for the whole gap between I and W. The replay issues
the region's forward collectives again (under sequence parallelism, the entering all-gathers
and leaving reduce-scatters up to the last tensor W reads), as the replay in I does. Selective
recomputation (the attention core) has no weights inside the region: W does not enter it, so
it runs once, in I.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.utils.checkpoint import GraphExecGroup

INPUT, WEIGHT = "input", "weight"
"""Values of a splitting node's ``split_phase`` during I and W (module doc)."""


class _Holder:
    """One saved tensor, owned here so that it can be dropped before the graph dies."""

    __slots__ = ("readers", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor
        self.readers: list[Node] = []


class SavedActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved-tensor hooks for one (chunk, micro-batch)'s forward: each saved tensor goes in a
    holder; each unpack records the node that reads it (see the module doc). `on_pack` sees
    every saved tensor (the runtime's byte counter)."""

    def __init__(self, on_pack: Callable[[torch.Tensor], object] | None = None):
        self.holders: list[_Holder] = []

        def pack(t: torch.Tensor) -> _Holder:
            if on_pack is not None:
                on_pack(t)
            holder = _Holder(t)
            self.holders.append(holder)
            return holder

        def unpack(holder: _Holder) -> torch.Tensor:
            if holder.tensor is None:
                raise RuntimeError("split backward: a saved tensor dropped after the input "
                                   "gradient was read again")
            node = torch._C._current_autograd_node()
            if node is not None:
                holder.readers.append(node)
            return holder.tensor

        super().__init__(pack, unpack)

    def drop_unneeded(self, needed: set[Node]) -> list[torch.Tensor]:
        """Empty the holders that no node in `needed` read; return the tensors kept."""
        kept = []
        for h in self.holders:
            if h.tensor is None:
                continue
            if h.readers and not any(r in needed for r in h.readers):
                h.tensor = None
            else:
                kept.append(h.tensor)
            h.readers = []
        return kept

    def release(self) -> None:
        """Drop every holder's tensor and the nodes it names (a holder naming a node of the
        graph that holds it is a cycle through C++ that Python's collector does not see)."""
        for h in self.holders:
            h.tensor, h.readers = None, []
        self.holders = []


@dataclass(eq=False)
class _Group:
    params: list[torch.Tensor]
    entries: list[Node]
    grads: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class PendingWeightGrad:
    """What I keeps for W (see the module doc)."""

    groups: list[_Group] = field(default_factory=list)
    batches: list[list[_Group]] = field(default_factory=list)
    """The groups in W's autograd calls, one list per call, in a plain backward's order."""
    whole: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """(output, its gradient) when W is the whole backward (no input path)."""
    kept: list[torch.Tensor] = field(default_factory=list)
    """The saved tensors W still needs (those packed by SavedActivations)."""
    made: list[torch.Tensor] = field(default_factory=list)
    """Tensors that splitting nodes made in I for W (``split_kept``; module doc)."""
    saved: SavedActivations | None = None
    """Released after W."""


def _grad_node(t: torch.Tensor) -> Node | None:
    """The node a gradient for `t` enters: its grad_fn, or its accumulator (a leaf)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """node -> the nodes whose next_functions hold it (the graph's edges reversed)."""
    parents: dict[Node, list[Node]] = {root: []}
    queue = deque([root])
    while queue:
        node = queue.popleft()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                queue.append(child)
            parents[child].append(node)
    return parents


def _upward(starts: Sequence[Node], parents: dict[Node, list[Node]],
            stop: set[Node] | frozenset = frozenset()) -> tuple[set[Node], set[Node]]:
    """Nodes reachable from `starts` towards the output, not passing through `stop`; and the
    `stop` nodes met."""
    seen, met = set(starts), set()
    queue = deque(starts)
    while queue:
        for parent in parents[queue.popleft()]:
            if parent in stop:
                met.add(parent)
            elif parent not in seen:
                seen.add(parent)
                queue.append(parent)
    return seen, met


def _downward(starts: Sequence[Node]) -> set[Node]:
    seen = set(starts)
    queue = deque(starts)
    while queue:
        for child, _ in queue.popleft().next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                queue.append(child)
    return seen


def _weight_groups(parents: dict[Node, list[Node]], input_node: Node
                   ) -> tuple[list[_Group], set[Node], set[Node]]:
    """The parameter groups and their entries (module doc), the nodes W runs, and the input
    path (without the input's own node)."""
    input_path, _ = _upward([input_node], parents)
    input_path.discard(input_node)
    group_of: dict[Node, _Group] = {}  # entry -> its group
    groups: list[_Group] = []
    needed: set[Node] = set()
    for node in parents:
        param = getattr(node, "variable", None)
        if node is input_node or param is None:
            continue
        branch, entries = _upward([node], parents, stop=input_path)
        needed |= branch | entries
        merged = {id(group_of[e]): group_of[e] for e in entries if e in group_of}
        group = _Group([param], list(entries))
        for other in merged.values():
            group.params += other.params
            group.entries += [e for e in other.entries if e not in group.entries]
            groups.remove(other)
        groups.append(group)
        for e in group.entries:
            group_of[e] = group
    for group in groups:
        if len(group.entries) > 1:  # the input path between its entries runs in W too
            accumulators = [_grad_node(p) for p in group.params]
            above, _ = _upward(accumulators, parents)
            needed |= above & _downward(group.entries)
    return groups, needed, input_path


def _entries_below(input_path: set[Node], bit: dict[Node, int]) -> dict[Node, int] | None:
    """input-path node -> the bits (`bit`: entry -> its bit) of the entries below it on the
    input path, OR-ed. One pass in order of creation (a node's inputs were made before it, so
    before their consumers); None if some input-path edge breaks that order (then no order
    is assumed: W runs each group alone)."""
    below: dict[Node, int] = {}
    for node in sorted(input_path, key=lambda n: n._sequence_nr()):
        mask = 0
        for child, _ in node.next_functions:
            if child in input_path:
                if child not in below:
                    return None
                mask |= below[child] | bit.get(child, 0)
        below[node] = mask
    return below


def _batched(order: list[_Group], input_path: set[Node]) -> list[list[_Group]]:
    """`order`'s groups in runs that one autograd call each can run (module doc): consecutive
    groups of one entry, none below another."""
    single = [g for g in order if len(g.entries) == 1]
    bit = {g.entries[0]: 1 << i for i, g in enumerate(single)}
    below = _entries_below(input_path, bit) if len(single) > 1 else {}
    if below is None:
        return [[g] for g in order]
    batches: list[list[_Group]] = []
    members = under = 0  # the current batch's entry bits, and those below its entries
    for group in order:
        entry = group.entries[0]
        joins = (len(group.entries) == 1 and batches and members
                 and not (under & bit[entry]) and not (below[entry] & members))
        if joins:
            batches[-1].append(group)
            members |= bit[entry]
            under |= below[entry]
        else:
            batches.append([group])
            single_entry = len(group.entries) == 1
            members = bit[entry] if single_entry else 0
            under = below.get(entry, 0) if single_entry else 0
    return batches


def backward_input(output: torch.Tensor, grad: torch.Tensor | None,
                   stage_input: torch.Tensor | None,
                   saved: SavedActivations | None = None
                   ) -> tuple[torch.Tensor | None, PendingWeightGrad]:
    """I: the gradient of `stage_input` (None when it needs none), and what W needs. `grad`:
    the output's gradient (None for a scalar loss)."""
    input_node = _grad_node(stage_input) if stage_input is not None else None
    root = output.grad_fn
    parents = _consumers(root) if root is not None else {}
    if input_node is None or input_node not in parents:
        kept = [h.tensor for h in saved.holders] if saved is not None else []
        return None, PendingWeightGrad(whole=(output, grad), kept=kept, saved=saved)
    groups, needed, input_path = _weight_groups(parents, input_node)
    order: list[_Group] = []  # groups by when their first entry ran (a plain backward's order);
    # a group whose entries I did not reach never enters it
    handles = []
    for group in groups:
        for entry in group.entries:
            def record(grads, group=group, entry=entry):
                if not group.grads:
                    order.append(group)
                group.grads[entry] = tuple(grads)
            handles.append(entry.register_prehook(record))
    splitting = _splitting(e for g in groups for e in g.entries)
    try:
        with _phase(splitting, INPUT):
            (dx,) = torch.autograd.grad(output, stage_input, grad, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    own = [e for e in splitting if e.split_kept is not None]  # W reads no saved tensor there
    made = [t for e in own for t in e.split_kept]
    kept = saved.drop_unneeded(needed - set(own)) if saved is not None else []
    return dx, PendingWeightGrad(groups=order, batches=_batched(order, input_path),
                                 kept=kept, made=made, saved=saved)


def _splitting(nodes: Iterable[Node]) -> list[Node]:
    """The nodes among `nodes` that split their own backward (module doc)."""
    return [n for n in nodes if hasattr(n, "split_phase")]


class _phase:
    """Sets the splitting nodes' ``split_phase`` for one autograd call, None after it."""

    def __init__(self, nodes: list[Node], phase: str):
        self.nodes, self.phase = nodes, phase

    def __enter__(self) -> None:
        for n in self.nodes:
            n.split_phase = self.phase

    def __exit__(self, *exc) -> None:
        for n in self.nodes:
            n.split_phase = None


def backward_weight(pending: PendingWeightGrad) -> None:
    """W: accumulate the parameters' gradients into ``.grad`` (their hooks fire here)."""
    if pending.whole is not None:
        output, grad = pending.whole
        pending.whole = None
        torch.autograd.backward(output, grad)
    else:
        with GraphExecGroup():  # one recomputation of a checkpointed region for all groups
            for batch in pending.batches:
                _batch_backward(batch)
    if pending.saved is not None:
        pending.saved.release()
    for group in pending.groups:  # a node that I ran and W did not (no gradient recorded)
        for entry in _splitting(group.entries):
            entry.split_kept = None
    pending.groups, pending.batches, pending.kept, pending.saved = [], [], [], None
    pending.made = []


def _batch_backward(batch: list[_Group]) -> None:
    """The weight gradients of a batch's groups, from their entries with the gradients I
    recorded there, in one autograd call."""
    edges, grads, params = [], [], []
    for group in batch:
        params += group.params
        for entry, recorded in group.grads.items():
            for i, g in enumerate(recorded):
                if g is not None:
                    edges.append(GradientEdge(entry, i))
                    grads.append(g)
    handles = []
    if len(batch[0].entries) > 1:  # alone in its batch: what reaches an entry is what it
        # recorded, nothing more
        handles = [entry.register_prehook(lambda _g, rec=rec: rec)
                   for entry, rec in batch[0].grads.items()]
    try:
        with _phase(_splitting(e for group in batch for e in group.grads), WEIGHT):
            torch.autograd.backward(edges, grads, inputs=params, retain_graph=True)
    finally:
        for h in handles:
            h.remove()

"""ZB-H1's split backward on a stage's autograd graph (zero-bubble, Qi et al., §2: a backward is
an input pass ``B``, the gradient w.r.t. the stage's input that the previous stage waits for,
and a weight pass ``W``, the parameters' gradients, which can run later).

`backward_input` runs only the input pass: ``torch.autograd.grad`` from the stage output to
the received activations, keeping the graph. While it runs, the gradient arriving at each
*boundary node* is recorded: a node of the input path (between the stage's inputs and its
output) through which some parameter's gradient flows, found by walking back from each
parameter's gradient accumulator until the walk meets the input path. `backward_weight` later
starts at those boundaries with the recorded gradients and runs only toward the parameters:
the input-gradient chain is not computed twice. Parameters that share boundaries form one
group, run by one ``torch.autograd.grad`` call whose inputs are that group's parameters only,
so the engine does not re-enter other groups' paths. A parameter used at two places of the
stage (a shared layer) has two boundaries, one above the other: the engine then also runs the
nodes between them, and the lower boundary is handed its recorded gradient instead of the
re-derived one, so it is counted once (correct, at the price of that stretch of the input
chain run again; loom's stages share no layer unless an LLM of one stage ties its embeddings).

Under ZeRO 2/3 (FSDP2, `loom.runtime.zero`) FSDP's hooks sit on the input path: they fire in
the input pass, when no weight gradient exists yet, and not at all in the weight pass. So every
pass runs with FSDP told to neither reduce nor reshard (`fsdp_defer`: the parameters stay
gathered, their gradients accumulate unsharded), and after the stage's last weight pass
`fsdp_reduce` runs FSDP's post-backward by hand: reduce-scatter, reshard, end of backward.

This is how ``torch.distributed.pipelining``'s ``stage_backward_input`` /
``stage_backward_weight`` split a stage, written for loom's stages: the stage output is one
tensor (or the loss), inputs are the received activations, parameters may be DTensors (tensor
parallelism: the nodes are the DTensor graph's); the weight gradients are accumulated into
``.grad`` as a whole backward would.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, Node
from torch.distributed.fsdp import FSDPModule, fully_shard


def _node_of(t: torch.Tensor) -> Node | None:
    """The node a gradient w.r.t. ``t`` flows into: its ``grad_fn``, or for a leaf its gradient
    accumulator (created on demand, hence the view)."""
    if t.grad_fn is not None:
        return t.grad_fn
    if not t.requires_grad:
        return None
    return t.view_as(t).grad_fn.next_functions[0][0]


def _consumers(root: Node) -> dict[Node, list[Node]]:
    """The graph below ``root`` reversed: node -> the nodes whose backward feeds it."""
    consumers: dict[Node, list[Node]] = {root: []}
    todo = deque([root])
    while todo:
        node = todo.popleft()
        for nxt, _ in node.next_functions:
            if nxt is None:
                continue
            if nxt not in consumers:
                consumers[nxt] = []
                todo.append(nxt)
            consumers[nxt].append(node)
    return consumers


def _reach(starts: list[Node], consumers: dict[Node, list[Node]], stop: set[Node]) -> tuple[set[Node], set[Node]]:
    """Walk from ``starts`` toward the output; returns (visited, the ``stop`` nodes met)."""
    seen: set[Node] = set()
    met: set[Node] = set()
    todo = deque(n for n in starts if n in consumers)
    seen.update(todo)
    while todo:
        for up in consumers[todo.popleft()]:
            if up in stop:
                met.add(up)
            elif up not in seen:
                seen.add(up)
                todo.append(up)
    return seen, met


@dataclass(eq=False)  # groups are told apart by identity (their fields hold tensors)
class _Group:
    params: list[torch.Tensor]
    boundaries: list[Node]
    grads: dict[Node, tuple] = field(default_factory=dict)  # boundary -> its recorded grad_outputs


@dataclass
class WeightPass:
    """What the input pass leaves for the weight pass: per parameter group, the boundary
    nodes and the gradients recorded at them (the graph below them is kept alive by them)."""

    groups: list[_Group]


def backward_input(output: torch.Tensor, grad: torch.Tensor | None, inputs: list[torch.Tensor]) -> WeightPass:
    """The input pass: each of ``inputs`` gets ``.grad`` = d(output . grad)/d(input) (``grad``
    ``None``: ``output`` is the scalar loss), nothing is accumulated into the parameters;
    returns what `backward_weight` needs. The graph is kept for it.

    The parameters are the graph's other leaves that require grad (what one whole backward
    would accumulate into), read from the graph itself: under FSDP the tensors the forward used
    are its gathered parameters, not the ones the module holds between passes."""
    root = output.grad_fn
    if root is None:
        return WeightPass([])
    wanted = [t for t in inputs if t.requires_grad]
    consumers = _consumers(root)
    input_nodes = {n for n in map(_node_of, wanted) if n is not None}
    input_path, _ = _reach(list(input_nodes), consumers, set())
    input_path.add(root)  # a parameter whose path meets no input (none used) starts at the output
    # parameters -> their boundary nodes; parameters sharing a boundary are one group
    owner: dict[Node, _Group] = {}
    groups: list[_Group] = []
    for acc in consumers:
        p = getattr(acc, "variable", None)  # a gradient accumulator's leaf
        if p is None or acc in input_nodes or not p.requires_grad:
            continue
        _, met = _reach([acc], consumers, input_path)
        group = _Group([p], list(met))
        for other in {id(owner[b]): owner[b] for b in met if b in owner}.values():
            group.params += other.params
            group.boundaries += [b for b in other.boundaries if b not in group.boundaries]
            groups.remove(other)
        groups.append(group)
        for b in group.boundaries:
            owner[b] = group
    # the output's own gradient is known: the boundaries below it record theirs as the pass runs
    at_root = tuple(None for _ in range(output.output_nr)) + (grad if grad is not None else torch.ones_like(output),)
    handles = []
    for g in groups:
        for b in g.boundaries:
            if b is root:
                g.grads[b] = at_root
            else:
                handles.append(b.register_prehook(_recorder(g, b)))
    try:
        if wanted:
            grads = torch.autograd.grad(output, wanted, grad, retain_graph=True, allow_unused=True)
            for t, g_in in zip(wanted, grads):
                if g_in is not None:
                    t.grad = g_in if t.grad is None else t.grad + g_in
    finally:
        for h in handles:
            h.remove()
    return WeightPass(groups)


def _recorder(group: _Group, node: Node):
    def hook(grad_outputs: tuple) -> None:
        group.grads[node] = grad_outputs
    return hook


def backward_weight(wp: WeightPass) -> None:
    """The weight pass: accumulate every parameter's gradient from the recorded boundary
    gradients, then release the graph (the last reference to it is the pass's)."""
    for g in wp.groups:
        edges, seeds = [], []
        for b in g.boundaries:
            for i, x in enumerate(g.grads.get(b, ())):
                if x is not None:
                    edges.append(GradientEdge(b, i))
                    seeds.append(x)
        if not edges:
            continue
        handles = []
        if len(g.boundaries) > 1:  # a boundary reached from another one gets its recorded gradient
            handles = [b.register_prehook(lambda _, saved=g.grads.get(b): saved) for b in g.boundaries
                       if g.grads.get(b) is not None]
        try:
            # the graph is kept: a parameter used twice (a shared layer) runs the nodes between
            # its uses, which another group may need; it is freed with the WeightPass
            grads = torch.autograd.grad(edges, g.params, seeds, allow_unused=True, retain_graph=True)
        finally:
            for h in handles:
                h.remove()
        for p, dp in zip(g.params, grads):
            if dp is not None:
                p.grad = dp if p.grad is None else p.grad + dp
    wp.groups = []


def fsdp_defer(modules: list[FSDPModule]) -> None:
    """Before an input or weight pass: FSDP neither reduces nor reshards (module docstring)."""
    for m in modules:
        m.set_requires_gradient_sync(False, recurse=False)
        m.set_is_last_backward(False)
        m.set_reshard_after_backward(False, recurse=False)


def fsdp_reduce(modules: list[FSDPModule]) -> None:
    """After the stage's last weight pass: FSDP's post-backward by hand, as its hooks would run
    it at the end of the last backward: reduce-scatter the accumulated gradients into the
    shards, reshard the parameters, finish the iteration's backward."""
    for m in modules:
        m.set_requires_gradient_sync(True, recurse=False)
        m.set_is_last_backward(True)
        m.set_reshard_after_backward(True, recurse=False)
    for m in modules:
        state = fully_shard.state(m)
        for group in state._fsdp_param_groups:
            group.post_backward()
    for m in modules:  # each layer is its own FSDP root (`loom.runtime.zero.shard_stage`)
        fully_shard.state(m)._root_post_backward_final_callback()

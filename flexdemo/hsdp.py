"""HSDP wiring: the 2-D (replicate, shard) device mesh and FSDP2 applied block by block.

`parallelize` takes models it did not write: it finds the repeated blocks (a ModuleList,
ModuleDict or Sequential of same-class layers anywhere in the model) or takes the user's list or
predicate, keeps tied parameters in the root's group and refuses, before touching the model, what
FSDP2 cannot shard.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

MESH_DIMS = ("replicate", "shard")


def build_mesh(nodes: int, per_node: int, device_type: str = "cpu",
               backend: str | None = None) -> DeviceMesh:
    """Build the (replicate=nodes, shard=per_node) mesh from groups made with ``backend``.

    Every rank creates every group in the same order, as ``dist.new_group`` requires.
    """
    if not (isinstance(nodes, int) and nodes >= 1):
        raise ValueError(f"nodes={nodes!r} must be an integer >= 1.")
    if not (isinstance(per_node, int) and per_node >= 1):
        raise ValueError(f"per_node={per_node!r} must be an integer >= 1.")
    world = dist.get_world_size()
    if world != nodes * per_node:
        raise ValueError(f"nodes*per_node={nodes * per_node} must equal the world size {world}.")
    rank = dist.get_rank()
    layout = torch.arange(world).view(nodes, per_node)
    replicate_group = shard_group = None
    # Replicate groups: one rank per node with the same local index (columns of the layout).
    for j in range(per_node):
        group = dist.new_group(layout[:, j].tolist(), backend=backend)
        if rank % per_node == j:
            replicate_group = group
    for n in range(nodes):
        group = dist.new_group(layout[n].tolist(), backend=backend)
        if rank // per_node == n:
            shard_group = group
    return DeviceMesh.from_group([replicate_group, shard_group], device_type, mesh=layout,
                                 mesh_dim_names=MESH_DIMS)


BlockSpec = Iterable[nn.Module] | Callable[[str, nn.Module], bool] | None
"""Which submodules get their own FSDP2 group: found (None), listed, or picked by a predicate."""


def find_blocks(model: nn.Module, blocks: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The (name, module) pairs ``parallelize`` shards one by one, inner before outer.

    ``blocks=None`` looks for repeated blocks anywhere in the model: the children of a
    ``ModuleList``, ``ModuleDict`` or ``Sequential`` that holds two or more parameterized children
    of one class (a transformer's layers, a ResNet stage). Everything else, tied embeddings
    included, stays in the root's group. A list of modules or a ``predicate(name, module)`` picks
    the blocks instead, as torchtitan's model files do. Raises ValueError, naming the module and
    the reason, on anything FSDP2 cannot shard; the model is only read.
    """
    _check_root(model)
    owners = _param_owners(model)
    if blocks is None:
        # Automatic: a block that shares a parameter with the rest of the model is left to the
        # root, so both uses of the parameter live in one FSDP group.
        found = [(n, m) for n, m in _repeated_blocks(model) if not _tied_outside(n, m, owners)]
    else:
        found = _given_blocks(model, blocks)
        for name, module in found:
            _refuse_ties(name, module, owners)
    return _inner_first(model, found)


def parallelize(model: nn.Module, mesh: DeviceMesh, inter_all_reduce: bool = True, *,
                blocks: BlockSpec = None) -> nn.Module:
    """Apply FSDP2 to each block (see ``find_blocks``), then to the root.

    ``inter_all_reduce=True`` is HSDP on the 2-D mesh: reduce-scatter inside the node, then
    all-reduce across nodes. ``inter_all_reduce=False`` (the FlexDeMo family, which replicates
    itself) shards over the mesh's "shard" dim only: each node is an independent FSDP2 group, so
    gradients arrive reduce-scattered and averaged inside the node and nothing crosses nodes.
    FSDP2's own switch, ``set_requires_all_reduce(False)``, is meant for gradient accumulation:
    it holds the reduce-scattered gradient back from ``.grad`` until a step with the all-reduce
    on, so the optimizer would never see it.

    The blocks are chosen and checked before the first ``fully_shard`` call, so a ValueError
    leaves the model as it was.
    """
    plan = find_blocks(model, blocks)
    target = mesh if inter_all_reduce else mesh[MESH_DIMS[1]]
    for _, block in plan:
        fully_shard(block, mesh=target)
    fully_shard(model, mesh=target)
    return model


def shard_layout(model: nn.Module, blocks: BlockSpec = None) -> list[list[list[int]]]:
    """The parameter shapes of each FSDP2 unit ``parallelize`` makes, blocks inner first, then root.

    They fix every sharded collective's size at any shard count (a replay re-shards with them).
    """
    return [[list(p.shape) for p in unit] for unit in _unit_parameters(model, blocks)]


def parameter_units(model: nn.Module, blocks: BlockSpec = None) -> list[int]:
    """The FSDP2 unit (its index in ``shard_layout``) of each of ``model.parameters()``."""
    unit_of = {id(p): u for u, unit in enumerate(_unit_parameters(model, blocks)) for p in unit}
    return [unit_of[id(p)] for p in model.parameters()]


def _unit_parameters(model: nn.Module, blocks: BlockSpec) -> list[list[nn.Parameter]]:
    """The parameters of each FSDP2 unit ``parallelize`` makes (units holding none left out)."""
    units: list[list[nn.Parameter]] = []
    taken: set[int] = set()
    # A parameter belongs to the innermost unit holding it: the blocks come inner first.
    for module in [block for _, block in find_blocks(model, blocks)] + [model]:
        params = [p for p in module.parameters() if id(p) not in taken]
        taken.update(id(p) for p in module.parameters())
        if params:
            units.append(params)
    return units


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of a parallelized model, inner first, the root last (as ``shard_layout``)."""
    units: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        if isinstance(module, FSDPModule):
            units.append(module)

    visit(model)
    return units


def watch_unit_backward(model: nn.Module, callback: Callable[[int], None]) -> list:
    """Call ``callback(unit)`` when each FSDP2 unit finishes its backward; returns the hook handles.

    ``unit`` indexes ``fsdp_units(model)``. Each forward hangs a gradient hook on the unit's
    inputs: once every input's gradient exists the unit's backward is done, and FSDP2 reduces
    its gradients next. Tensor hooks, not module backward hooks, so that a model may still
    change a block's output in place (torch forbids that around module backward hooks). A unit
    whose inputs need no gradient (the root, fed token ids) is reduced by FSDP2 in a callback at
    the end of the whole backward; its mark is a callback queued, from a hook on its output,
    ahead of FSDP2's (callbacks run in the order queued).
    """

    def hook_for(index: int) -> Callable:
        def forward_hook(_module: nn.Module, args: tuple, output: object) -> None:
            if not torch.is_grad_enabled():
                return  # evaluation: no backward to mark
            inputs = [a for a in _tensors(args) if a.requires_grad]
            if inputs:
                pending = [len(inputs)]

                def on_input_grad(_grad: torch.Tensor) -> None:
                    pending[0] -= 1
                    if pending[0] == 0:
                        callback(index)

                for tensor in inputs:
                    tensor.register_hook(on_input_grad)
                return
            outputs = [o for o in _tensors(output) if o.requires_grad]
            if outputs:
                engine = torch.autograd.Variable._execution_engine
                outputs[0].register_hook(lambda _g: engine.queue_callback(lambda: callback(index)))

        return forward_hook

    # Ahead of FSDP2's own post-forward hook, so that the root's output hook (and the mark it
    # queues) comes before the callback FSDP2 queues from its hook on the same output.
    return [unit.register_forward_hook(hook_for(i), prepend=True)
            for i, unit in enumerate(fsdp_units(model))]


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors in a forward's arguments or result (tuples, lists and dicts looked into)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _has_forward(module: nn.Module) -> bool:
    # FSDP2 hooks forward; it refuses ModuleList, ModuleDict and any container without one.
    return type(module).forward is not nn.Module.forward


def _check_root(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise ValueError(f"parallelize needs an nn.Module, got {type(model).__name__}.")
    if not _has_forward(model):
        raise ValueError(f"cannot shard a {type(model).__name__} as the model: it has no forward "
                         "for FSDP2 to hook; pass the module that runs it.")
    for name, module in model.named_modules():
        if isinstance(module, FSDPModule):
            where = f"its submodule {name!r}" if name else "it"
            raise ValueError(f"the model is already parallelized ({where} is an FSDP module); "
                             "build a fresh model and call parallelize once.")


def _child_name(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _inside(name: str, prefix: str) -> bool:
    """Whether module ``name`` is ``prefix`` or nested in it."""
    return name == prefix or name.startswith(prefix + ".")


def _repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of the outermost containers of two or more parameterized modules of one class."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():  # parents before children
        if not isinstance(module, _CONTAINERS) or any(_inside(name, n) for n, _ in found):
            continue
        kids = [(_child_name(name, k), c) for k, c in module.named_children() if _has_params(c)]
        if len(kids) >= 2 and len({type(c) for _, c in kids}) == 1:
            found.extend(kids)
    return found


def _given_blocks(model: nn.Module, blocks: BlockSpec) -> list[tuple[str, nn.Module]]:
    """The user's blocks by name, checked one by one."""
    chosen = _chosen_blocks(model, blocks)
    for name, module in chosen:
        _check_block(name, module)
    unique = {id(m): (n, m) for n, m in chosen}
    return [(n, m) for n, m in unique.values() if _has_params(m)]


def _chosen_blocks(model: nn.Module, blocks: BlockSpec) -> list[tuple[str, nn.Module]]:
    """(name, module) of every block `blocks` picks: a predicate, a container or a list."""
    if isinstance(blocks, nn.ModuleList | nn.ModuleDict):
        # blocks=model.layers means its children, whichever container holds them.
        blocks = list(blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks)
    if callable(blocks) and not isinstance(blocks, nn.Module):
        return [(n, m) for n, m in model.named_modules() if n and blocks(n, m)]
    if isinstance(blocks, Iterable) and not isinstance(blocks, str | nn.Module):
        return _named_blocks(model, blocks)
    raise ValueError("blocks must be a list of the model's submodules or a "
                     f"predicate(name, module) -> bool, got {type(blocks).__name__}.")


def _named_blocks(model: nn.Module, blocks: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
    """Each listed module with its name in the model; refuse one that is not in it."""
    names = {id(m): n for n, m in model.named_modules()}
    chosen = []
    for i, module in enumerate(blocks):
        if id(module) not in names:
            raise ValueError(f"blocks[{i}] ({type(module).__name__}) is not a submodule of "
                             "the model.")
        chosen.append((names[id(module)], module))
    return chosen


def _check_block(name: str, module: nn.Module) -> None:
    """Refuse a block FSDP2 cannot shard on its own: the model itself, or one without forward."""
    if not name:
        raise ValueError("blocks lists the model itself, which parallelize always shards "
                         "last; leave it out.")
    if not _has_forward(module):
        raise ValueError(f"cannot shard block {name!r}: a {type(module).__name__} has no "
                         "forward for FSDP2 to hook; list its children instead.")


def _param_owners(model: nn.Module) -> dict[int, list[str]]:
    """Every qualified name of every parameter, tied ones under all their names."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(name)
    return owners


def _tied_outside(name: str, block: nn.Module, owners: dict[int, list[str]]) -> str | None:
    """A name outside ``block`` under which one of its parameters is also used, if any."""
    for param in block.parameters():
        for other in owners[id(param)]:
            if not _inside(other, name):
                return other
    return None


def _refuse_ties(name: str, block: nn.Module, owners: dict[int, list[str]]) -> None:
    other = _tied_outside(name, block, owners)
    if other is not None:
        raise ValueError(f"cannot shard block {name!r} on its own: one of its parameters is tied "
                         f"to {other!r} outside it; leave it out of blocks so the tied "
                         "parameter stays in the root's group.")


def _inner_first(model: nn.Module,
                 found: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """Blocks in post-order: a nested block is sharded before the block that holds it."""
    order: dict[int, int] = {}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.setdefault(id(module), len(order))

    visit(model)
    return sorted(found, key=lambda item: order[id(item[1])])


def replicate_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The inter-node group (one rank per node) of ``mesh``."""
    return mesh.get_group(MESH_DIMS[0])


def shard_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """The intra-node group of ``mesh``."""
    return mesh.get_group(MESH_DIMS[1])

"""``prepare(model, optimizer, shard=...)``: sharded data parallel on torch's own engines.

* ``shard=None``: DDP (every rank holds and steps everything).
* ``shard="optimizer"``: DDP with a reduce-scatter gradient hook; each rank steps its share of
  every parameter and keeps only that share's optimizer state (:mod:`cpuddp.train.sharding.zero`).
* ``shard="full"``: FSDP2 (``torch.distributed.fsdp.fully_shard``): parameters, gradients and
  optimizer state sharded; each *block* is gathered for its forward and backward and freed
  after.  bf16 through ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)``.
  Across nodes it is HSDP: a 2-D ``DeviceMesh`` (replicate across nodes, shard within a node).

What is decided here, each a pure function tested alone: whether the model and the optimizer
can be sharded as they are (:func:`check_shardable`, and for ``shard="optimizer"``
:func:`check_elementwise`; the request itself is checked when
prepare's options are built: :mod:`cpuddp.train.strategies.options`), which modules are blocks (:func:`find_blocks`; default: the
repeated layers of a ``ModuleList`` -- transformer blocks -- and ``nn.TransformerEncoderLayer``/
``DecoderLayer``, then any remaining ``Linear``/``Embedding`` of at least :data:`LARGE` parameters;
``shard_blocks=`` names them instead), and the mesh (:func:`decide_mesh`).  What is done:
:func:`apply_full` (FSDP2 and the optimizer's rebinding).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from cpuddp.backends.types import backend_for
from cpuddp.errors import PrepareError, warn
from cpuddp.ranks import log0

from .zero import ELEMENTWISE, UNFUSED_WHY

__all__ = [
    "LARGE",
    "check_shardable",
    "find_blocks",
    "decide_mesh",
    "gather_seats",
    "shared_across_blocks",
    "apply_full",
    "check_elementwise",
    "running_allocator",
]

_log = logging.getLogger("cpuddp.prepare")

#: A Linear or Embedding with at least this many parameters is a block of its own (4 MiB of fp32).
LARGE = 1 << 20

BlockSpec = Union[None, type, str, Sequence[Union[type, str]], Callable[[str, nn.Module], bool]]


# --------------------------------------------------------------------------- blocks


def _repeated(parent: nn.Module, child: nn.Module) -> bool:
    """A layer of a stack: an item of a ModuleList whose items are all of one class, two or more."""
    if not isinstance(parent, nn.ModuleList) or len(parent) < 2:
        return False
    return all(type(m) is type(child) for m in parent) and any(True for _ in child.parameters())


def _default_block(parent: Optional[nn.Module], child: nn.Module) -> bool:
    if isinstance(child, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        return True
    if parent is not None and _repeated(parent, child):
        return True
    if isinstance(child, (nn.Linear, nn.Embedding, nn.EmbeddingBag)):
        return sum(p.numel() for p in child.parameters(recurse=False)) >= LARGE
    return False


def _matcher(spec: BlockSpec) -> Callable[[str, Optional[nn.Module], nn.Module], bool]:
    """Turn ``shard_blocks`` into a test of ``(name, parent, module)``."""
    if spec is None:
        return lambda name, parent, m: _default_block(parent, m)
    if callable(spec) and not isinstance(spec, type):
        return lambda name, parent, m: bool(spec(name, m))
    items = [spec] if isinstance(spec, (type, str)) else list(spec) if isinstance(spec, Sequence) else None
    if items is None or not all(isinstance(i, (type, str)) for i in items):
        raise PrepareError(f"shard_blocks must be None, module classes or class names, or a function "
                           f"(name, module) -> bool. Got {spec!r} instead.",
                           fix="e.g. shard_blocks=[MyBlock] or shard_blocks=['BertLayer']")
    classes = tuple(i for i in items if isinstance(i, type))
    names = {i for i in items if isinstance(i, str)}
    return lambda name, parent, m: isinstance(m, classes) or type(m).__name__ in names


def find_blocks(model: nn.Module, spec: BlockSpec = None) -> list[tuple[str, nn.Module]]:
    """The outermost modules below ``model`` that ``spec`` names (default policy: see the
    module), in ``named_modules`` order; never ``model`` itself.  Pure (reads the module tree)."""
    test = _matcher(spec)
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for child_name, child in module.named_children():
            name = f"{prefix}{child_name}"
            if test(name, module, child):
                found.append((name, child))
            else:
                walk(name + ".", child)

    walk("", model)
    if spec is not None and not found and not (isinstance(spec, Sequence) and len(spec) == 0):
        raise PrepareError(f"shard_blocks={spec!r} matched no module of {type(model).__name__}.",
                           fix="name the classes of your model's layers (or pass shard_blocks=() for one group)")
    return found


def shared_across_blocks(model: nn.Module, blocks: Sequence[tuple[str, nn.Module]]) -> dict[str, list[str]]:
    """Pure: each parameter registered in two FSDP groups (two blocks, or a block and the rest of the
    model), as ``{first name: [every name]}``; empty when there is none."""
    prefixes = [name + "." for name, _ in blocks]

    def group_of(param_name: str) -> str:
        return next((p for p in prefixes if param_name.startswith(p)), "")

    where: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        where.setdefault(id(p), []).append(name)
    return {names[0]: names for names in where.values() if len({group_of(n) for n in names}) > 1}


# --------------------------------------------------------------------------- the mesh


def decide_mesh(places: Sequence[tuple[int, int, int]], scope: Optional[str]) -> tuple[int, int]:
    """Pure: ``(replicas, shards)`` of the FSDP2 mesh, from every rank's ``(node, local rank, ranks
    on its node)``.  ``scope`` None or ``"node"``: shard within each node and replicate across
    nodes (HSDP) when the job spans several nodes of two or more ranks each; ``"world"`` (or one
    rank per node): shard across every rank.  ``(1, world)`` is plain FSDP."""
    world, nodes = len(places), sorted({node for node, _, _ in places})
    if scope == "world" or len(nodes) == 1:
        return 1, world
    sizes = sorted({size for _, _, size in places})
    if len(sizes) != 1:
        raise PrepareError(f"HSDP needs the same number of ranks on every node; the nodes run {sizes} ranks.",
                           fix="run the same number of ranks per node, or pass shard_scope='world'")
    local = sizes[0]
    if local == 1:
        return 1, world
    seats = sorted((node, lr) for node, lr, _ in places)
    if nodes != list(range(len(nodes))) or seats != [(n, r) for n in nodes for r in range(local)]:
        raise PrepareError(f"the ranks' places (node, local rank) are not a {len(nodes)} x {local} grid: {seats}.",
                           fix="check the launcher's node and local ranks, or pass shard_scope='world'")
    return len(nodes), local


# --------------------------------------------------------------------------- checks on the objects


def _ipex_touched(optimizer: torch.optim.Optimizer) -> bool:
    """Did ``ipex.optimize`` patch this optimizer (its fused step, its master-weight map)?"""
    return hasattr(optimizer, "params_attr") or hasattr(optimizer, "_original_step")


def check_shardable(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], shard: str) -> None:
    """Raise :class:`PrepareError` when ``model``/``optimizer`` cannot be sharded as they are
    (``shard``: the mode, named in the messages; ``shard="optimizer"`` also needs :func:`check_elementwise`)."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.device.type != "cpu":
            raise PrepareError(f"{name!r} is on {t.device}; shard={shard!r} shards CPU tensors.",
                               fix="call model.to('cpu') before prepare()")
    if optimizer is not None:
        _check_optimizer_state(model, optimizer, shard)


def _check_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, shard: str) -> None:
    """An optimizer prepare can rebind: not IPEX's, no state yet, over the model's parameters only."""
    if _ipex_touched(optimizer):
        raise PrepareError(f"the optimizer was patched by ipex.optimize (IPEX's fused step over its own "
                           f"master weights); shard={shard!r} cannot shard it.",
                           fix="pass the plain torch.optim optimizer and let prepare() choose (ipex=None)")
    if optimizer.state and all(torch.is_tensor(st.get("step")) and not st["step"] for st in optimizer.state.values()):
        raise PrepareError(f"{type(optimizer).__name__} creates its state in its constructor (before any step); "
                           f"shard={shard!r} rebinds the optimizer to the sharded parameters and cannot carry it.",
                           fix="use another optimizer with shard= (AdamW, Adam, SGD, ...), or shard=None")
    if optimizer.state:
        raise PrepareError(f"the optimizer has already stepped; shard={shard!r} rebinds it to the sharded "
                           "parameters and cannot carry the state it holds.",
                           fix="call cpuddp.prepare() before the first optimizer.step() (load a saved optimizer "
                               "state after prepare)")
    names = {id(p): n for n, p in model.named_parameters()}
    stray = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if id(p) not in names]
    if stray:
        raise PrepareError(f"the optimizer holds tensor(s) of shape {stray[:3]} that are not parameters of the "
                           "model; sharding cannot place them.",
                           fix="build the optimizer from model.parameters() (or named subsets of them)")


def check_elementwise(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> None:
    """shard="optimizer": an element-wise torch.optim optimizer holding every trainable parameter
    (:mod:`cpuddp.train.sharding.zero`); a fused one is kept, with a warning at the user's prepare() call."""
    if optimizer is None:
        raise PrepareError('shard="optimizer" shards the optimizer, but none was given.',
                           fix="pass your optimizer: cpuddp.prepare(model, optimizer, shard=\"optimizer\")")
    name = type(optimizer).__name__
    if type(optimizer).__module__.split(".")[:2] != ["torch", "optim"] or name not in ELEMENTWISE:
        raise PrepareError(
            f'shard="optimizer" steps each rank\'s share of a parameter on its own, which is exact only '
            f"for element-wise optimizers ({', '.join(ELEMENTWISE)} from torch.optim); got {name}.",
            fix='use shard="full" (FSDP2 works with any optimizer), or one of those optimizers')
    if any(g.get("fused") for g in optimizer.param_groups):
        warn(f"cpuddp shard='optimizer' with fused=True: {UNFUSED_WHY}; a resumed run will not continue "
             "bit-identically. Fix: leave fused unset (cpuddp then keeps the foreach step)", RuntimeWarning)
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in held]
    if missing:
        raise PrepareError(
            f'shard="optimizer": trainable parameter(s) {missing[:3]} are not in the optimizer; their '
            "gradients would never be applied (this rank keeps only its share of them).",
            fix="give the optimizer every trainable parameter, or set requires_grad=False on the others")


# --------------------------------------------------------------------------- shard="full": FSDP2


def running_allocator(maps_path: str = "/proc/self/maps") -> str:
    """The malloc this process runs on: ``"tcmalloc"``/``"jemalloc"`` when preloaded, else ``"glibc"``."""
    try:
        with open(maps_path) as f:
            maps = f.read()
    except OSError:
        return "unknown"
    return next((name for name in ("tcmalloc", "jemalloc") if f"lib{name}" in maps), "glibc")


#: Why shard="full" wants another malloc than glibc's (measured: docs/performance.md).
GLIBC_NOTE = ("FSDP2 frees and allocates every block's buffers each step, and glibc's malloc keeps that memory "
              "fragmented: peak RSS near twice the live memory here (or, with a fixed MALLOC_MMAP_THRESHOLD_, "
              "half the speed); tcmalloc does neither: preload it (cpuddp run does when libtcmalloc-minimal4 "
              "is installed)")


def gather_seats(node_of: Callable[[], tuple[int, int, int]], group: Any) -> list[tuple[int, int, int]]:
    """Every rank's ``(node, local rank, ranks on its node)``, in rank order (one all-gather of
    int64 tensors: torch's object collectives need numpy, which cpuddp does not require)."""
    import torch.distributed as dist

    mine = torch.tensor(node_of(), dtype=torch.int64)
    places = [torch.zeros(3, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
    dist.all_gather(places, mine, group=group)
    return [(int(n), int(lr), int(size)) for n, lr, size in (p.tolist() for p in places)]


def _mesh(shape: tuple[int, int], places: Sequence[tuple[int, int, int]], group: Any) -> Any:
    """The CPU ``DeviceMesh``: 1-D over ``group`` (default: the world), or 2-D ``(replicate, shard)``
    with each node's ranks in a row."""
    from torch.distributed.device_mesh import DeviceMesh

    replicas, shards = shape
    if replicas == 1:
        if group is None:
            import torch.distributed as dist

            group = dist.group.WORLD
        return DeviceMesh.from_group(group, "cpu")
    grid = torch.empty(replicas, shards, dtype=torch.int)
    for rank, (node, local, _) in enumerate(places):
        grid[node, local] = rank
    return DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard"))


def _sums_in_reduce_scatter(mesh: Any) -> Optional[str]:
    """The backend of the mesh's shard dimension when FSDP2 should reduce-scatter a SUM and divide
    afterwards (its object says: :attr:`~cpuddp.backends.types.BackendSpec.averages_in_reduce_scatter`),
    else None.  FSDP2 reduce-scatters fp32 and bf16 gradients with ``ReduceOp.AVG``; torch 2.8's
    gloo returns the *sum* for it (every gradient N times too large, silently: Adam hides it, its
    state does not), and shm's native route takes SUM only.  A sum divided afterwards is right on
    every torch."""
    import torch.distributed as dist

    name = dist.get_backend(mesh.get_group(mesh.ndim - 1))
    return None if backend_for(name).averages_in_reduce_scatter else str(name)


def _rebind(optimizer: torch.optim.Optimizer, model: nn.Module, names: list[list[str]]) -> None:
    """Point each param group at the model's (now sharded) parameters of the same names."""
    now = dict(model.named_parameters())
    for group, group_names in zip(optimizer.param_groups, names):
        group["params"] = [now[n] for n in group_names]


def apply_full(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], *, blocks: BlockSpec,
               scope: Optional[str], group: Any, node_of: Callable[[], tuple[int, int, int]],
               bf16: bool, notes: list[str]) -> nn.Module:
    """``fully_shard`` each block, then the model; rebind the optimizer.  Returns the model.
    ``node_of()``: this rank's ``(node, local rank, ranks on its node)``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    found = find_blocks(model, blocks)
    shared = shared_across_blocks(model, found)
    if shared and blocks is None:  # the default policy leaves tied leaves (embedding + head) to the root
        tied = {n.rsplit(".", 1)[0] for names in shared.values() for n in names}
        found = [(n, m) for n, m in found if not (n in tied and isinstance(m, (nn.Linear, nn.Embedding)))]
        shared = shared_across_blocks(model, found)
    if shared:
        first, every = next(iter(shared.items()))
        raise PrepareError(
            f"parameter {first!r} is shared by {every} in different shard blocks; FSDP2 gathers each block's "
            "parameters on its own, so a parameter cannot belong to two.",
            fix="name blocks that keep shared parameters together (shard_blocks=...), or untie them")
    names = {id(p): n for n, p in model.named_parameters()}
    opt_names = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups] if optimizer else []
    places = gather_seats(node_of, group)
    mesh_shape = decide_mesh(places, "world" if group is not None else scope)
    mesh = _mesh(mesh_shape, places, group)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for i, (_, block) in enumerate(found):
        # the last block's backward comes first: keep it gathered after forward (as torchtitan does)
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(found) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    summing = _sums_in_reduce_scatter(mesh)
    if summing is not None:
        for _, block in [*found, ("", model)]:
            block.set_force_sum_reduction_for_comms(True)
        notes.append(f"shard='full' on {summing}: FSDP2 reduce-scatters a sum and divides it itself")
    if optimizer is not None:
        _rebind(optimizer, model, opt_names)
    if running_allocator() == "glibc":
        notes.append(f"malloc: glibc's; {GLIBC_NOTE}")
        log0("cpuddp: shard='full' on glibc's malloc: %s", GLIBC_NOTE, level=logging.WARNING, logger=_log)
    kind = f"HSDP {mesh_shape[0]} replicas x {mesh_shape[1]} shards" if mesh_shape[0] > 1 else f"{mesh_shape[1]} shards"
    notes.append(f"shard='full': FSDP2 over {kind}, {len(found)} block(s) + the rest"
                 + (", bf16 parameters with fp32 gradient reduction" if bf16 else ""))
    _log.info("shard='full': blocks %s", [n for n, _ in found])
    return model

"""Sharding: mesh roles (``MeshResource``), TE's logical axis names and sharding constraints.

A JAX ``Mesh`` names its device axes (for example ``("dp", "tp")``). ``MeshResource`` says which
mesh axis plays which parallelism role; TE's logical axis names (``BATCH_AXES``, ``W_TP_AXES``, ...)
are then mapped onto mesh axes through those roles:

    BATCH_AXES -> fsdp if its axis has > 1 device, else dp      W_FSDP_AXES -> fsdp
    HEAD_AXES, HIDDEN_TP_AXES, W_TP_AXES -> tpsp if > 1, else tp  SEQLEN_TP_AXES -> tpsp
    SEQLEN_CP_AXES -> cp         everything else (SEQLEN, HIDDEN, JOINED, W_NO_SHARD, W_JOINED) -> None

Constraints are no-ops when no mesh is active, so single-device code needs no ``MeshResource``.
The mesh is the one entered with ``jax.set_mesh(mesh)`` or, for older code, ``with mesh:``.
Reductions such as the FP8 amax need no explicit ``pmax`` here: under ``jax.jit`` with GSPMD a
``jnp.max`` over a sharded array is already global.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Optional, Sequence

import jax
from jax.sharding import PartitionSpec

__all__ = [
    "BATCH_AXES",
    "SEQLEN_AXES",
    "SEQLEN_TP_AXES",
    "SEQLEN_CP_AXES",
    "HEAD_AXES",
    "HIDDEN_AXES",
    "HIDDEN_TP_AXES",
    "JOINED_AXES",
    "W_NO_SHARD_AXES",
    "W_FSDP_AXES",
    "W_TP_AXES",
    "W_JOINED_AXES",
    "MeshResource",
    "global_shard_guard",
    "global_mesh_resource",
    "get_sharding_map_logic_axis_to_mesh_axis",
    "extend_logical_axis_rules",
    "with_sharding_constraint",
    "with_sharding_constraint_by_logical_axes",
    "is_mesh_available",
    "get_mesh_axis_size",
]

BATCH_AXES = "nvte_batch"
SEQLEN_AXES = "nvte_seqlen"
SEQLEN_TP_AXES = "nvte_seqlen_tp"
SEQLEN_CP_AXES = "nvte_seqlen_cp"
HEAD_AXES = "nvte_head"
HIDDEN_AXES = "nvte_hidden"
HIDDEN_TP_AXES = "nvte_hidden_tp"
JOINED_AXES = "nvte_joined"
W_NO_SHARD_AXES = "nvte_w_no_shard"
W_FSDP_AXES = "nvte_w_fsdp"
W_TP_AXES = "nvte_w_tp"
W_JOINED_AXES = "nvte_w_joined"


@dataclass
class MeshResource:
    """Which mesh axis plays which parallelism role (each a mesh axis name or None).

    Attributes:
        dp_resource: data parallel (the batch is split, parameters replicated).
        tp_resource: tensor parallel (heads / hidden split, Megatron column+row layout).
        tpsp_resource: tensor parallel plus sequence parallel outside the GEMMs.
        fsdp_resource: fully sharded data parallel (batch and weights split).
        pp_resource: pipeline parallel (excluded from amax reductions).
        cp_resource: context parallel (the sequence split in attention).
        ep_resource: expert parallel.

    Example:
        >>> MeshResource(dp_resource="data").tp_resource is None
        True
    """

    dp_resource: Optional[str] = None
    tp_resource: Optional[str] = None
    tpsp_resource: Optional[str] = None
    fsdp_resource: Optional[str] = None
    pp_resource: Optional[str] = None
    cp_resource: Optional[str] = None
    ep_resource: Optional[str] = None


_GLOBAL_MESH_RESOURCE: Optional[MeshResource] = None


@contextmanager
def global_shard_guard(resource: Optional[MeshResource]):
    """Set the global ``MeshResource`` inside the context (restored on exit).

    Raises:
        TypeError: ``resource`` is neither a MeshResource nor None.
    """
    global _GLOBAL_MESH_RESOURCE
    if resource is not None and not isinstance(resource, MeshResource):
        raise TypeError(
            f"mesh_resource must be a MeshResource or None, got {type(resource).__name__}: "
            "build one with transformer_engine.jax.MeshResource(dp_resource=..., tp_resource=...)"
        )
    previous = _GLOBAL_MESH_RESOURCE
    _GLOBAL_MESH_RESOURCE = resource
    try:
        yield
    finally:
        _GLOBAL_MESH_RESOURCE = previous


def _current_mesh():
    """The active mesh (``jax.set_mesh`` first, then a legacy ``with mesh:``), or None."""
    get_abstract_mesh = getattr(jax.sharding, "get_abstract_mesh", None)  # JAX >= 0.5
    mesh = get_abstract_mesh() if get_abstract_mesh is not None else None
    if mesh is not None and not mesh.empty:
        return mesh
    with warnings.catch_warnings():  # the legacy `with mesh:` path is deprecated in JAX >= 0.8.2
        warnings.simplefilter("ignore", DeprecationWarning)
        pxla = getattr(jax.interpreters, "pxla", None)
        resources = getattr(pxla, "thread_resources", None)
        physical = resources.env.physical_mesh if resources is not None else None
    if physical is not None and not physical.empty:
        return physical
    return None


def is_mesh_available() -> bool:
    """True when a non-empty mesh is active."""
    return _current_mesh() is not None


def get_mesh_axis_size(axis: Optional[str], mesh=None) -> int:
    """Number of devices along ``axis`` of the active mesh (1 for None).

    Raises:
        ValueError: ``axis`` is not an axis of the mesh.
    """
    if axis is None:
        return 1
    mesh = mesh if mesh is not None else _current_mesh()
    if mesh is None:
        return 1
    if axis not in mesh.shape:
        raise ValueError(
            f"mesh axis {axis!r} is not in the mesh, whose axes are {tuple(mesh.shape)}: "
            "fix the MeshResource given to autocast(mesh_resource=...) or the mesh axis names"
        )
    return mesh.shape[axis]


def global_mesh_resource() -> MeshResource:
    """The active ``MeshResource``, validated against the active mesh.

    Raises:
        RuntimeError: a mesh is active but no MeshResource was set.
        ValueError: a role names an axis that is not in the mesh, or tp and tpsp are both > 1.
    """
    mesh = _current_mesh()
    if _GLOBAL_MESH_RESOURCE is None:
        if mesh is None:
            return MeshResource()
        raise RuntimeError(
            "a mesh is active but no MeshResource is set: wrap the code in "
            "te.autocast(..., mesh_resource=te.MeshResource(dp_resource=..., tp_resource=...))"
        )
    if mesh is not None:
        _validate(_GLOBAL_MESH_RESOURCE, mesh)
    return _GLOBAL_MESH_RESOURCE


def _validate(resource: MeshResource, mesh) -> None:
    for field in fields(resource):
        get_mesh_axis_size(getattr(resource, field.name), mesh)  # raises for unknown axes
    if get_mesh_axis_size(resource.tp_resource, mesh) > 1 and (
        get_mesh_axis_size(resource.tpsp_resource, mesh) > 1
    ):
        raise ValueError(
            f"tp_resource={resource.tp_resource!r} and tpsp_resource={resource.tpsp_resource!r} "
            "both have more than one device: use one of tensor parallel or tensor+sequence parallel"
        )


def get_sharding_map_logic_axis_to_mesh_axis() -> dict:
    """TE logical axis name -> mesh axis name (or None); empty when no mesh is active."""
    mesh = _current_mesh()
    if mesh is None:
        return {}
    r = global_mesh_resource()
    batch = r.fsdp_resource if get_mesh_axis_size(r.fsdp_resource, mesh) > 1 else r.dp_resource
    tp = r.tpsp_resource if get_mesh_axis_size(r.tpsp_resource, mesh) > 1 else r.tp_resource
    return {
        BATCH_AXES: batch,
        SEQLEN_AXES: None,
        SEQLEN_TP_AXES: r.tpsp_resource,
        SEQLEN_CP_AXES: r.cp_resource,
        HEAD_AXES: tp,
        HIDDEN_AXES: None,
        HIDDEN_TP_AXES: tp,
        JOINED_AXES: None,
        W_NO_SHARD_AXES: None,
        W_FSDP_AXES: r.fsdp_resource,
        W_TP_AXES: tp,
        W_JOINED_AXES: None,
    }


def extend_logical_axis_rules(rules: Sequence[tuple]) -> tuple:
    """Append TE's (logical axis -> mesh axis) pairs to Flax logical axis rules.

    Call it inside ``autocast(mesh_resource=...)`` with the mesh active. A user rule for one of
    TE's names must agree with TE's mapping.

    Args:
        rules: Flax rules, a sequence of ``(logical_name, mesh_axis_or_None)``.

    Returns:
        The rules followed by TE's pairs that the user did not already give.

    Raises:
        ValueError: a rule is not a (str, str | None) pair, or it contradicts TE's mapping.

    Example:
        >>> extend_logical_axis_rules((("embed", None),))   # no mesh active: nothing is added
        (('embed', None),)
    """
    given: dict = {}
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str) or not (
            rule[1] is None or isinstance(rule[1], str)
        ):
            raise ValueError(
                f"logical axis rule {rule!r} must be a pair (logical_name: str, mesh_axis: str | None)"
            )
        given.setdefault(rule[0], []).append(rule[1])
    extended = [tuple(rule) for rule in rules]
    for name, mesh_axis in get_sharding_map_logic_axis_to_mesh_axis().items():
        if name not in given:
            extended.append((name, mesh_axis))
        elif given[name] != [mesh_axis]:
            raise ValueError(
                f"logical axis {name!r} maps to {given[name]} in the given rules but to "
                f"{mesh_axis!r} under the active MeshResource: drop the rule or make it agree"
            )
    return tuple(extended)


def with_sharding_constraint(x: jax.Array, pspec: Optional[PartitionSpec]) -> jax.Array:
    """``jax.lax.with_sharding_constraint`` that is a no-op without a mesh or for an all-None spec.

    Axes that are manual (inside ``shard_map``) are dropped from the spec.
    """
    mesh = _current_mesh()
    if pspec is None or mesh is None:
        return x
    manual = set(getattr(mesh, "manual_axes", ()))

    def keep(entry):
        names = entry if isinstance(entry, tuple) else (entry,)
        names = tuple(n for n in names if n is not None and n not in manual)
        return None if not names else (names if isinstance(entry, tuple) else names[0])

    cleaned = tuple(keep(entry) for entry in pspec)
    if all(entry is None for entry in cleaned):
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec(*cleaned))


def with_sharding_constraint_by_logical_axes(
    x: jax.Array, logical_axis_names: Optional[Sequence[Optional[str]]]
) -> jax.Array:
    """Constrain ``x`` by logical axis names (Flax rules if active, else TE's own table).

    Args:
        x: the array to constrain.
        logical_axis_names: one name (or None) per dimension of ``x``; empty or None = no constraint.

    Raises:
        ValueError: the number of names differs from ``x.ndim``.
    """
    if not logical_axis_names:
        return x
    if len(logical_axis_names) != x.ndim:
        raise ValueError(
            f"got {len(logical_axis_names)} logical axis names {tuple(logical_axis_names)} for an "
            f"array of shape {x.shape}: give exactly one name (or None) per dimension"
        )
    if _current_mesh() is None:
        return x
    import flax.linen as nn  # flax is part of the jax extra

    if nn.get_logical_axis_rules():
        return nn.with_logical_constraint(
            x, tuple(logical_axis_names), fallback=nn.spmd.RulesFallback.AXIS_IS_UNSHARDED
        )
    table = get_sharding_map_logic_axis_to_mesh_axis()
    return with_sharding_constraint(x, PartitionSpec(*(table.get(n) for n in logical_axis_names)))

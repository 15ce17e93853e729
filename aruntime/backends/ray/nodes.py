"""The nodes of the Ray cluster: what ``<node>`` in ``RAY:<node>/<device>`` names, and the devices they offer.

``<node>`` is ``any`` (wherever Ray places the actor) or names exactly one *live* node by

* its Ray node name (``ray start --node-name``; Ray defaults it to the node's IP address),
* its node id, in full or as a prefix of at least :data:`MIN_PREFIX` hex digits,
* its IP address, or
* its host name.

A name that matches no live node, or several (e.g. an IP address shared by the nodes of a local cluster on one
machine), is refused with a :class:`~aruntime.errors.DeviceError` listing the live nodes. :func:`nodes` lists the
live nodes with the name each goes by in the names :func:`devices` returns: its node name where that names
only it, else the shortest unique prefix of its id (at least :data:`MIN_PREFIX` digits).
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aruntime.backends.ray.wire import ray
from aruntime.device import Device
from aruntime.errors import DeviceError
from aruntime.helpers import canonicalize

MIN_PREFIX = 8
"""The fewest hex digits of a node id that name its node."""


@dataclass(frozen=True)
class Node:
    """A live node of the Ray cluster."""

    name: str
    """What names this node in ``RAY:<node>/<device>``: its node name if that is unique, else an id prefix."""
    id: str
    """The Ray node id (hex)."""
    node_name: str
    """Ray's name of the node (``--node-name``; by default its IP address)."""
    address: str
    """The node's IP address."""
    hostname: str
    """The node's host name."""


def _init() -> None:
    if ray is None:
        raise DeviceError("RAY devices need Ray: pip install 'aruntime[ray]'")
    if not ray.is_initialized():
        ray.init()


def _live() -> list[dict[str, Any]]:
    return [node for node in ray.nodes() if node.get("Alive")]  # type: ignore[no-untyped-call]


def _matches(node: dict[str, Any], host: str) -> bool:
    node_id = str(node.get("NodeID", ""))
    if host in (node_id, node.get("NodeName"), node.get("NodeManagerAddress"), node.get("NodeManagerHostname")):
        return True
    is_hex = len(host) >= MIN_PREFIX and all(c in string.hexdigits for c in host)
    return is_hex and node_id.startswith(host.lower())


def _describe(alive: Sequence[dict[str, Any]]) -> str:
    return ", ".join(f"{n.get('NodeName')} ({n.get('NodeManagerAddress')}, {n.get('NodeID')})" for n in alive)


def node_id(name: str, host: str) -> str:
    """The id of the one live node ``host`` names (see the module docstring); ``name`` is the device's, for
    the error."""
    alive = _live()
    found = [node for node in alive if _matches(node, host)]
    if len(found) == 1:
        return str(found[0]["NodeID"])
    if not found:
        raise DeviceError(f"{name}: no live Ray node is {host!r}; live nodes: {_describe(alive) or 'none'}")
    raise DeviceError(
        f"{name}: {host!r} names {len(found)} live Ray nodes ({_describe(found)}); "
        f"name one by its node name or a prefix of its id (at least {MIN_PREFIX} hex digits)"
    )


def _short(node: dict[str, Any], alive: Sequence[dict[str, Any]]) -> str:
    node_name = str(node.get("NodeName") or "")
    if node_name and node_name != "any" and sum(_matches(n, node_name) for n in alive) == 1:
        return node_name
    node_id = str(node["NodeID"])
    for size in range(MIN_PREFIX, len(node_id)):
        prefix = node_id[:size]
        if sum(_matches(n, prefix) for n in alive) == 1:
            return prefix
    return node_id


def nodes() -> list[Node]:
    """The live nodes of the Ray cluster (joining or starting one, as opening a RAY device does, if Ray is not
    initialized), in Ray's order."""
    _init()
    alive = _live()
    return [
        Node(
            _short(n, alive),
            str(n["NodeID"]),
            str(n.get("NodeName", "")),
            str(n.get("NodeManagerAddress", "")),
            str(n.get("NodeManagerHostname", "")),
        )
        for n in alive
    ]


class _Probe:
    """A short-lived actor that says which device kinds open on its node."""

    def available(self) -> list[str]:
        return Device.available()


def devices(kinds: Sequence[str] | None = None, timeout: float = 120.0) -> list[str]:
    """The names of the RAY devices of the live nodes: ``RAY:<node>/<device>`` (``<node>`` as :func:`nodes`
    names it), node by node.

    With ``kinds`` (e.g. ``("CPU", "SIM:1")``), those devices on every node, without asking the nodes. Without
    it, each node is asked, by an actor started there and ended after, which kinds open on it
    (``Device.available()`` there); a node that does not answer within ``timeout`` seconds is left out.
    """
    if kinds is not None:
        if isinstance(kinds, str):
            raise TypeError("devices: kinds must be a sequence of device names, e.g. ('CPU',), not a str")
        inner = [canonicalize(kind) for kind in kinds]
        for kind in inner:
            if kind.partition(":")[0] == "RAY":
                raise DeviceError(f"devices: {kind}: the remote device cannot itself be a RAY device")
        return [f"RAY:{node.name}/{kind}" for node in nodes() for kind in inner]
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    found = nodes()
    probe: Any = ray.remote(_Probe)
    actors = [
        probe.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node.id, soft=False)).remote()
        for node in found
    ]
    try:
        refs = [actor.available.remote() for actor in actors]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
        names = []
        for node, ref in zip(found, refs, strict=True):
            if ref not in ready:
                continue
            try:
                kinds_there = ray.get(ref)
            except ray.exceptions.RayError:  # the node went away meanwhile
                continue
            names += [f"RAY:{node.name}/{kind}" for kind in kinds_there]
        return names
    finally:
        for actor in actors:
            ray.kill(actor)

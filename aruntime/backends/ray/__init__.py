"""RAY devices: a device of any kind on another host, driven through a Ray actor.

``Device["RAY:<host>/<device>"]`` opens ``<device>`` (``CPU``, ``CPU:1``, ...)
inside a Ray actor on ``<host>``: ``any`` (wherever Ray places it), or the one
live node named by its Ray node name, its node id (or a prefix of at least 8
hex digits), its IP address or its host name (see
:mod:`~aruntime.backends.ray.nodes`; :func:`devices` lists the devices of the
live nodes by these names). The driver holds handles; the memory, the
compiler and its cache, and the engines are the remote host's.

How it maps onto the engine interface: each op of a RAY device becomes one
call of its actor (a transfer between two RAY devices, one call on each). The
driver numbers the calls of a device in the order their ops are handed to its
engines, sends them in that order, and the actor submits them to its own
device in that order, so the remote device's hazard tracking orders them
exactly as the driver's did, without the driver waiting in between. A call's
ObjectRef resolves on Ray's thread, which only queues it; a completion thread
per device finishes the ops in order with ``Engine._complete``, which wakes
awaiters on any event loop (asyncio, uvloop, trio) or thread.

Transfers between two RAY devices go host to host through Ray's object store:
the source actor exports (puts) the bytes, the destination actor imports them
by ObjectRef; the driver only passes the reference along. A transfer between a
RAY device and a local one moves the bytes through the driver, which is where
the local device is.

Modules: :mod:`~aruntime.backends.ray.driver` (the device, its engines and
allocator), :mod:`~aruntime.backends.ray.host` (the actor), :mod:`~aruntime.backends.ray.nodes`
(naming and listing the nodes) and
:mod:`~aruntime.backends.ray.wire` (what travels between them). Ray is
imported only here; without it the backend still loads, and opening a RAY
device says what is missing.
"""

from aruntime.backends.ray.driver import RayEngine, RemoteAllocator, RemoteDevice, RemoteProgram
from aruntime.backends.ray.host import HostActor
from aruntime.backends.ray.nodes import Node, devices, nodes
from aruntime.backends.ray.wire import RemoteHandle
from aruntime.errors import DeviceLost

__all__ = [
    "DeviceLost",
    "HostActor",
    "Node",
    "RayEngine",
    "RemoteAllocator",
    "RemoteDevice",
    "RemoteHandle",
    "RemoteProgram",
    "devices",
    "nodes",
]

device_class = RemoteDevice
"""The class the registry opens for this kind."""

"""RAY devices: a device of any kind on another host, driven through a Ray actor.

``Device["RAY:<host>/<device>"]`` opens ``<device>`` (``CPU``, ``CPU:1``, ...)
inside a Ray actor on ``<host>``: ``any`` (wherever Ray places it), a node's
IP address, or a node id (hex). The driver holds handles; the memory, the
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
allocator), :mod:`~aruntime.backends.ray.host` (the actor) and
:mod:`~aruntime.backends.ray.wire` (what travels between them). Ray is
imported only here; without it the backend still loads, and opening a RAY
device says what is missing.
"""

from aruntime.backends.ray.driver import DeviceLost, RayEngine, RemoteAllocator, RemoteDevice, RemoteProgram
from aruntime.backends.ray.host import HostActor
from aruntime.backends.ray.wire import RemoteHandle

__all__ = [
    "DeviceLost",
    "HostActor",
    "RayEngine",
    "RemoteAllocator",
    "RemoteDevice",
    "RemoteHandle",
    "RemoteProgram",
]

device_class = RemoteDevice
"""The class the registry opens for this kind."""

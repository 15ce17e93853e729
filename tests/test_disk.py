"""The DISK device: buffers are memory-mapped bytes of a file."""

from __future__ import annotations

import array
import os
import pickle
import re
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from aruntime import AllocationError, Buffer, BufferUsageError, Device, DeviceError, dtypes, transfer
from aruntime.backends.disk import DiskAllocator, DiskDevice
from aruntime.device import Program

pytestmark = pytest.mark.anyio


def disk(path: Path) -> str:
    return f"DISK:{path}"


def live_maps(name: str) -> dict[int, object]:
    alloc = Device[name].allocator
    assert isinstance(alloc, DiskAllocator)
    return dict(alloc._maps)


def test_name_keeps_the_path_case_and_opens_once(tmp_path: Path) -> None:
    path = tmp_path / "MiXeD" / "Case.BIN"
    path.parent.mkdir()
    dev = Device[f"disk:{path}"]
    assert isinstance(dev, DiskDevice) and dev.name == f"DISK:{path}" and dev.path == str(path)
    assert Device[f"DISK:{path}"] is dev and Device[f"Disk:{path}"] is dev
    assert Device[f"DISK:{str(path).lower()}"] is not dev
    assert not path.exists()  # opening the device does not touch the file; the first allocation does


def test_a_path_is_required(tmp_path: Path) -> None:
    with pytest.raises(DeviceError, match=r"DISK: a DISK device needs a file path, e.g. DISK:/path/to/file"):
        Device["disk"]
    with pytest.raises(DeviceError, match=r"nothing after .:.; .*a path for DISK"):
        Device["DISK:"]
    assert "DISK" not in Device.opened


def test_an_unopenable_file_is_a_clear_error_and_loses_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-dir" / "f.bin"
    buf = Buffer(disk(missing), 8)
    with pytest.raises(DeviceError, match=re.escape(f"cannot open '{missing}' for reading and writing: No such file")):
        buf.allocate()
    assert not buf.is_allocated()
    missing.parent.mkdir()
    assert buf.allocate().is_allocated()  # the same buffer works once the directory exists
    buf.deallocate()
    directory = tmp_path / "a-directory"
    directory.mkdir()
    with pytest.raises(DeviceError, match=re.escape(f"cannot open '{directory}'")):
        Buffer(disk(directory), 8).allocate()


def test_a_buffer_is_the_start_of_the_file(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(bytes(range(100)))
    buf = Buffer(disk(path), 10, dtypes.uint8, preallocate=True)
    assert bytes(buf.as_buffer()) == bytes(range(10))
    assert path.stat().st_size == 100  # never shrunk
    view = Buffer(disk(path), 100, preallocate=True).view(4, dtypes.int32, 40)
    assert view.as_buffer().tobytes() == bytes(range(40, 56))
    buf.copyin(memoryview(b"ABCDEFGHIJ"))
    assert path.read_bytes()[:12] == b"ABCDEFGHIJ\x0a\x0b"
    big = Buffer(disk(path), 50, dtypes.int32, preallocate=True)  # 200 bytes: the file grows, zero-filled
    assert path.stat().st_size == 200
    assert path.read_bytes()[100:] == bytes(100)
    assert big.as_buffer().tobytes()[:10] == b"ABCDEFGHIJ"


def test_zero_copy_writes_reach_the_file_and_views_use_offsets(tmp_path: Path) -> None:
    path = tmp_path / "z.bin"
    root = Buffer(disk(path), 16, preallocate=True)
    mv = root.as_buffer(allow_zero_copy=True)
    mv[:] = b"0123456789abcdef"
    assert path.read_bytes() == b"0123456789abcdef"
    inner = root.view(8, dtypes.uint8, 4).view(4, dtypes.uint8, 2)  # bytes 6..10
    assert inner.ensure_allocated().handle == root.handle + 6
    part = inner.as_buffer(allow_zero_copy=True)
    assert bytes(part) == b"6789"
    part[:] = b"WXYZ"
    assert path.read_bytes() == b"012345WXYZabcdef"
    with pytest.raises(BufferUsageError, match="out of range of its 16-byte root"):
        inner.view(8, dtypes.uint8, 4)
    del mv, part
    root.deallocate()


def test_bytes_are_not_counted_and_mappings_close_on_free(tmp_path: Path) -> None:
    dev = Device[disk(tmp_path / "count.bin")]
    assert isinstance(dev.allocator, DiskAllocator)
    bufs = [Buffer(dev.name, n, preallocate=True) for n in (10, 4096, 70000)]
    assert dev.allocator.in_use == 0  # file-backed
    assert len(dev.allocator._maps) == 3
    for b in bufs:
        b.deallocate()
    assert dev.allocator._maps == {} and dev.allocator.in_use == 0


def test_a_zero_copy_view_keeps_its_mapping_alive_after_free(tmp_path: Path) -> None:
    path = tmp_path / "alive.bin"
    buf = Buffer(disk(path), 5, initial_value=b"hello")
    mv = buf.as_buffer(allow_zero_copy=True)
    buf.deallocate()
    assert live_maps(disk(path)) == {}
    assert bytes(mv) == b"hello"  # still mapped: no crash, no garbage
    mv[0] = ord("j")
    del mv
    assert path.read_bytes() == b"jello"


def test_a_huge_allocation_is_an_allocation_error(tmp_path: Path) -> None:
    path = tmp_path / "huge.bin"
    path.write_bytes(b"keep")
    buf = Buffer(disk(path), 1 << 62)
    with pytest.raises(AllocationError, match=f"cannot reserve and map {1 << 62} bytes of .*huge.bin"):
        buf.allocate()
    assert not buf.is_allocated() and path.read_bytes() == b"keep"


def test_external_pointers_are_refused(tmp_path: Path) -> None:
    buf = Buffer(disk(tmp_path / "e.bin"), 4)
    with pytest.raises(DeviceError, match="external_ptr is not supported"):
        buf.allocate(external_ptr=0x1000)
    assert not buf.is_allocated() and buf.spec.external_ptr is None  # the failed call changed nothing


async def test_roundtrip_through_cpu_transfers(tmp_path: Path) -> None:
    path = tmp_path / "roundtrip.bin"
    cpu, dsk = Device["CPU"], Device[disk(path)]
    data = array.array("f", [float(i) * 0.5 for i in range(1000)])
    src = await cpu.allocate(1000, dtypes.float32)
    stored = await dsk.allocate(1000, dtypes.float32)
    back = await cpu.allocate(1000, dtypes.float32)
    cpu.copyin(src, data)
    op = transfer(stored, src)
    assert op.engine is cpu.copy  # into a file: on the source's copy engine
    await op
    assert path.read_bytes() == data.tobytes()  # really in the file
    op = transfer(back, stored)
    assert op.engine is cpu.copy  # out of a file: the destination reads it
    await op
    assert bytes(await cpu.copyout(back)) == data.tobytes()
    other = Device[disk(tmp_path / "other.bin")]
    copied = await other.allocate(1000, dtypes.float32)
    op = transfer(copied, stored)
    assert op.engine is dsk.copy  # between files: the source's
    await op
    assert (tmp_path / "other.bin").read_bytes() == data.tobytes()
    await other.free(copied)
    await dsk.copyin(stored, bytes(4000))
    assert path.read_bytes() == bytes(4000)
    dsk.copyin(stored, data)
    assert array.array("f", await dsk.copyout(stored)) == data
    for b in (src, back):
        await cpu.free(b)
    await dsk.free(stored)
    await dsk.synchronize()
    assert live_maps(dsk.name) == {}
    assert path.read_bytes() == data.tobytes()  # the file keeps the data after the free


async def test_copy_size_errors(tmp_path: Path) -> None:
    dsk = Device[disk(tmp_path / "sizes.bin")]
    buf = await dsk.allocate(8)
    with pytest.raises(BufferUsageError, match="copyin: source has 7 bytes"):
        dsk.copyin(buf, b"1234567")
    cpu_buf = await Device["CPU"].allocate(4)
    with pytest.raises(BufferUsageError, match=r"transfer: .* has 8 bytes, .* has 4"):
        transfer(cpu_buf, buf)
    await dsk.free(buf)


async def test_no_kernels(tmp_path: Path) -> None:
    dsk = Device[disk(tmp_path / "k.bin")]
    assert dsk.compiler is None
    with pytest.raises(DeviceError, match="stores data and has no compiler"):
        await dsk.compile("void kernel(void) {}")
    buf = await dsk.allocate(4)
    with pytest.raises(DeviceError, match="stores data and runs no kernels"):
        dsk.launch(Program(dsk, "kernel", b""), buf)
    await dsk.free(buf)


def test_dtypes_and_pickling(tmp_path: Path) -> None:
    path = tmp_path / "p.bin"
    dev = Device[disk(path)]
    assert dev.is_dtype_supported(dtypes.bfloat16) and dev.is_dtype_supported(dtypes.float64)
    buf = Buffer(dev.name, 3, dtypes.uint8, initial_value=b"xyz")
    clone = pickle.loads(pickle.dumps(buf))
    assert clone.device == dev.name and bytes(clone.as_buffer()) == b"xyz"


def test_close_flushes_and_the_next_allocation_reopens(tmp_path: Path) -> None:
    path = tmp_path / "closed.bin"
    dev = DiskDevice(disk(path))  # a private instance, so closing it does not affect the registry's
    handle = dev.allocator.alloc(6)
    dev.allocator._copyin(handle, memoryview(b"before"))
    dev.close()
    assert path.read_bytes() == b"before" and dev.allocator._fd is None
    dev.allocator.free(handle, 6)
    again = dev.allocator.alloc(6)
    out = bytearray(6)
    dev.allocator._copyout(memoryview(out), again)
    assert out == b"before"
    dev.allocator.free(again, 6)
    dev.allocator.close()


def test_processes_share_the_file(tmp_path: Path) -> None:
    path = tmp_path / "shared.bin"
    parent = Buffer(disk(path), 11, initial_value=b"from parent")
    code = """
    import sys
    from aruntime import Buffer, Device
    name = "DISK:" + sys.argv[1]
    buf = Buffer(name, 11, preallocate=True)
    seen = bytes(buf.as_buffer())
    buf.copyin(memoryview(b"from child!"))
    print(seen.decode(), Device[name].allocator.in_use)
    """
    env = {k: v for k, v in os.environ.items() if k not in ("ARUNTIME_CPU", "ARUNTIME_NULL", "ARUNTIME_DISK")}
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), str(path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["from", "parent", "0"]
    assert bytes(parent.as_buffer()) == b"from child!"  # the parent's mapping sees the child's write
    parent.deallocate()


# ---- a file system without room ------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs mounted for the test; skipped where mounting is not allowed."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to make a small file system with")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a 1 MiB tmpfs here: {proc.stderr.strip() or f'mount exited {proc.returncode}'}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def test_a_file_system_without_room_is_an_allocation_error(small_fs: Path) -> None:
    (small_fs / "filler").write_bytes(bytes(768 << 10))
    path = small_fs / "data.bin"
    dev = DiskDevice(disk(path))  # a private instance: the file system goes with the test
    where = re.escape(f"cannot reserve and map {512 << 10} bytes of '{path}': No space left on device")
    with pytest.raises(AllocationError, match=where):
        dev.allocator.alloc(512 << 10)
    assert path.stat().st_size == 0 and dev.allocator._maps == {}  # no grown file, no mapping left behind
    os.truncate(path, 512 << 10)  # a sparse file: its size is there, its blocks are not
    with pytest.raises(AllocationError, match=where):
        dev.allocator.alloc(512 << 10)
    assert path.stat().st_size == 512 << 10 and dev.allocator._maps == {}
    handle = dev.allocator.alloc(128 << 10)  # what fits is reserved: writing all of it is safe
    dev.allocator._copyin(handle, memoryview(b"\xff" * (128 << 10)))
    dev.allocator.free(handle, 128 << 10)
    dev.allocator.close()


FILL_A_SMALL_DISK = """
import sys
import anyio
from aruntime import AllocationError, Device

async def main(path):
    dev = Device["DISK:" + path]
    try:
        big = await dev.allocate(2 << 20)
    except AllocationError as exc:
        print("refused:", exc)
    else:
        await dev.copyin(big, b"\\xff" * (2 << 20))  # pages the file system cannot back
        print("copied")
    small = await dev.allocate(64 << 10)
    await dev.copyin(small, b"\\x01" * (64 << 10))
    print("ok", bytes(await dev.copyout(small)).count(1))

anyio.run(main, sys.argv[1])
"""


def test_copying_into_a_disk_without_room_fails_and_the_process_lives(small_fs: Path) -> None:
    path = small_fs / "data.bin"
    proc = subprocess.run(  # a child process: a write the file system cannot back is a SIGBUS
        [sys.executable, "-c", textwrap.dedent(FILL_A_SMALL_DISK), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr}"
    refused, ok = proc.stdout.splitlines()
    assert refused.startswith(f"refused: DISK:{path}: cannot reserve and map {2 << 20} bytes of '{path}'")
    assert "No space left on device" in refused
    assert ok == f"ok {64 << 10}"

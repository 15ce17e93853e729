"""Interpreter exit with work in flight: nothing hangs or crashes, a DISK buffer gets every byte of an
un-awaited copy, what cannot finish is named in a warning, and ARUNTIME_PROFILE=1 still writes its trace."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.kernels import GATE

UNAWAITED_COPY = textwrap.dedent(
    """
    import sys
    import anyio
    from aruntime import Device

    async def main(path):
        dev = Device["DISK:" + path]
        buf = await dev.allocate(64 << 20)
        dev.copyin(buf, bytes(range(256)) * (1 << 18))  # 64 MiB, never awaited: the program ends at once

    anyio.run(main, sys.argv[1])
    """
)


def run(script: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    proc.elapsed = time.monotonic() - started  # type: ignore[attr-defined]
    return proc


def test_an_unawaited_copy_into_a_disk_buffer_is_finished_at_exit(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    proc = run(UNAWAITED_COPY, str(path))
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    assert path.read_bytes() == bytes(range(256)) * (1 << 18)  # all 64 MiB, not the first chunks


def test_the_profile_is_still_written_at_exit_with_work_in_flight(tmp_path: Path) -> None:
    path, trace = tmp_path / "data.bin", tmp_path / "trace.json"
    proc = run(UNAWAITED_COPY, str(path), env={"ARUNTIME_PROFILE": "1", "ARUNTIME_PROFILE_PATH": str(trace)})
    assert proc.returncode == 0, proc.stderr
    assert path.read_bytes() == bytes(range(256)) * (1 << 18)
    events = json.loads(trace.read_text())
    assert any("copyin" in str(e.get("name", "")) for e in events["traceEvents"])


STUCK = textwrap.dedent(
    """
    import sys
    import anyio
    from aruntime import Device, dtypes, transfer
    GATE = {gate!r}

    async def main(path):
        cpu, disk = Device["CPU"], Device["DISK:" + path]
        prog = await cpu.compile(GATE, outs=(0,))
        flag = await cpu.allocate(1, dtypes.int32)
        await cpu.copyin(flag, bytes(4))
        out = await cpu.allocate(1, dtypes.int32)
        cpu.launch(prog, out, vals=(flag.handle, 1 << 62))  # never opened: spins until the process ends
        stored = await disk.allocate(1, dtypes.int32)
        transfer(stored, out)  # waits for the kernel: cannot finish
        print("submitted", flush=True)

    anyio.run(main, sys.argv[1])
    """
).format(gate=GATE)


def test_work_that_cannot_finish_is_named_at_exit_and_the_process_still_ends(tmp_path: Path) -> None:
    proc = run(STUCK, str(tmp_path / "stuck.bin"), env={"ARUNTIME_WAIT_TIMEOUT": "1"})
    assert proc.returncode == 0 and proc.stdout.strip() == "submitted", proc.stderr
    assert "aruntime at exit: work in flight on CPU did not finish and is dropped" in proc.stderr
    assert "CPU compute queue: 1 op(s) submitted and 0 held" in proc.stderr  # the kernel
    # the transfer behind it waits on the copy queue with the same 1 s timeout, which runs out just before or just
    # after the exit's wait on the compute queue: named then as a failure nobody awaited, or as in flight there
    failed = "1 op(s) on CPU failed and nobody awaited them; the first: transfer 4 B CPU->DISK:" in proc.stderr
    assert failed or "CPU copy queue: 1 op(s) submitted and 0 held" in proc.stderr, proc.stderr
    assert proc.elapsed < 30  # type: ignore[attr-defined]  # bounded by the timeout, not the kernel


def test_ctrl_c_stops_the_wait_at_exit_which_says_what_it_waits_for(tmp_path: Path) -> None:
    # Ctrl-C raises KeyboardInterrupt as in a terminal, also where the suite runs with SIGINT ignored (a background
    # job, nohup), which a child would inherit
    script = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + STUCK
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "stuck.bin")],
        env={**os.environ, "ARUNTIME_WAIT_TIMEOUT": "600"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    watchdog = threading.Timer(60, proc.kill)  # a wait that never says what it waits for fails, not hangs
    watchdog.start()
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().strip() == "submitted"
        notice = ""
        while "aruntime at exit: waiting" not in notice:  # after a moment in the exit's wait
            line = proc.stderr.readline()
            assert line, "the process ended, or was killed, without saying what the exit waits for"
            notice += line
        assert "waiting up to 600 s for the work in flight on CPU: CPU compute queue: 1 op(s) submitted" in notice
        proc.send_signal(signal.SIGINT)
        interrupted = time.monotonic()
        _, rest = proc.communicate(timeout=30)
        elapsed = time.monotonic() - interrupted
    finally:
        watchdog.cancel()
        proc.kill()
    assert proc.returncode == 0, rest
    assert "work in flight on CPU did not finish and is dropped: CPU compute queue: 1 op(s) submitted" in rest
    assert "(interrupted by Ctrl-C)" in rest
    assert elapsed < 5, f"the process took {elapsed:.1f} s to end after Ctrl-C"

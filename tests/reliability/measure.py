"""What the reliability tests measure the process by."""

from __future__ import annotations


def rss() -> int:
    """This process's resident set size in bytes (Linux: /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096

"""One writer per results shard: the operating-system lock a run holds on its output directory (see
:mod:`.runner`'s docstring), which ``pack`` and ``drop`` hold too."""

from __future__ import annotations

import contextlib
import os


class OutputDirInUse(ValueError):
    """Another process is writing to the same output directory (and shard)."""


_HELD_LOCKS: dict = {}  # lock path -> [FileLock, depth]: the lock is re-entrant within a process


def lock_path(output_dir: str, rank: int = 0) -> str:
    return os.path.join(os.path.abspath(output_dir), f".kvpress-phase-rank{rank}.lock")


@contextlib.contextmanager
def output_lock(output_dir: str, rank: int = 0):
    """Hold the lock of ``output_dir``'s shard ``rank``, or raise :class:`OutputDirInUse` at once.

    An operating-system file lock (``flock`` through ``filelock``): it is released when the holder exits, even when
    it is killed, so a stale lock file never blocks a resume. Re-entrant within one process.
    """
    from filelock import FileLock, Timeout

    path = lock_path(output_dir, rank)
    held = _HELD_LOCKS.get(path)
    if held is None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        lock = FileLock(path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise OutputDirInUse(
                f"output directory {output_dir!r} is in use by another run (lock {path}); wait for it to finish "
                "or use another --output-dir"
            ) from None
        held = _HELD_LOCKS[path] = [lock, 0]
    held[1] += 1
    try:
        yield
    finally:
        held[1] -= 1
        if held[1] == 0:
            del _HELD_LOCKS[path]
            held[0].release()

"""Writing files whole or not at all: the one atomic-write helper (edit, chat sessions,
calibration profiles) and the directory fsync that makes a rename durable (also used by
model pulls, which stream into a `.partial` file of their own)."""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_atomic(path: str | Path, data: bytes | str, mode: int | None = None,
                 before_replace: Callable[[], None] | None = None, *, follow_symlinks: bool = True) -> Path:
    """Write via a temp file in the same directory, fsync, then rename over `path`;
    text is written as UTF-8. Returns the path written (a symlink's target).

    At every moment `path` holds either the old or the new content in full. `mode`:
    permission bits for the new file (default: the existing file's, else 0o666 under
    the umask, as open() would give). A symlink is followed: its target is replaced,
    the link kept; with `follow_symlinks=False` the link itself is replaced by the file
    and what it pointed at is never written (a backup name someone may have planted).
    `before_replace` runs after the fsync, just before the rename."""
    if follow_symlinks:
        target = Path(os.path.realpath(path))
    else:  # the directory resolved, the name itself not
        target = Path(os.path.realpath(Path(path).parent)) / Path(path).name
    if isinstance(data, str):
        data = data.encode("utf-8")
    if mode is None:
        mode = _mode_for(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        if before_replace is not None:
            before_replace()
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def _mode_for(target: Path) -> int:
    """The existing file's permission bits, else (no file, or a link not followed)
    0o666 under the umask."""
    try:
        st = target.lstat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISLNK(st.st_mode):
        return stat.S_IMODE(st.st_mode)
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in `path` durable; best effort (some filesystems,
    and Windows, refuse to fsync a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)

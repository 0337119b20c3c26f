"""Moving entries out of ``objects/`` without ever going through a link.

Hazard (issue 11): any member of a shared store can replace a fan-out
directory (``objects/ab``) with a symlink to somewhere else after gc or verify
scanned it.  A path-based ``rename("objects/ab/<name>", ...)`` would then
follow that link and move (gc: delete; verify --repair: quarantine) a file
outside the store.  So ``objects/`` and each fan-out directory are opened with
``O_NOFOLLOW | O_DIRECTORY`` and entries are renamed relative to those
descriptors: the last component of a rename is never followed, and a
directory that is now a link (or a file) is refused, not followed.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from types import TracebackType
from typing import Dict, Optional, Tuple, Type

__all__ = ["ObjectDirs"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# What opening a directory that is gone, a symlink or not a directory gives.
_REFUSED = (errno.ENOENT, errno.ELOOP, errno.ENOTDIR)


class ObjectDirs:
    """``objects/`` and its fan-out directories, each opened once on first use, never through a link.

    Use as a context manager (closes every descriptor).
    """

    def __init__(self, objdir: Path) -> None:
        self.objdir = objdir
        """The ``objects/`` directory of a store."""
        self._top: Optional[int] = None
        self._top_tried = False
        self._fans: Dict[str, Optional[int]] = {}

    def top(self) -> Optional[int]:
        """A descriptor of ``objects/`` itself; ``None`` if it is missing or not a real directory."""
        if not self._top_tried:
            self._top_tried = True
            try:
                self._top = os.open(self.objdir, _DIR_FLAGS)
            except OSError as e:
                if e.errno not in _REFUSED:
                    raise
        return self._top

    def fan(self, name: str) -> Optional[int]:
        """A descriptor of ``objects/<name>``; ``None`` if it is gone or is not a real directory."""
        if name not in self._fans:
            top = self.top()
            fd: Optional[int] = None
            if top is not None:
                try:
                    fd = os.open(name, _DIR_FLAGS, dir_fd=top)
                except OSError as e:
                    if e.errno not in _REFUSED:
                        raise
            self._fans[name] = fd
        return self._fans[name]

    def locate(self, path: os.PathLike[str] | str) -> Tuple[Optional[int], str]:
        """``(directory fd, entry name)`` for an entry one or two levels under ``objects/``.

        The fd is ``None`` when the directory holding it is gone or has become
        a link: the entry must then be left alone.
        """
        rel = os.path.relpath(os.fspath(path), self.objdir)
        parts = rel.split(os.sep)
        if len(parts) == 1 and parts[0] not in ("", ".", ".."):
            return self.top(), parts[0]
        if len(parts) == 2 and parts[0] not in (".", "..") and parts[1] not in ("", ".", ".."):
            return self.fan(parts[0]), parts[1]
        raise ValueError(f"{path} is not an entry of {self.objdir}")

    def close(self) -> None:
        """Close every descriptor opened so far."""
        for fd in self._fans.values():
            if fd is not None:
                os.close(fd)
        self._fans.clear()
        if self._top is not None:
            os.close(self._top)
            self._top = None
        self._top_tried = False

    def __enter__(self) -> ObjectDirs:
        return self

    def __exit__(self, et: Optional[Type[BaseException]], ev: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

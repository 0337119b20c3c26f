"""The exception hierarchy of casstore.

Every error casstore raises on purpose is a :class:`CasstoreError`.  Where a
builtin exception already means the same thing, the subclass inherits it too,
so ``except LookupError`` or ``except ValueError`` in caller code keeps working.
Messages say what happened, to which digest, path or name, and what to do.
"""

from __future__ import annotations

import errno

__all__ = [
    "CasstoreError",
    "ObjectNotFoundError",
    "ManifestNotFoundError",
    "MissingNodeError",
    "NameExistsError",
    "InvalidDigestError",
    "AmbiguousDigestError",
    "InvalidInputError",
    "InvalidTypeError",
    "IntegrityError",
    "FrozenError",
    "LockTimeout",
    "LockCycleError",
    "StoreFormatError",
    "ReadOnlyError",
    "BackendError",
    "RemoteConflictError",
    "CacheIndexError",
    "CompressedObjectError",
    "DiskFullError",
    "NetworkTimeout",
]


class CasstoreError(Exception):
    """Root of every error raised by casstore."""


class ObjectNotFoundError(CasstoreError, LookupError):
    """No object (or name) exists under the digest or name asked for."""


class ManifestNotFoundError(ObjectNotFoundError):
    """No head or pin has the name asked for, or no version of it matches ``NAME~N`` / ``NAME@<hex>``.

    Also an :class:`ObjectNotFoundError` (and a ``LookupError``), which missing names raised before.
    """


class MissingNodeError(ObjectNotFoundError):
    """A manifest version is in the store but an object its tree needs (a node or a bundle of nodes) is not.

    ``digest`` is that object's hex digest: ``verify`` reports it missing; pulling the version again from a
    remote that has it brings it back.
    """

    def __init__(self, message: str, digest: str) -> None:
        super().__init__(message)
        self.digest = digest
        """Hex digest of the missing object."""


class NameExistsError(CasstoreError, FileExistsError):
    """A name that must not exist does (``rename`` onto an existing head or pin without ``force``)."""


class InvalidDigestError(CasstoreError, ValueError):
    """A digest string is malformed: wrong algorithm, length or characters."""


class AmbiguousDigestError(InvalidDigestError):
    """A digest prefix matches more than one object; give more hex digits."""


class InvalidInputError(CasstoreError, ValueError):
    """An argument has the right type but an unacceptable value."""


class InvalidTypeError(CasstoreError, TypeError):
    """An argument has the wrong type (for example ``put`` given a ``str``)."""


class IntegrityError(CasstoreError):
    """Stored bytes do not hash to the digest they are stored under."""


class FrozenError(CasstoreError):
    """An attempt to change something frozen (a pin, a frozen manifest or cache)."""


class LockTimeout(CasstoreError, TimeoutError):
    """A lock was not acquired within the timeout; the message names the lock file."""


class LockCycleError(LockTimeout):
    """The thread asking for a lock holds it already (a derive ``fn`` that derives or edits its own
    name, or a chain of derives that comes back to it): it could never be acquired, so this is raised
    at once instead of waiting forever."""


class StoreFormatError(CasstoreError):
    """A path is not a casstore store, or its format is newer than this library."""


class ReadOnlyError(CasstoreError, PermissionError):
    """A write was attempted on a store (or file) that cannot be written."""


class BackendError(CasstoreError, OSError):
    """The storage backend failed (I/O error, unreachable server, bad credentials)."""


class DiskFullError(CasstoreError, OSError):
    """No space (or quota) left where casstore was writing.

    Nothing was half-published: the staged file is removed, and the store is
    fully usable again once space is freed (``casstore gc``, ``store.limit``).
    ``errno`` is ``ENOSPC`` (or ``EDQUOT``), as the ``OSError`` it replaces.
    """

    def __init__(self, message: str, err: int = errno.ENOSPC) -> None:
        super().__init__(err, message)

    def __str__(self) -> str:
        return str(self.strerror)


class NetworkTimeout(BackendError, TimeoutError):
    """A transfer made no progress within its per-read timeout, or did not finish by its deadline."""


class RemoteConflictError(BackendError):
    """A ref on a remote moved (or was created) by someone else since it was read.

    Raised when a push loses a compare-and-swap race or the remote head has
    diverged, and when a pin with the same name already names another version
    (pins never move).  For a head: pull (which merges), then push again.
    """


class CompressedObjectError(CasstoreError, ValueError):
    """A raw path was asked for an object that is stored compressed."""


class FileChangedError(CasstoreError):
    """A file kept changing while ``add`` read it (retried, then reported; never stored mixed).

    Stop the program writing into the folder, or leave that file out with an exclude glob.
    """


class CacheIndexError(InvalidInputError, IndexError):
    """An index cache index outside ``0 .. length-1`` (also an ``IndexError``, as sequences raise)."""

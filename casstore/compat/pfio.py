"""pfio's file caches on :class:`casstore.IndexCache`: switch with one import line.

::

    from pfio.cache import FileCache, MultiprocessFileCache          # before
    from casstore.compat.pfio import FileCache, MultiprocessFileCache  # after

The constructors, methods and return values are pfio 2.x's (``put`` returns False when
frozen or full, ``get`` None for a missing index, ``preserve`` False for a name that
exists unless ``overwrite``, ``preload`` False for a missing name, ``cache_size_limit``
freezes the cache once reached, ``do_pickle``, ``dir``, ``verbose``, ...).  Underneath,
the cache is an :class:`~casstore.IndexCache` in a casstore store at ``<dir>/casstore``:

* records are checked (a damaged byte raises :class:`~casstore.IntegrityError`, pfio
  returns it), every process may put at any time (no fsync per put), and a crash never
  leaves a half-written cache under a name;
* ``preserve(name)`` pins the frozen cache in that store under ``name`` (no copy), and
  ``preload(name)`` maps it again; what was preserved is content-addressed, verifiable
  (``casstore --store <dir>/casstore cache verify NAME``) and collected by gc once unpinned.

Differences, all documented in docs/index-cache.md ("Switching from pfio"): preserved
caches live in the store, not as ``<dir>/<name>`` files (pfio's own preserved files are
not read), pinned under the name percent-encoded where a pin name may not hold a character
(``train:v1`` is ``train%3Av1``: :func:`_pin_name`); ``preload`` refuses a preserved cache of
another length (pfio returns True and serves it); ``trace`` is accepted and ignored; an
``IntegrityError`` replaces silently damaged data.  As in pfio, ``close`` leaves ``dir`` as it found it when nothing was
preserved: the store ``<dir>/casstore`` is removed by the process that created it, once
no other cache uses it and it holds no pin, object or live cache (see :class:`_StoreUse`).
"""

from __future__ import annotations

import errno
import fcntl
import io
import logging
import numbers
import os
import pickle
import secrets
import shutil
import warnings
from types import MethodType
from typing import Any, Callable, Dict, Optional

from .._layout import BAD, LOCKS, OBJECTS, REFS, TMP
from ..cache import DEFAULT_VERIFY, IndexCache
from ..errors import (
    DiskFullError,
    FrozenError,
    InvalidInputError,
    InvalidTypeError,
    ObjectNotFoundError,
    StoreFormatError,
)
from ..refs import validate_name
from ..store import Store, open_store

__all__ = ["FileCache", "MultiprocessFileCache", "ReadOnlyFileCache", "STORE_DIR", "INDEX_BYTES"]

STORE_DIR = "casstore"
"""Name of the casstore store created inside ``dir`` (unless ``store=`` is given)."""
INDEX_BYTES = 16
"""Bytes per index that ``cache_size_limit`` counts on top of the data, as pfio's file does."""
USERS_LOCK = "compat-pfio.lock"
"""File under the store's ``locks/`` on which every cache that opened ``<dir>/casstore`` holds a shared flock."""

# Store roots this process created (mkdir succeeded) -> its pid.  Only the creator removes
# a store, and a forked child inherits this dict with its parent's pid, so it never does.
_CREATED: Dict[str, int] = {}
_RETRIES = 50

log = logging.getLogger("casstore.compat.pfio")

# Frozen files already warned about in this process (see _warn_foreign_pickles): once each.
_WARNED_FOREIGN: set[str] = set()


def _warn_foreign_pickles(cache: IndexCache, name: str) -> None:
    """Log once per file when ``do_pickle`` preloads a cache whose bytes another user wrote.

    Hazard (docs/security.md, "Pickled caches"): ``do_pickle=True`` unpickles every record,
    and unpickling runs code (``__reduce__``), so whoever can write or re-pin a preserved
    cache in a shared store runs code in this process.  Verification does not help: the
    hash covers the attacker's bytes.  This is pfio's API and stays; the warning is a
    hint, not a defence (a cache pulled from a remote is owned by this user whoever
    wrote it).  The owner of the frozen file is who published those bytes; root is not
    warned about (root can run code as anyone anyway).
    """
    path = cache.path
    if path is None:
        return
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return
    me = os.geteuid()
    if owner in (me, 0) or str(path) in _WARNED_FOREIGN:
        return
    _WARNED_FOREIGN.add(str(path))
    log.warning("do_pickle=True preloads cache %r (%s), written by uid %d, not by this user (uid %d): "
                "unpickling its records runs any code they hold; preload only caches you trust "
                "(verification proves integrity, not intent; docs/security.md)", name, path, owner, me)


class _StoreUse:
    """One cache's use of the store ``<dir>/casstore`` that it opened itself (not ``store=``).

    pfio leaves ``dir`` as it found it after ``close`` when nothing was preserved
    (pfio's ``test_cleanup``).  Removing a store is dangerous, so it happens only when
    all of these hold: this process created the directory (``os.mkdir`` succeeded here:
    exactly one process does); this is that process, not a forked or spawned child;
    no other cache uses the store (each holds a shared ``flock`` on ``locks/compat-pfio.lock``
    while open, and the remover needs an exclusive one without waiting); and the store
    holds no pin, head, object, temp file or quarantined file, i.e. nothing was ever
    published into it.  The remover renames the root aside before deleting it, and an
    opener checks after taking its shared lock that the lock file it holds is still the
    one at ``<root>/locks`` (else it retries): a cache never starts in a store being removed.
    """

    __slots__ = ("root", "store", "fd", "pid")

    def __init__(self, root: str) -> None:
        self.root = root
        """The store directory."""
        self.pid = os.getpid()
        """The process that opened this use (a forked child only closes its copy of the descriptor)."""
        for _ in range(_RETRIES):
            try:
                os.mkdir(root)
                _CREATED[root] = self.pid
            except FileExistsError:
                pass
            self.store = open_store(root)
            fd = self._attach()
            if fd >= 0:
                self.fd = fd
                return
        raise InvalidInputError(  # pragma: no cover - another process removes the store in a tight loop
            f"could not open the cache store {root}: it was removed {_RETRIES} times while opening; retry")

    def _attach(self) -> int:
        """A descriptor of the users' lock file holding a shared flock, or -1 if the store was removed meanwhile."""
        path = os.path.join(self.root, LOCKS, USERS_LOCK)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        except FileNotFoundError:
            return -1
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a remover holds it (microseconds)
            st, now = os.fstat(fd), os.stat(path)
            if (st.st_ino, st.st_dev) == (now.st_ino, now.st_dev):
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        return -1

    def __reduce__(self) -> Any:
        return (_StoreUse._reattach, (self.root, self.store))

    @staticmethod
    def _reattach(root: str, store: Store) -> _StoreUse:
        """In a spawned worker: hold a shared lock too (never the remover: this process did not create it)."""
        use = _StoreUse.__new__(_StoreUse)
        use.root, use.store, use.pid = root, store, os.getpid()
        use.fd = use._attach()
        return use

    def release(self) -> None:
        """Drop this use; the creating process removes the store if nothing was ever kept in it."""
        fd, self.fd = self.fd, -1
        if fd < 0:
            return
        try:
            # A forked child shares its parent's open file (and so its flock): it only
            # closes its own descriptor, which leaves the lock held for the parent.
            if os.getpid() == self.pid and _CREATED.get(self.root) == self.pid and self._unused(fd):
                aside = os.path.join(os.path.dirname(self.root), f".{STORE_DIR}.{secrets.token_hex(6)}.removing")
                os.rename(self.root, aside)  # atomic: an opener now finds no store, or a new lock file
                _CREATED.pop(self.root, None)
                shutil.rmtree(aside, ignore_errors=True)
        except OSError:  # pragma: no cover - e.g. a read-only dir: leaving the store is always safe
            pass
        finally:
            os.close(fd)

    def _unused(self, fd: int) -> bool:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # another cache (any process) has the store open
        for sub in (OBJECTS, REFS, TMP, BAD):
            for _dirpath, _dirs, files in os.walk(os.path.join(self.root, sub)):
                if files:
                    return False  # something was published or is being written: keep everything
        return True


# Characters that a pfio cache name (a file name in ``dir``) may hold and a casstore pin name may
# not (':' marks digests, '~' and '@' versions, backslash and control characters are refused),
# plus '%' itself, which escapes them.
_ESCAPED = frozenset(":~@%\\") | frozenset(map(chr, [*range(0x20), *range(0x7F, 0xA0)]))


def _pin_name(name: str) -> Optional[str]:
    """The pin name under which the cache pfio would call ``name`` is kept, or None if there is none.

    Hazard (found by a bug hunt): names pfio takes (``cache-2024-01-01T12:00:00``, ``train:v1``,
    ``~x``, a backslash) were refused with ``InvalidInputError``.  A pfio user expects the name that
    worked before to work, so each such character becomes ``%XX`` (its code in hex), '%' too: the
    map is plain percent-encoding, so two names never share a pin, and a name without any of these
    characters (almost every name) is its own pin name, as ``casstore cache verify NAME`` shows it.
    Only a name whose escaped form is still not a name has none: one that would leave ``dir`` in
    pfio (``../x``, ``/abs``), an empty segment, a lone surrogate, or too long; pfio could not find
    such a cache either.  A non-str raises, as pfio's ``os.path.join`` does.
    """
    try:
        return validate_name(_escape(name))
    except InvalidInputError:
        return None


def _escape(name: str) -> str:
    if not isinstance(name, str):
        raise InvalidTypeError(f"a cache name must be a str, not {type(name).__name__}")
    if _ESCAPED.isdisjoint(name):
        return name
    return "".join(f"%{ord(c):02X}" if c in _ESCAPED else c for c in name)


def _invalid_name(name: str) -> InvalidInputError:
    """Why ``name`` has no pin name (:func:`_pin_name` returned None), as the error preserve raises."""
    try:
        validate_name(_escape(name))
    except InvalidInputError as e:
        why = str(e)
    else:  # pragma: no cover - only called when _pin_name found no pin name
        why = "invalid"
    return InvalidInputError(f"cannot preserve a cache named {name!r:.200}: {why}; choose a name that stays "
                             "inside dir (no '..' or leading '/'), like pfio's 'my-cache'")


# (store root, name, preserved length, length) already warned about by a preload (_warn_length): once each.
_WARNED_LENGTH: set[tuple[str, str, int, int]] = set()


def _warn_length(store: Store, name: str, preserved: int, length: int) -> None:
    key = (str(store.root), name, preserved, length)
    if key in _WARNED_LENGTH:
        return
    _WARNED_LENGTH.add(key)
    warnings.warn(f"not preloading cache {name!r} from {store.root}: it was preserved with length {preserved}, "
                  f"this cache has length {length}; the dataset changed, so fill this cache again and preserve "
                  "it under a new name (or preload with the preserved length)", RuntimeWarning, stacklevel=3)


class _UnpicklingGet:
    """What a ``do_pickle`` cache's ``get`` is bound to (see :meth:`_PfioCache._bind`); picklable."""

    __slots__ = ("cget",)

    def __init__(self, cget: Callable[[int], Optional[bytes]]) -> None:
        self.cget = cget

    def get(self, i: int) -> object:
        """The record at ``i`` unpickled (the ``get`` that a pickled ``cache.get`` becomes)."""
        data = self.cget(i)
        return pickle.loads(data) if data else data


def _closed_get(i: int) -> object:
    """``get`` of a closed cache: None, as pfio."""
    return None


def _default_cache_path() -> str:
    """pfio's default: ``$XDG_CACHE_HOME/pfio``, else ``$HOME/.cache/pfio``."""
    base = os.getenv("XDG_CACHE_HOME")
    if not base:
        base = os.path.join(os.getenv("HOME", ""), ".cache")
    return os.path.join(base, "pfio")


def _check_length(length: int) -> int:
    if isinstance(length, bool) or not isinstance(length, numbers.Integral):
        raise TypeError(f"length must be an int, not {type(length).__name__}")
    if length <= 0 or length >= 2 ** 64:
        raise InvalidInputError("length has to be between 0 and 2^64")
    return int(length)


def _check_limit(limit: Optional[int]) -> Optional[int]:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, numbers.Real) or limit < 0):
        raise InvalidInputError(
            "cache_size_limit has to be either None, zero (both indicate unlimited) or larger than 0. "
            f"{limit!r} is specified."
        )
    return limit


class _PfioCache:
    """What pfio's ``FileCache`` and ``MultiprocessFileCache`` share; not public."""

    _what = "cache"

    def __init__(self, length: int, *, do_pickle: bool, dir: Optional[str], cache_size_limit: Optional[int],
                 verbose: bool, trace: bool, store: Optional[Store], verify: str) -> None:
        self.length = _check_length(length)
        """Number of indices."""
        self.do_pickle = bool(do_pickle)
        """``put`` pickles and ``get`` unpickles."""
        self.cache_size_limit = _check_limit(cache_size_limit)
        """Bytes (data plus 16 per index, as pfio counts) after which the cache stops accepting puts."""
        self.verbose = bool(verbose)
        """Print what happens, as pfio does."""
        self.trace = bool(trace)
        """Accepted for pfio compatibility; casstore records no profiler events."""
        self.dir = _default_cache_path() if dir is None else os.fspath(dir)
        """The directory that holds the store (``<dir>/casstore``) unless ``store=`` was given."""
        self._use: Optional[_StoreUse] = None
        if store is None:
            os.makedirs(self.dir, exist_ok=True)
            self._use = _StoreUse(os.path.join(os.path.realpath(self.dir), STORE_DIR))
            store = self._use.store
        self.store = store
        """The casstore store that holds the cache and the preserved caches."""
        self.verify = verify
        """IndexCache's ``verify=`` mode for this cache and the caches it preloads."""
        self.closed = False
        """True after :meth:`close`."""
        self._full = False  # cache_size_limit was reached: pfio freezes the cache then
        max_bytes: Optional[int] = None
        if self.cache_size_limit:  # pfio: None and 0 both mean unlimited
            max_bytes = max(0, int(self.cache_size_limit) - INDEX_BYTES * self.length)
        try:
            self._cache = IndexCache(store, self.length, max_bytes=max_bytes, verify=verify)
        except BaseException:
            if self._use is not None:
                self._use.release()
            raise
        self._bind()
        if self.verbose:
            print(f"created cache in {self._cache.store.root}: {self._cache!r}")

    @property
    def index_cache(self) -> IndexCache:
        """The :class:`~casstore.IndexCache` underneath (live, frozen or preloaded)."""
        return self._cache

    def __len__(self) -> int:
        """The cache's length (number of indices)."""
        return self.length

    @property
    def frozen(self) -> bool:
        """True once no more puts are accepted: preserved, preloaded, or ``cache_size_limit`` reached."""
        return self._full or self._cache.frozen

    def get(self, i: int) -> object:
        """The data at ``i`` (unpickled with ``do_pickle``), or None if there is none or the cache is closed.

        Raises ``IndexError`` for an index outside ``0 .. length-1`` and
        :class:`~casstore.IntegrityError` for damaged data (pfio would return it).
        (Each instance replaces this method by :meth:`_bind`'s function: the same result
        with no wrapper frame per call.)
        """
        if self.closed:
            return None
        data = self._cache.get(i)
        if self.do_pickle and data:
            return pickle.loads(data)
        return data

    def _bind(self) -> None:
        """Point this instance's ``get`` at the IndexCache's own get (its frozen fast path once frozen).

        The hot path of a training loop: a method that checks ``closed`` and ``do_pickle``
        and then calls the IndexCache costs a second Python frame per sample.  Rebound on
        every change of state (preserve, preload, close); a put after freeze needs none.
        """
        get: Callable[[int], object]
        if self.closed:
            get = _closed_get
        elif self.do_pickle:
            cget, loads = self._cache.get, pickle.loads

            def unpickling_get(_self: object, i: int) -> object:
                data = cget(i)
                return loads(data) if data else data

            # Hazard (found by a bug hunt): a bare closure here cannot be pickled, so
            # ``Pool().map(cache.get, ...)`` failed with do_pickle=True (pfio's get pickles).
            # Bound to an _UnpicklingGet and named "get", it pickles as a bound method does,
            # as ``getattr(helper, "get")``: the helper's own method in the other process.  The
            # closure stays the hot path (the method costs ~20 ns more per call, measured), and
            # the helper, not this cache, is bound: no cycle keeps a dropped cache's files open.
            unpickling_get.__name__ = "get"
            get = MethodType(unpickling_get, _UnpicklingGet(cget))
        else:
            get = self._cache.get
        self.__dict__["get"] = get  # an instance attribute shadows the method

    def __getstate__(self) -> Dict[str, Any]:
        st = dict(self.__dict__)
        st.pop("get", None)  # a closure: rebound in the worker
        return st

    def __setstate__(self, st: Dict[str, Any]) -> None:
        self.__dict__.update(st)
        self._bind()

    def put(self, i: int, data: object) -> bool:
        """Store ``data`` at ``i`` (pickled with ``do_pickle``); True if stored.

        False if the cache is closed or frozen, ``i`` already has data, or the data would
        pass ``cache_size_limit`` (which then freezes the cache, as in pfio).  A full disk
        warns (``RuntimeWarning``) and returns False, as in pfio.
        """
        if self.closed or self._full:
            return False
        raw = pickle.dumps(data) if self.do_pickle else data
        try:
            ok = self._cache.put(i, raw)  # type: ignore[arg-type]  # IndexCache checks the type
        except FrozenError:
            return False
        except OSError as e:  # DiskFullError is one
            if isinstance(e, DiskFullError) or e.errno in (errno.ENOSPC, errno.EDQUOT):
                warnings.warn(str(e), RuntimeWarning, stacklevel=2)
                return False
            raise
        if not ok and self.cache_size_limit and i not in self._cache:
            self._full = True  # refused for size, not as a duplicate: stop accepting, as pfio does
        return ok

    def get_and_cache(self, i: int, backend_get: Callable[[int], object]) -> object:
        """``get(i)``; if there is nothing, ``backend_get(i)``, put it in the cache, and return it."""
        data = self.get(i)
        if data is None:
            data = backend_get(i)
            self.put(i, data)
        return data

    def _name_exists(self, name: str) -> bool:
        return name in self.store.pins()

    def preserve(self, name: str, overwrite: bool = False) -> bool:
        """Freeze the cache and keep it in the store under ``name``; True on success.

        False (nothing done) if ``name`` already exists, unless ``overwrite`` (the name
        then moves to this cache).  No data is copied; the name appears only once the
        cache is durable, so a crash leaves the name absent or complete.  Afterwards
        the cache accepts no puts and reads from the preserved object.
        """
        pin = _pin_name(name)
        if pin is None:
            raise _invalid_name(name)
        if not overwrite and self._name_exists(pin):
            if self.verbose:
                print(f'Specified cache named "{name}" already exists in {self.store.root}')
            return False
        self._cache.preserve(pin, overwrite=overwrite)
        self._bind()  # frozen now: the lock-free read path
        return True

    def preload(self, name: str) -> bool:
        """Replace this (empty) cache with the one preserved as ``name``; True on success.

        False if the cache is already frozen or there is no such name.  The preserved
        cache is mapped read-only and checked as ``verify`` says; no puts afterwards.
        """
        if self.frozen:
            if self.verbose:
                print(f"Failed to preload the cache from {name}: The cache is already frozen.")
            return False
        pin = _pin_name(name)
        try:
            if pin is None:  # e.g. "../x": pfio finds no file of that name in dir and returns False
                raise ObjectNotFoundError(f"{name!r} is not a cache name")
            opened = IndexCache.open(self.store, pin, verify=self.verify)
        except ObjectNotFoundError:
            if self.verbose:
                print(f"Failed to preload the cache from {name}: not found in {self.store.root}")
            return False
        if opened.length != self.length:
            # Hazard (found by a bug hunt): a preserved cache of another length was served as
            # this one: len() said one thing and get() another (a longer dataset raised on its
            # new indices, a shorter one read past its own length).  A length that differs is
            # another dataset, so refuse as for a missing name: the usual "if not preload:
            # fill and preserve" then rebuilds it.  pfio returns True here (it keeps no
            # length) and then serves a prefix or fails on get (docs/index-cache.md).
            preserved = opened.length
            opened.close()
            if self.verbose:
                print(f"Failed to preload the cache from {name}: its length is {preserved}, not {self.length}")
            _warn_length(self.store, name, preserved, self.length)
            return False
        if self.do_pickle:
            _warn_foreign_pickles(opened, name)
        old, self._cache = self._cache, opened
        old.close()
        self._bind()
        return True

    def close(self) -> None:
        """Release the cache.  The process that created it also removes its live files, and
        ``<dir>/casstore`` too if it created that and nothing was preserved in it and no
        other cache uses it (``dir`` is then as before, as in pfio); in a forked or
        spawned worker ``close`` removes nothing."""
        if not self.closed:
            self.closed = True
            self._bind()
            self._cache.close()
            if self._use is not None:
                self._use.release()

    def __enter__(self) -> _PfioCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._cache!r}>"


class FileCache(_PfioCache):
    """pfio's ``FileCache`` (``pfio.cache.FileCache``) on :class:`~casstore.IndexCache`.

    Same constructor and behaviour as pfio 2.x; see the module docstring for the
    differences.  ``store=`` (a :class:`~casstore.Store`) and ``verify=`` (IndexCache's
    verify mode, default ``"once"``) are casstore's additions.
    """

    def __init__(self, length: int, multithread_safe: bool = False, do_pickle: bool = False,
                 dir: Optional[str] = None, cache_size_limit: Optional[int] = None, verbose: bool = False,
                 trace: bool = False, *, store: Optional[Store] = None, verify: str = DEFAULT_VERIFY) -> None:
        self._multithread_safe = bool(multithread_safe)
        super().__init__(length, do_pickle=do_pickle, dir=dir, cache_size_limit=cache_size_limit,
                         verbose=verbose, trace=trace, store=store, verify=verify)

    @property
    def multiprocess_safe(self) -> bool:
        """As pfio reports it: True once frozen (the IndexCache underneath is safe across processes anyway)."""
        return self.frozen

    @property
    def multithread_safe(self) -> bool:
        """The ``multithread_safe`` given to the constructor (the IndexCache is thread-safe anyway)."""
        return self._multithread_safe

    def __enter__(self) -> FileCache:
        return self


class MultiprocessFileCache(_PfioCache):
    """pfio's ``MultiprocessFileCache`` on :class:`~casstore.IndexCache`.

    Hand it to DataLoader workers (fork or spawn); every worker puts and gets at once.
    ``preserve`` and ``preload`` are refused in a worker (``RuntimeError``), as in pfio.
    Unlike pfio, a put takes microseconds (no fsync per put) and a crash leaves no
    partial record.
    """

    def __init__(self, length: int, do_pickle: bool = False, dir: Optional[str] = None,
                 cache_size_limit: Optional[int] = None, verbose: bool = False, trace: bool = False, *,
                 store: Optional[Store] = None, verify: str = DEFAULT_VERIFY) -> None:
        self._master_pid = os.getpid()
        super().__init__(length, do_pickle=do_pickle, dir=dir, cache_size_limit=cache_size_limit,
                         verbose=verbose, trace=trace, store=store, verify=verify)

    @property
    def multiprocess_safe(self) -> bool:
        """Always True."""
        return True

    @property
    def multithread_safe(self) -> bool:
        """Always True."""
        return True

    def preserve(self, name: str, overwrite: bool = False) -> bool:
        """As :meth:`FileCache.preserve`; only in the process that created the cache."""
        if self._master_pid != os.getpid():
            raise RuntimeError("Cannot preserve a cache in a worker process")
        return super().preserve(name, overwrite)

    def preload(self, name: str) -> bool:
        """As :meth:`FileCache.preload`; only in the process that created the cache."""
        if self.frozen:
            return super().preload(name)  # False
        if self._master_pid != os.getpid():
            raise RuntimeError("Cannot preload a cache in a worker process")
        return super().preload(name)

    def close(self) -> None:
        """Release the cache; in a worker only that worker's descriptors (the files stay for the others)."""
        super().close()

    def __enter__(self) -> MultiprocessFileCache:
        return self


class ReadOnlyFileCache:
    """pfio's ``ReadOnlyFileCache``: a preserved cache, memory-mapped, for any number of processes.

    ``ReadOnlyFileCache(length, dir=d).preload(name)``; ``put`` and ``preserve`` raise
    ``io.UnsupportedOperation``.  ``preload`` of a missing name raises
    ``FileNotFoundError`` and of a cache with missing indices ``RuntimeError``, as in pfio.
    """

    def __init__(self, length: int, do_pickle: bool = False, dir: Optional[str] = None, verbose: bool = False,
                 *, store: Optional[Store] = None, verify: str = DEFAULT_VERIFY) -> None:
        self.length = _check_length(length)
        """Number of indices."""
        self.do_pickle = bool(do_pickle)
        """``get`` unpickles."""
        self.verbose = bool(verbose)
        """Accepted for pfio compatibility."""
        self.dir = _default_cache_path() if dir is None else os.fspath(dir)
        """The directory that holds the store (``<dir>/casstore``) unless ``store=`` was given."""
        self._store = store
        self.verify = verify
        """IndexCache's ``verify=`` mode."""
        self.closed = True
        """True until :meth:`preload` succeeds, and after :meth:`close`."""
        self._cache: Optional[IndexCache] = None

    def __len__(self) -> int:
        """The cache's length."""
        return self.length

    @property
    def frozen(self) -> bool:
        """Always True."""
        return True

    @property
    def multiprocess_safe(self) -> bool:
        """Always True."""
        return True

    @property
    def multithread_safe(self) -> bool:
        """Always True."""
        return True

    def get(self, i: int) -> object:
        """The data at ``i`` (unpickled with ``do_pickle``); None before :meth:`preload` or after close."""
        c = self._cache
        if self.closed or c is None:
            return None
        if isinstance(i, numbers.Integral) and not 0 <= i < self.length:
            raise IndexError(f"index {i} out of range ([0, {self.length - 1}])")
        data = c.get(i)
        if self.do_pickle and data:
            return pickle.loads(data)
        return data

    def put(self, i: int, data: object) -> bool:
        """Always raises ``io.UnsupportedOperation``."""
        raise io.UnsupportedOperation("read only cache")

    def preserve(self, name: str, overwrite: bool = False) -> bool:
        """Always raises ``io.UnsupportedOperation``."""
        raise io.UnsupportedOperation("read only")

    def get_and_cache(self, i: int, backend_get: Callable[[int], object]) -> object:
        """``get(i)``, else ``backend_get(i)`` (nothing can be cached)."""
        data = self.get(i)
        return backend_get(i) if data is None else data

    def preload(self, name: str) -> bool:
        """Map the cache preserved as ``name``; True.  ``FileNotFoundError`` if there is none."""
        store = self._store
        if store is None:
            root = os.path.join(self.dir, STORE_DIR)
            try:
                store = self._store = open_store(root, create=False)
            except (StoreFormatError, OSError) as e:  # no store there yet: nothing was ever preserved
                raise FileNotFoundError(errno.ENOENT, f"no preserved cache {name!r}: {e}", root) from None
        pin = _pin_name(name)
        try:
            if pin is None:  # e.g. "../x": not a cache name, so there is no such cache (pfio: ENOENT)
                raise ObjectNotFoundError(f"{name!r} is not a cache name")
            c = IndexCache.open(store, pin, verify=self.verify)
        except ObjectNotFoundError:
            raise FileNotFoundError(errno.ENOENT, f"no preserved cache named {name!r} in {store.root}") from None
        count, length = c.count, c.length
        if length != self.length:
            # Hazard (found by a bug hunt): a preserved cache of another length was served as
            # this one (see _PfioCache.preload).  This class reports a failed preload by raising,
            # as pfio's does (pfio itself raises struct.error for a longer length, serves a
            # prefix for a shorter one): RuntimeError, as for a cache with missing indices.
            c.close()
            raise RuntimeError(f"Cache length mismatch: {name!r} was preserved with length {length}, this cache "
                               f"has length {self.length}; open it with ReadOnlyFileCache({length}, ...) or "
                               "preserve a cache of this length")
        if count < length:
            c.close()
            raise RuntimeError(f"Incomplete cache file: {name!r} has {count} of {length} indices")
        if self.do_pickle:
            _warn_foreign_pickles(c, name)
        if self._cache is not None:
            self._cache.close()
        self._cache = c
        self.closed = False
        return True

    def close(self) -> None:
        """Release the map."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        self.closed = True

    def __enter__(self) -> ReadOnlyFileCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

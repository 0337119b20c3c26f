"""Refs on an S3-compatible object store: ``<prefix>refs/heads/<name>`` and ``<prefix>refs/pins/<name>``.

A ref key holds one line, ``blake3:<64 hex>\\n`` (the format of local ref
files).  The token of a ref is its ETag, and refs move by the server's
conditional writes, checked atomically by the server:

* create: ``PUT`` with ``If-None-Match: *`` -- of any number of racing
  creators exactly one succeeds;
* move: ``PUT`` with ``If-Match: <ETag read before>`` -- of any number of
  writers that read the same ETag exactly one succeeds;
* remove: ``DELETE`` with ``If-Match``.

Hazards: a ref key may hold anything (a hand edit, another tool): content
that is not a digest is a :class:`~casstore.errors.StoreFormatError` naming
the key, never a guess; :meth:`S3Refs.inspect` hands such a key out as a
:class:`DamagedRef` with the ETag of the very bytes read, so a push with force
can replace it with ``If-Match`` on that ETag (:meth:`S3Refs.replace_damaged`)
-- only if the key still holds those bytes.  A listed key whose name casstore would refuse
(``validate_name``; e.g. ``refs/heads/run\t1``, which releases before control characters were
refused could write) is listed as damaged too, naming the key and what to do (delete or rename it).
Hazard (found by a bug hunt): such keys were skipped, so remote gc (whose roots are :meth:`S3Refs.scan`)
deleted the closure of the version such a key names, and pull and ``remote ls`` hid it.  Only an empty
folder marker (a key ending in ``/``, as S3 consoles create) is skipped: it names nothing.  ETags of equal content
are equal (MD5), so a ref moved A -> B -> A between a read and a
compare-and-swap looks unchanged, as a local ref does: both compare contents.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

from .._layout import REFS
from ..digest import Digest
from ..errors import CasstoreError, InvalidDigestError, InvalidInputError, StoreFormatError
from ..objects.s3 import S3Connection
from .base import KINDS, Ref, RefListing, RefStore
from .local import validate_name

__all__ = ["S3Refs", "DamagedRef"]

_MAX_REF = 256  # a ref is ~72 bytes; read no more than this from a hostile key


@dataclass(frozen=True, slots=True)
class DamagedRef:
    """A ref key that holds no digest, as read: where it is, what it holds, and its ETag then."""

    where: str
    """The remote, as messages name it."""
    url: str
    """``s3://bucket/<prefix>refs/<kind>/<name>``."""
    shown: str
    """What it holds, for messages (``content b'...'`` or ``more than 256 bytes``)."""
    token: str
    """The ETag of the damaged bytes read (``""`` if the server sent none): the ``If-Match`` of a repair."""

    @property
    def what(self) -> str:
        """``<remote>: ref s3://... is damaged (content b'...')``: what is wrong, for messages that go on."""
        return f"{self.where}: ref {self.url} is damaged ({self.shown})"

    @property
    def message(self) -> str:
        """What is wrong and what to do (the message of the :class:`StoreFormatError` :meth:`S3Refs.read` raises)."""
        return f"{self.what}; push the name again with force, or delete the key"


class S3Refs(RefStore):
    """Heads and pins of a remote, moved by ``If-Match`` / ``If-None-Match`` (see the module docstring)."""

    def __init__(self, connection: S3Connection, prefix: str) -> None:
        self.connection = connection
        """The bucket and client (shared with the remote's objects)."""
        self.prefix = prefix
        """Key prefix (``""`` or ending in ``/``)."""

    def key(self, kind: str, name: str) -> str:
        """``<prefix>refs/heads/<name>`` or ``<prefix>refs/pins/<name>``."""
        return f"{self.prefix}{REFS}/{_kind(kind)}/{validate_name(name)}"

    def inspect(self, kind: str, name: str) -> Union[None, Ref, DamagedRef]:
        """The ref and its ETag, ``None`` if the key does not exist, or a :class:`DamagedRef` if it holds no digest."""
        key = self.key(kind, name)
        got = self.connection.get(key, limit=_MAX_REF, action="reading ref")
        if got is None:
            return None
        body = got.data
        try:
            if body is None:
                raise InvalidDigestError("too long")
            d = Digest.parse(body.decode("ascii").strip())
        except (UnicodeDecodeError, InvalidDigestError):
            shown = "more than 256 bytes" if body is None else f"content {body[:80]!r}"
            return DamagedRef(self.connection.where, self.connection.s3_url(key), shown, got.etag)
        return Ref(d, got.etag)

    def read(self, kind: str, name: str) -> Optional[Ref]:
        """The ref and its ETag, or ``None``; :class:`StoreFormatError` if the key holds no digest."""
        got = self.inspect(kind, name)
        if isinstance(got, DamagedRef):
            raise StoreFormatError(got.message)
        return got

    def replace_damaged(self, kind: str, name: str, new: Digest, damaged: DamagedRef) -> bool:
        """Set ``name`` to ``new`` only if its key still holds the damaged bytes ``damaged`` was read from.

        ``If-Match`` on the ETag of the GET that found the damage, not on one from a later HEAD: a
        HEAD after the GET could return the ETag of a ref someone repaired (or moved) meanwhile, and
        the write would then overwrite their valid ref unseen.  ETags are MD5s of the content (or
        of its parts), so a valid ref body written since does not carry the damaged bytes' ETag.  ``False`` when the key
        changed or vanished since it was read.
        """
        if not damaged.token:
            raise StoreFormatError(f"{damaged.what}; the server sent no ETag for it, so it "
                                   "cannot be replaced conditionally: delete the key, then push again")
        key = self.key(kind, name)
        return self.connection.put(key, f"{new}\n".encode(), if_match=damaged.token, content_type="text/plain",
                                   action="replacing damaged ref") is not None

    def compare_and_swap(self, kind: str, name: str, new: Optional[Digest], expected: Optional[Ref]) -> bool:
        """Set ``name`` to ``new`` (``None`` removes it) only if it is still ``expected``.

        ``expected=None``: only if it does not exist (``If-None-Match: *``);
        otherwise only if the key still has ``expected.token`` as its ETag
        (``If-Match``).  ``False`` when another writer won.
        """
        key = self.key(kind, name)
        conn = self.connection
        if new is None:
            if expected is None:
                return conn.head(key) is None  # "remove it if it does not exist": nothing to do
            return conn.delete(key, if_match=expected.token)
        body = f"{new}\n".encode()
        if expected is None:
            return conn.put(key, body, create_only=True, content_type="text/plain", action="writing ref") is not None
        return conn.put(key, body, if_match=expected.token, content_type="text/plain",
                        action="writing ref") is not None

    def delete(self, kind: str, name: str) -> bool:
        """Remove a ref whatever it names; ``False`` if it did not exist."""
        key = self.key(kind, name)
        if self.connection.head(key) is None:
            return False
        return self.connection.delete(key)

    def names(self, kind: str) -> List[str]:
        """Every valid ref name of a kind, from the listing, sorted (:meth:`scan` also reports the keys
        whose names are not valid, as damaged)."""
        return self._listed(kind)[0]

    def _listed(self, kind: str) -> Tuple[List[str], Dict[str, str]]:
        """(valid names, sorted; {listed name that is not valid: what is wrong and what to do})."""
        base = f"{self.prefix}{REFS}/{_kind(kind)}/"
        out: List[str] = []
        bad: Dict[str, str] = {}
        for key, size in self.connection.list(base):
            name = key[len(base):]
            try:
                out.append(validate_name(name))
            except CasstoreError as e:
                if size == 0 and name.endswith("/"):
                    continue  # an empty folder marker (S3 consoles make them): it names no version
                # Never skipped (module docstring): what it names is unknown, so gc must not run without it.
                bad[name] = (f"{self.connection.where}: ref key {self.connection.s3_url(key)!r} has a name casstore "
                             f"cannot use ({e}); delete that key, or rename it to a valid name with an S3 tool "
                             "(e.g. `aws s3 mv`), then run again")
        return sorted(out), dict(sorted(bad.items()))

    def clashing(self, kind: str, name: str) -> Optional[str]:
        """A name of the kind there that cannot exist in one store beside ``name`` (one is a prefix folder
        of the other: ``x`` and ``x/y``), or ``None``.  A HEAD per parent folder and one listing request.

        Hazard (found by a bug hunt): such names can exist on a remote (two machines push them) but not
        in a store, so no store could pull both; a push checks before it creates a name.
        """
        name = validate_name(name)
        base = f"{self.prefix}{REFS}/{_kind(kind)}/"
        parts = name.split("/")
        for i in range(1, len(parts)):
            if self.connection.head(base + "/".join(parts[:i])) is not None:
                return "/".join(parts[:i])
        under, _ = self.connection.list_page(f"{base}{name}/")
        names = [k[len(base):] for k, size in under if not (size == 0 and k.endswith("/"))]  # (folder markers)
        return names[0] if names else None

    def scan(self, kind: str) -> RefListing:
        """Every ref of a kind, readable and damaged (:class:`RefListing`; read in parallel).  A key whose
        name is not a valid name is damaged too (the module docstring says why)."""
        names, bad = self._listed(kind)
        if not names:
            return RefListing({}, bad)

        def one(name: str) -> Union[Optional[Ref], str]:
            try:
                return self.read(kind, name)
            except StoreFormatError as e:
                return str(e)

        out: Dict[str, Digest] = {}
        damaged: Dict[str, str] = dict(bad)
        with ThreadPoolExecutor(min(self.connection.workers, len(names)), thread_name_prefix="casstore-refs") as ex:
            got: List[Tuple[str, Union[Optional[Ref], str]]] = list(zip(names, ex.map(one, names), strict=True))
        for name, ref in got:
            if isinstance(ref, str):
                damaged[name] = ref
            elif ref is not None:  # (None: deleted since the listing)
                out[name] = ref.digest
        return RefListing(out, dict(sorted(damaged.items())))

    def __repr__(self) -> str:
        return f"S3Refs('s3://{self.connection.bucket}/{self.prefix}')"


def _kind(kind: str) -> str:
    if kind not in KINDS:
        raise InvalidInputError(f"ref kind must be one of {', '.join(KINDS)}, not {kind!r}")
    return kind

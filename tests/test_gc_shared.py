"""Shared multi-user stores: mode bits, and another uid of the same group using the store for real.

We run as root, so the "other user" is a child process that drops to uid 4322 / gid 4321
(no /etc/passwd entry needed) with umask 022 -- the umask that would make a naive store
private.  The store lives under $TMPDIR (default /tmp) in a 0o755 directory the child can traverse.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import textwrap
import time
from pathlib import Path
from typing import Any, Dict

from conftest import PRELOAD, run_as_nobody, run_py

import casstore

GID, UID = 4321, 4322

OTHER_USER = PRELOAD + """
import json, os, sys, time
from casstore.errors import CasstoreError
os.setgroups([{gid}])
os.setgid({gid})
os.setuid({uid})
os.umask(0o022)
assert os.geteuid() == {uid}
root = sys.argv[1]
out = {{}}
try:
    s = casstore.open(root)
    d = s.put(b"written by the second user")
    out["reput"] = str(s.put(b"written by root"))      # dedupe hit on root's object
    with s.edit("team/exp") as m:                      # lock file and ref created by root
        m["b"] = d
    with s.edit("team/u2/new") as m:                   # new nested ref and lock directories
        m["c"] = d
    plan = s.plan_gc(grace="1h")
    res = plan.execute()                               # deletes root's old garbage
    out["deleted"] = [str(x) for x in res.deleted]
    rep = s.verify()
    out["verify_ok"] = rep.ok
    out["summary"] = rep.summary()
    out["ok"] = True
except (CasstoreError, OSError) as e:
    out["ok"] = False
    out["error"] = f"{{type(e).__name__}}: {{e}}"
print("RESULT " + json.dumps(out))
"""


def other_user(root: Path) -> Dict[str, Any]:
    r = run_py(textwrap.dedent(OTHER_USER.format(gid=GID, uid=UID)), str(root))
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert line, r.stdout + r.stderr
    out: Dict[str, Any] = json.loads(line[-1][len("RESULT "):])
    return out


def make_store(parent: Path, shared: bool) -> casstore.Store:
    root = parent / ("team" if shared else "private")
    root.mkdir()
    os.chown(root, -1, GID)  # the team's group, as an admin would: chgrp team DIR
    old = os.umask(0o022)
    try:
        s = casstore.open(root, shared=shared)
        d = s.put(b"written by root")
        with s.edit("team/exp") as m:
            m["a"] = d
        s.pin("team-pin", "team/exp")
        junk = s.put(b"root's old garbage")
        t = time.time() - 7200
        os.utime(s.path(junk), (t, t))
    finally:
        os.umask(old)
    return s


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_shared_store_is_group_writable_and_usable_by_another_user(world_dir: Path) -> None:
    s = make_store(world_dir, shared=True)
    root = s.root
    assert s.config.shared
    dirs = [root, root / "objects", root / "objects" / "00", root / "objects" / "ff", root / "refs",
            root / "refs" / "heads", root / "refs" / "heads" / "team", root / "refs" / "pins", root / "locks",
            root / "locks" / "names", root / "tmp", root / "bad", root / "state"]
    for d in dirs:
        assert mode(d) == 0o2775, (d, oct(mode(d)))
        assert os.stat(d).st_gid == GID, d
    locks = root / "locks"
    for lock in [locks / "gc.lock", locks / "gc.gate", s.refs.lock("team/exp").path]:
        assert mode(lock) == 0o664 and os.stat(lock).st_gid == GID, (lock, oct(mode(lock)))
    obj = s.path(s.manifest("team/exp")["a"].digest)
    assert mode(obj) == 0o444 and os.stat(obj).st_gid == GID
    ref = root / "refs" / "heads" / "team" / "exp"
    assert mode(ref) == 0o444 and os.stat(ref).st_gid == GID

    out = other_user(root)
    assert out["ok"], out
    assert out["verify_ok"], out["summary"]
    assert len(out["deleted"]) == 1  # root's garbage, deleted by the other user
    man = s.manifest("team/exp")
    assert set(man) == {"a", "b"} and s.get(man["b"].digest) == b"written by the second user"
    assert s.manifest("team/u2/new")["c"].digest == man["b"].digest
    # what the other user created is shared too
    d = root / "refs" / "heads" / "team" / "u2"
    assert mode(d) == 0o2775 and os.stat(d).st_gid == GID and os.stat(d).st_uid == UID, d
    lock = s.refs.lock("team/u2/new").path
    assert mode(lock) == 0o664 and os.stat(lock).st_uid == UID and os.stat(lock).st_gid == GID
    new_obj = s.path(man["b"].digest)
    assert mode(new_obj) == 0o444 and os.stat(new_obj).st_gid == GID and os.stat(new_obj).st_uid == UID
    assert s.verify().ok


def test_private_store_is_not_writable_by_the_group(world_dir: Path) -> None:
    """The control: without --shared the same child cannot even take the edit lock."""
    s = make_store(world_dir, shared=False)
    assert mode(s.root / "objects") & 0o020 == 0
    out = other_user(s.root)
    assert not out["ok"]
    assert "Permission" in out["error"] or "ReadOnly" in out["error"], out


def test_gc_by_a_member_leaves_others_objects_when_tmp_is_sticky(world_dir: Path) -> None:
    """Found by a bug hunt: with tmp/ made sticky (an admin's habit for shared dirs), a member's gc moved
    another user's object into tmp/, could neither unlink it nor move it back, and failed "unexpectedly"."""
    root = world_dir / "s"
    s = casstore.open(root)
    d = s.put(b"junk" * 100)  # garbage, owned by root
    old = time.time() - 7200
    for dirpath, _dirs, files in os.walk(root / "objects"):
        for f in files:
            os.utime(os.path.join(dirpath, f), (old, old))
    subprocess.run(["chmod", "-R", "a+rwX", str(root)], check=True)
    os.chmod(root / "tmp", 0o1777)
    out = run_as_nobody("""
        import casstore
        s = casstore.open(sys.argv[1])
        r = s.plan_gc(grace=0).execute()
        out = {"deleted": [str(x) for x in r.deleted], "skipped": {str(k): v for k, v in r.skipped.items()}}
    """, str(root))
    assert out["deleted"] == [] and "tmp/ is sticky" in out["skipped"][str(d)]
    assert s.get(d) == b"junk" * 100 and not [p for p in (root / "tmp").iterdir() if p.name.endswith(".gc")]
    assert s.plan_gc(grace=0).execute().deleted == (d,)  # its owner's gc collects it

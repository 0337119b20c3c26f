"""Sharing a store through remotes on S3-compatible object stores: push, pull, merge, remotes config.

The feature's modules:

``remotes``   :class:`Remote` (``remote.objects`` + ``remote.refs`` over one
              connection) and the store's ``remotes.toml``.
``transfer``  moving verified objects between a local and a remote object store,
              the batch publisher of pulls, :class:`TransferReport`.
``merge``     history walks and the three-way merge of two versions.
``push``      objects first, refs last by compare-and-swap.
``pull``      versions decoded (and refused if hostile) before anything is stored,
              objects verified, refs last; :func:`fetch_object`; ``lazy=True``: refs and
              manifests only.
``readthrough`` a remote as a store's upstream (:class:`RemoteUpstream`): missing
              objects fetched, verified, on first read.
``share``     :class:`S3Share`: a remote as fetch/derive use it to work once across
              machines (look-up, bring home, publish, a lease per name).
``markers``   push and gc markers (with heartbeats) that keep remote gc and pushes apart.
``remote_gc`` remote gc plans (:class:`RemoteGCPlan`), execution, ``du --remote`` (:func:`remote_usage`).

The S3 transport itself is in the layers below: :mod:`casstore.objects.s3`
and :mod:`casstore.refs.s3`.
"""

from __future__ import annotations

from .merge import merge_versions
from .pull import fetch_object, pull
from .push import push
from .readthrough import RemoteUpstream
from .remote_gc import RemoteGCPlan, RemoteGCResult, RemoteNameUsage, RemoteUsage, plan_remote_gc, remote_usage
from .remotes import (
           Remote,
           add_remote,
           check_endpoint_url,
           get_remote,
           load_remotes,
           load_upstream,
           parse_url,
           remove_remote,
           resolve_remote,
           set_upstream,
)
from .share import S3Share, share
from .transfer import TransferReport

__all__ = ["Remote", "TransferReport", "push", "pull", "fetch_object", "merge_versions", "load_remotes",
           "add_remote", "remove_remote", "get_remote", "RemoteUpstream", "load_upstream", "set_upstream",
           "resolve_remote", "check_endpoint_url", "parse_url", "S3Share", "share", "RemoteGCPlan",
           "RemoteGCResult", "RemoteUsage", "RemoteNameUsage", "plan_remote_gc", "remote_usage"]

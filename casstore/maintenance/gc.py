"""TRANSITIONAL shim."""
from ..gc import GCPlan, LimitResult, Usage, limit, plan_gc, plan_limit, usage  # noqa: F401

"""Admission: the quota store and its value objects. Never imports Starlette or gateway/.

`MemoryStore` (one process) and `RedisStore` (`policies.redis_store`, shared by replicas)
implement `Store`; both pass the one suite in tests/policies.
"""

from policies.memory import MemoryStore
from policies.quotas import LIMITS, Decision, Quotas, RateHeaders
from policies.store import DuplicateRequest, Store, StoreError, StoreUnavailable

__all__ = ["LIMITS", "Decision", "DuplicateRequest", "MemoryStore", "Quotas", "RateHeaders",
           "Store", "StoreError", "StoreUnavailable"]

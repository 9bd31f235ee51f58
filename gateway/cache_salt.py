"""The per-tenant ``cache_salt`` the gateway sends upstream: an HMAC under a secret it holds.

    salt(tenant) = hex(HMAC-SHA256(key, "sluice/cache-salt/v2\\0" + tenant_id))[:32]

The engine roots each request's prefix-cache hash chain in its salt, so tenants never share
a KV block and none can time another's cache hits. That holds only while nobody else can
compute a tenant's salt: with the key secret (and the backend behind its own API key), a
tenant id alone gives nothing. 32 hex characters, the shape the backend has always taken.

The key is ``$SLUICE_CACHE_SALT_KEY`` (at least 32 characters; ``sluice up`` makes one per
run). Every replica of one deployment must hold the same key, or each salts a tenant
differently and their requests stop sharing prefix-cache hits. Without it:

- one replica (``store.replicas: 1``): a random key for this process, with a warning (the
  backend's cached prefixes are not reused after a gateway restart);
- ``store.replicas > 1``: the gateway refuses to start (``ConfigError``), since the replicas
  would silently lose each other's hits;
- no model gets ``cache_salt`` (no ``cache_salt`` capability): the key is unused, no warning.

Rotating the key changes every salt: the backend's cached prefixes stop matching (a cold
cache until they are recomputed), and nothing else changes.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from .config import GatewayConfig
from .errors import ConfigError

log = logging.getLogger("sluice.gateway.cache_salt")

SALT_KEY_ENV = "SLUICE_CACHE_SALT_KEY"
MIN_KEY_CHARS = 32
_DOMAIN = b"sluice/cache-salt/v2\0"


@dataclass(slots=True, frozen=True)
class CacheSalter:
    """Derives each tenant's salt; ``shared`` when the key came from the environment."""

    key: bytes = field(repr=False)
    shared: bool = True

    @classmethod
    def for_process(cls) -> CacheSalter:
        """A random key, good for this process only."""
        return cls(secrets.token_bytes(32), shared=False)

    def salt(self, tenant_id: str) -> str:
        mac = hmac.new(self.key, _DOMAIN + tenant_id.encode(), hashlib.sha256)
        return mac.hexdigest()[:32]


def salter_from_env(config: GatewayConfig, env: Mapping[str, str]) -> CacheSalter:
    """The salter ``config`` runs with, by the rules in the module docstring."""
    value = env.get(SALT_KEY_ENV)
    if value:
        if len(value) < MIN_KEY_CHARS:
            raise ConfigError(f"{SALT_KEY_ENV} is {len(value)} characters; it needs at least "
                              f"{MIN_KEY_CHARS} (e.g. `openssl rand -hex 32`)")
        return CacheSalter(value.encode())
    if not any("cache_salt" in m.capabilities for m in config.models):
        return CacheSalter.for_process()
    if config.store.replicas > 1:
        raise ConfigError(f"{SALT_KEY_ENV} is not set: with store.replicas = "
                          f"{config.store.replicas} every replica needs the same one, or "
                          f"they do not share prefix-cache hits (e.g. `openssl rand -hex 32`)")
    log.warning("%s is not set: a random key for this process salts the prefix cache; "
                "another replica, or this one restarted, does not share its cache hits",
                SALT_KEY_ENV)
    return CacheSalter.for_process()

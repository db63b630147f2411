"""The Redis and Redis Cluster tier: URLs (`url`), the store (`client`), frames of a state
(`frames`) and frames received straight into the payload buffer (`wire`)."""

from kvrag.stores.redis.client import RedisStore
from kvrag.stores.redis.url import redis_store_from_url

__all__ = ["RedisStore", "redis_store_from_url"]

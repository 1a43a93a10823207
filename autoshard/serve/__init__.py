"""``autoshard serve``: the plan service (HTTP JSON API, SQLite or PostgreSQL store, solve workers).

Many jobs ask, replicas solve (sharing one database), plans persist. See :mod:`autoshard.serve.app` for
the endpoints and :class:`autoshard.client.PlanClient` for the client.
"""

from autoshard.serve.app import ServiceConfig, create_app

__all__ = ["ServiceConfig", "create_app"]

"""The request routers living in this process, for the ingress to read (``/cluster/status``,
aggregated ``/metrics``).

A separate module on purpose: Ray Serve pickles the router's *module* by value when it ships
the router class to the processes that hold handles, so state kept there would be a copy per
process and a lock would not even pickle. This module is imported by reference.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()
_LOCK = threading.Lock()


def register(router: Any) -> None:
    with _LOCK:
        _ROUTERS.add(router)


def routers(app_name: str | None = None, deployment_name: str | None = None) -> list[Any]:
    """The routers of this process (for one app / deployment when given)."""
    with _LOCK:
        out = list(_ROUTERS)
    return [
        r
        for r in out
        if (app_name is None or r.app_name == app_name)
        and (deployment_name is None or r.deployment_name == deployment_name)
    ]

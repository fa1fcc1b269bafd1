"""Whether a service this run depends on can be reached (the Hugging Face Hub, an MLflow tracking server), decided
by opening one connection. Asked through their own clients, both retry for minutes first (docs/traps.md)."""

from __future__ import annotations

import socket
import urllib.request
from time import monotonic
from urllib.parse import urlparse

# Long enough for two lost connection attempts (the kernel resends at 1 s and 3 s) on a lossy link; what a firewall
# that drops a service's packets costs a process.
CONNECT_TIMEOUT_S = 5
# A run's start asks several times (model, datasets, push): the first answer serves them all. A process that runs
# again later (the Python API in a notebook) asks again: the service may be up by then.
REMEMBERED_S = 60
_answers: dict[tuple[str, int], tuple[float, str | None]] = {}


def no_connection(host: str, port: int) -> str | None:
    """Why no connection to host:port opens ("huggingface.co does not resolve: no network"), or None."""
    asked_at, answer = _answers.get((host, port), (float("-inf"), None))
    if monotonic() - asked_at < REMEMBERED_S:
        return answer
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
        answer = None
    except socket.gaierror:
        answer = f"{host} does not resolve: no network"
    except TimeoutError:
        answer = f"no connection to {host}:{port} within {CONNECT_TIMEOUT_S} s: a firewall?"
    except OSError as error:
        answer = f"no connection to {host}:{port}: {error.strerror or error}"
    _answers[(host, port)] = (monotonic(), answer)
    return answer


def unreachable(url: str) -> str | None:
    """Why no connection to url's host opens, or None. Behind a proxy (HTTPS_PROXY, HTTP_PROXY, not bypassed by
    NO_PROXY, as huggingface_hub's and MLflow's clients read them) the proxy connects, not this machine: None."""
    parts = urlparse(url)
    proxies = urllib.request.getproxies()
    if (proxies.get(parts.scheme) or proxies.get("all")) and not urllib.request.proxy_bypass(parts.hostname):
        return None
    return no_connection(parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))

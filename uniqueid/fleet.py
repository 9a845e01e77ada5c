"""``uniqueid.fleet``, the documented home of ``call_all``, ``on_each`` and
``Calls`` (one route on many servers at once): they live in
``uniqueid.http.fleet``, beside the rest of the HTTP client."""

from .http.fleet import *  # noqa: F403
from .http.fleet import __all__  # noqa: F401

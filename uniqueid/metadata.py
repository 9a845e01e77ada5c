"""``uniqueid.metadata``, the documented home of ``MetadataGroup`` (vLLM's
``StatelessProcessGroup`` without torch): it lives in
``uniqueid.m2n.metadata``, beside the rest of M2N's join."""

from .m2n.metadata import *  # noqa: F403
from .m2n.metadata import __all__  # noqa: F401

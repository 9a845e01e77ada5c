"""``uniqueid.m2n_agreement``, the documented home of vLLM's ``nccl_m2n``
agreements and digests: they live in ``uniqueid.m2n.agreement``, beside
the rest of M2N's join."""

from .m2n.agreement import *  # noqa: F403
from .m2n.agreement import __all__  # noqa: F401

"""What every sender shares: the session and its push transaction
(admission, Ctrl-C, deadlines, failures, ``reconnect``, ``close``), the
servers' update routes, the fleet, the routes of trainer processes, the
NCCL staging and feeds the broadcasting backends share, an asynchronous
push's snapshot, settings, errors and figures; ``tensors/``: from a pytree
to the wire's tensors. Nothing here imports a backend."""

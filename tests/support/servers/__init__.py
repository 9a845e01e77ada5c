"""Servers the tests push to or call: an independent vLLM receiver
(``memory_server``) over the in-memory link (``memory_link``), loopback
recorders and misbehaving peers (``recorder``, ``bad_http``), many
do-nothing servers (``idle_servers``), a completions server."""

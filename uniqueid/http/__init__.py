"""vLLM's routes over HTTP, without httpx: the process's one HTTP loop
(``transport``), the client of vLLM's weight-transfer routes (``client``),
server URLs (``url``) and one route on many servers at once (``fleet``).
The public names (``VLLMClient`` and its errors) are ``uniqueid``'s."""

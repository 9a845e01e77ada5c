"""vLLM's ``/v1/completions`` answers as the Tunix rollout reads them
(``jax_sender.integrations._completions``), without Tunix: each answer is
a real one of ``support.servers.completions_server`` over loopback HTTP,
one field changed to what vLLM never sends. The rollout holds token ids as
int32 arrays, as vLLM's model runner does: an id past that range is
refused with the typed protocol error, not a bare ``OverflowError`` from
numpy."""

from __future__ import annotations

import numpy as np
import pytest

from jax_sender.integrations import _completions as answers
from uniqueid import VLLMClient, VLLMProtocolError

from support.servers.completions_server import ROUTE, CompletionsServer

V, EOS, MAX_TOKENS = 16, 1, 4
PROMPTS = [[2, 3], [2, 4]]


def answered(mangle=None) -> dict:
    """A real answer to a generate-like request (token ids back), mangled."""
    server = CompletionsServer(vocab_size=V, eos_id=EOS, mangle=mangle)
    try:
        with VLLMClient(server.url) as client:
            return client.request("POST", ROUTE, json={
                "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                "return_token_ids": True, "return_tokens_as_token_ids": True})
    finally:
        server.close()


def read(answer: dict, sent: list[list[int]] | None) -> list[np.ndarray]:
    """Each choice's prompt and sampled ids, checked, as the int32 arrays
    the rollout lays them out in."""
    out = []
    for k, choice in enumerate(answers.ordered_choices(answer, len(PROMPTS), "http://h")):
        out.append(np.asarray(answers.prompt_ids(choice, None if sent is None else sent[k],
                                                 k, "http://h"), dtype=np.int32))
        out.append(np.asarray(answers.sampled_ids(choice, MAX_TOKENS, k, "http://h"),
                              dtype=np.int32))
    return out


def _first(field: str, value: int):
    def mangle(body: dict) -> dict:
        body["choices"][0][field][0] = value
        return body
    return mangle


@pytest.mark.parametrize("value", [2**40, 2**31, -1])
@pytest.mark.parametrize("field,sent", [("token_ids", PROMPTS), ("prompt_token_ids", None)])
def test_a_token_id_vllm_cannot_send_is_a_protocol_error(field, sent, value):
    """Before: 2**40 and 2**31 passed the check and escaped the rollout as a bare
    ``OverflowError`` from its int32 arrays (-1 was already refused)."""
    with pytest.raises(VLLMProtocolError) as e:
        read(answered(_first(field, value)), sent)
    assert e.value.route == ROUTE
    assert f"answered choice 0 with {field} [{value}" in str(e.value), str(e.value)
    assert "ints from 0 to 2147483647" in str(e.value)


def test_the_largest_int32_token_id_is_taken_exactly():
    ids = read(answered(_first("token_ids", 2**31 - 1)), PROMPTS)
    assert ids[1][0] == 2**31 - 1 and ids[0].tolist() == PROMPTS[0]

"""The unique-id codec: round trips and every rejection vLLM makes."""

import base64

import pytest
from hypothesis import given
from hypothesis import strategies as st

from uniqueid import B64_LENGTH, InitInfo, UniqueId, UniqueIdError, check_rendezvous_mode


def vllm_decode(text: str) -> bytes:
    """vLLM's decode_nccl_unique_id, for the unique-id branch."""
    decoded = base64.b64decode(text, validate=True)
    if len(decoded) != 128:
        raise ValueError("length")
    return decoded


def test_mint_encodes_like_vllm_expects():
    uid = UniqueId.mint()
    text = uid.to_b64()
    assert len(text) == B64_LENGTH == 172 and text.endswith("=") and not text.endswith("==")
    assert vllm_decode(text) == uid.raw
    assert UniqueId.from_b64(text) == uid


def test_never_printed():
    uid = UniqueId.mint()
    for shown in (repr(uid), str(uid), repr(InitInfo(nccl_unique_id_b64=uid.to_b64(),
                                                     rank_offset=1, world_size=2))):
        assert uid.to_b64()[:20] not in shown


@given(st.binary(min_size=128, max_size=128))
def test_round_trip_any_bytes(raw):
    assert UniqueId.from_b64(UniqueId(raw).to_b64()).raw == raw


def _urlsafe_only():
    # ids whose standard encoding contains + or /, so the URL-safe form differs
    return st.binary(min_size=128, max_size=128).filter(
        lambda b: "+" in base64.b64encode(b).decode() or "/" in base64.b64encode(b).decode())


@given(_urlsafe_only())
def test_urlsafe_alphabet_is_refused_like_vllm(raw):
    text = base64.urlsafe_b64encode(raw).decode()
    with pytest.raises(ValueError):
        vllm_decode(text)
    with pytest.raises(UniqueIdError, match="URL-safe"):
        UniqueId.from_b64(text)


@pytest.mark.parametrize("mutate,match", [
    (lambda t: t.rstrip("="), "padding"),
    (lambda t: t[:80] + "\n" + t[80:], "whitespace"),
    (lambda t: " " + t, "whitespace"),
    (lambda t: t[:-4], "must decode to 128 bytes"),
    (lambda t: t + "AAAA", "padding before its end"),
    (lambda t: t[:-1] + "A", "must decode to 128 bytes"),
    (lambda t: t[:10] + "*" + t[11:], "alphabet"),
    (lambda t: "", "empty"),
])
def test_every_rejection_names_its_rule(mutate, match):
    text = mutate(UniqueId.mint().to_b64())
    with pytest.raises(ValueError):
        vllm_decode(text)
    with pytest.raises(UniqueIdError, match=match):
        UniqueId.from_b64(text)


@given(st.text(max_size=200))
def test_fuzz_never_crashes_and_agrees_with_vllm(text):
    try:
        vllm_ok = vllm_decode(text)
    except (ValueError, TypeError):
        vllm_ok = None
    try:
        ours = UniqueId.from_b64(text).raw
    except UniqueIdError:
        ours = None
    assert ours == vllm_ok


def test_raw_length_checked():
    with pytest.raises(UniqueIdError):
        UniqueId(b"x" * 127)


def test_rendezvous_modes():
    b64 = UniqueId.mint().to_b64()
    assert check_rendezvous_mode(nccl_unique_id_b64=b64, master_address=None,
                                 master_port=None).to_b64() == b64
    assert check_rendezvous_mode(nccl_unique_id_b64=None, master_address="h",
                                 master_port=1) is None
    with pytest.raises(UniqueIdError, match="not both"):
        check_rendezvous_mode(nccl_unique_id_b64=b64, master_address="h", master_port=None)
    with pytest.raises(UniqueIdError, match="need nccl_unique_id_b64"):
        check_rendezvous_mode(nccl_unique_id_b64=None, master_address=None, master_port=None)
    with pytest.raises(UniqueIdError, match="need nccl_unique_id_b64"):
        check_rendezvous_mode(nccl_unique_id_b64="", master_address="h", master_port=None)

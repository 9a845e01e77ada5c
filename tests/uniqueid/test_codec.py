"""The unique-id codec: round trips and every rejection vLLM makes."""

import base64

import pytest
from hypothesis import given, settings
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
    text = UniqueId(raw).to_b64()
    assert text == base64.b64encode(raw).decode()  # standard, padded: what vLLM decodes
    assert UniqueId.from_b64(text).raw == raw


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


# Small changes to a good id's text: a character of another alphabet (or of the
# same: still an id, another one), padding added or taken away, whitespace,
# characters dropped or added.
_CHARS = st.sampled_from(list("AZaz09+/") + list("-_=*.~é") + [" ", "\n", "\t", "\r"])
_mutations = st.one_of(
    st.tuples(st.just("replace"), st.integers(0, 175), _CHARS),
    st.tuples(st.just("insert"), st.integers(0, 175), _CHARS),
    st.tuples(st.just("delete"), st.integers(0, 175), st.integers(1, 4)),
    st.tuples(st.just("strip padding"), st.just(0), st.just(0)),
    st.tuples(st.just("pad"), st.integers(1, 3), st.just(0)),
)


def _mutate(text: str, how: str, at, what) -> str:
    at = min(at, len(text))
    if how == "replace":
        return text[:at] + what + text[at + 1:]
    if how == "insert":
        return text[:at] + what + text[at:]
    if how == "delete":
        return text[:at] + text[at + what:]
    if how == "strip padding":
        return text.rstrip("=")
    return text + "=" * at


def _vllm_accepts(text: str) -> bytes | None:
    """vLLM's decode (``b64decode(validate=True)``, exactly 128 bytes) and the
    padding rule the codec states: whole 4-character groups, ``=`` only at the end."""
    try:
        raw = base64.b64decode(text, validate=True)
    except (ValueError, TypeError):
        return None
    if len(raw) != 128 or len(text) % 4 or "=" in text.rstrip("="):
        return None
    return raw


def test_a_good_id_changed_a_little_is_taken_exactly_when_vllm_takes_it():
    seen = {"taken": 0, "refused": 0}

    @settings(max_examples=400, deadline=None)
    @given(st.binary(min_size=128, max_size=128), st.lists(_mutations, max_size=3))
    def run(raw, mutations):
        text = base64.b64encode(raw).decode()
        for m in mutations:
            text = _mutate(text, *m)
        want = _vllm_accepts(text)
        try:
            got = UniqueId.from_b64(text).raw
        except UniqueIdError:
            got = None
        assert got == want, (text, mutations)
        seen["taken" if want is not None else "refused"] += 1

    run()
    total = sum(seen.values())  # both ways, in a fair share of the examples
    assert seen["taken"] >= 0.1 * total and seen["refused"] >= 0.1 * total, seen


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

"""Fuzzing the wire payloads (``uniqueid.wire``) against vLLM's rules, written out here.

Whatever ``from_payload`` accepts must re-serialise with ``to_payload`` to the
same payload, once vLLM's defaults are applied and the keys vLLM ignores are
dropped; whatever it refuses must be a ``ValueError`` in vLLM's words where
vLLM refuses too, or name the field where the library is deliberately
stricter than vLLM (JSON types, rank counts). The rules below are read from
vLLM 0.33.0 (``base.py``: parse_init_info / parse_update_info wrap a
``TypeError`` of ``cls(**payload)`` as ``ValueError("Invalid <what> for
<Engine>: ...")``; ``nccl_common.py``: NCCLWeightTransferInitInfo and
decode_nccl_unique_id; ``nccl_engine.py``: NCCLWeightTransferUpdateInfo;
``sparse_nccl_engine.py``: SparseNCCLWeightTransferUpdateInfo), plus the
[newer] ``use_load_plan``/``metadata`` and ``src`` keys; nothing here asks
the library what the answer should be.

Each mixed fuzz also counts its outcomes, so a generator that drifts into
producing only refusals (testing nothing but error paths) fails too.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from uniqueid import InitInfo, SparseUpdateInfo, UniqueId, UpdateInfo

GIB = 1024 * 1024 * 1024
DTYPES = ["int8", "uint8", "int32", "int64", "float16", "float32", "float64", "bfloat16",
          "float8_e4m3fn"]
# NCCLWeightTransferInitInfo's fields, with the [newer] load-plan keys.
INIT_KEYS = ("master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64",
             "packed", "packed_buffer_size_bytes", "packed_num_buffers", "use_load_plan",
             "metadata")
DENSE_KEYS = ("names", "dtype_names", "shapes", "src")
SPARSE_KEYS = ("names", "dtype_names", "shapes", "num_updates_list")
DENSE_ENGINE = "NCCLWeightTransferEngine"
SPARSE_ENGINE = "SparseNCCLWeightTransferEngine"  # vLLM names the class that parses


# ---- the expected outcome of a payload ------------------------------------

@dataclass
class Refused:
    """vLLM refuses: a ``ValueError`` whose text matches ``pattern``."""

    pattern: str


@dataclass
class Accepted:
    """vLLM accepts: the library re-serialises to ``payload``, or refuses
    naming one of ``stricter`` (rules of its own that vLLM does not check)."""

    payload: dict
    stricter: list[str] = field(default_factory=list)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _unknown(payload: dict, known: tuple[str, ...], what: str, engine: str) -> Refused | None:
    unknown = [k for k in payload if k not in known]
    if not unknown:
        return None
    # Python names the first unexpected keyword in call order; the library
    # names the first in sorted order (test_an_unknown_key_is_named_as_python_names_it).
    names = "|".join(re.escape(f"'{k}'") + "|" + re.escape(repr(k)) for k in unknown)
    return Refused(f"^Invalid {what} for {engine}: \\w+\\.__init__\\(\\) got an unexpected keyword "
                   f"argument ({names})$")


def _missing(payload: dict, required: tuple[str, ...], kind: str, what: str,
             engine: str) -> Refused | None:
    """The TypeError Python raises for missing required arguments, wrapped by vLLM."""
    missing = [k for k in required if k not in payload]
    if not missing:
        return None
    quoted = [f"'{k}'" for k in missing]
    listed = (quoted[0] if len(quoted) == 1 else f"{quoted[0]} and {quoted[1]}" if len(quoted) == 2
              else ", ".join(quoted[:-1]) + f", and {quoted[-1]}")
    plural = "argument" if len(missing) == 1 else "arguments"
    return Refused(f"^Invalid {what} for {engine}: \\w+\\.__init__\\(\\) missing {len(missing)} "
                   f"required {kind} {plural}: {re.escape(listed)}$")


class _NoLen(Exception):
    """``len()`` of a value that has none: vLLM's TypeError, wrapped."""

    def __init__(self, what: str, engine: str, value):
        super().__init__(f"^Invalid {what} for {engine}: object of type "
                         f"'{type(value).__name__}' has no len\\(\\)$")


def _len(value, what: str, engine: str) -> int:
    try:
        return len(value)
    except TypeError:
        raise _NoLen(what, engine, value) from None


def _same_size(key: str, got: int, n: int) -> Refused | None:
    """``__post_init__``'s check that a list is as long as ``names``."""
    if got != n:
        return Refused("^" + re.escape(f"`{key}` should be of the same size as `names`: "
                                       f"got {got} and {n}") + "$")
    return None


def _ill_typed_lists(payload: dict) -> list[str]:
    """Keys whose value is not the JSON vLLM's dataclasses declare (vLLM does
    not check; the library may refuse them)."""
    bad = []
    if not (isinstance(payload.get("names", []), list)
            and all(isinstance(n, str) for n in payload.get("names", []))):
        bad.append("names")
    if not (isinstance(payload.get("dtype_names", []), list)
            and all(isinstance(d, str) for d in payload.get("dtype_names", []))):
        bad.append("dtype_names")
    shapes = payload.get("shapes", [])
    if not (isinstance(shapes, list) and all(
            isinstance(s, list) and all(_is_int(d) for d in s) for s in shapes)):
        bad.append("shapes")
    return bad


def expect_init(payload) -> Refused | Accepted:
    """vLLM's worker parsing ``init_info`` (NCCLWeightTransferInitInfo(**payload))."""
    what = "init_info"
    if not isinstance(payload, dict):  # FastAPI refuses it first: the library's own words
        return Refused(f"^Invalid {what} for {DENSE_ENGINE}")
    refused = (_unknown(payload, INIT_KEYS, what, DENSE_ENGINE)
               or _missing(payload, ("rank_offset", "world_size"), "keyword-only", what,
                           DENSE_ENGINE))
    if refused:
        return refused
    # __post_init__ -> decode_nccl_unique_id (its ValueErrors are not wrapped)
    uid, address, port = (payload.get("nccl_unique_id_b64"), payload.get("master_address"),
                          payload.get("master_port"))
    if uid and (address is not None or port is not None):
        return Refused("pass nccl_unique_id_b64 OR master_address/master_port, not both")
    if not uid and (address is None or port is None):
        return Refused(re.escape(f"need nccl_unique_id_b64, or both master_address and "
                                 f"master_port (got master_address={address!r}, "
                                 f"master_port={port!r})"))
    if uid:
        try:
            decoded = base64.b64decode(uid, validate=True)
        except (ValueError, TypeError, binascii.Error):
            return Refused("nccl_unique_id_b64")  # the library names the rule broken
        if len(decoded) != 128:
            if isinstance(uid, str) and len(uid) % 4 == 0:
                return Refused(f"nccl_unique_id_b64 must decode to 128 bytes, got {len(decoded)}$")
            return Refused("nccl_unique_id_b64")
    # vLLM accepts. What it reads, its defaults applied: the rendezvous mode in
    # use, and metadata only with use_load_plan ([newer]).
    out = {"packed": False, "packed_buffer_size_bytes": GIB, "packed_num_buffers": 2, **payload}
    for key in (("master_address", "master_port") if uid else ("nccl_unique_id_b64",)):
        out.pop(key, None)
    if out.get("use_load_plan") is not True:
        stricter_plan = "use_load_plan" in out and out["use_load_plan"] is not False
        out.pop("use_load_plan", None)
        out.pop("metadata", None)
    else:
        stricter_plan = not payload.get("metadata")
    stricter = []
    ro, ws = payload["rank_offset"], payload["world_size"]
    if not (_is_int(ro) and ro >= 1):
        stricter.append("rank_offset")
    if not (_is_int(ws) and ws >= 2):
        stricter.append("world_size")
    elif _is_int(ro) and ws <= ro:
        stricter.append("world_size")
    if not isinstance(out["packed"], bool):
        stricter.append("packed")
    for key in ("packed_buffer_size_bytes", "packed_num_buffers"):
        if not (_is_int(out[key]) and out[key] >= 1):
            stricter.append(key)
    if stricter_plan:
        stricter.append("use_load_plan")
    return Accepted(out, stricter)


def expect_update(payload) -> Refused | Accepted:
    """vLLM's worker parsing a dense ``update_info`` (NCCLWeightTransferUpdateInfo(**payload))."""
    what = "update_info"
    if not isinstance(payload, dict):
        return Refused(f"^Invalid {what} for {DENSE_ENGINE}")
    refused = _unknown(payload, DENSE_KEYS, what, DENSE_ENGINE)
    if refused:
        return refused
    try:  # NCCLWeightTransferUpdateInfo.__post_init__, in its order
        n = _len(payload.get("names", []), what, DENSE_ENGINE)
        for key in ("dtype_names", "shapes"):
            refused = _same_size(key, _len(payload.get(key, []), what, DENSE_ENGINE), n)
            if refused:
                return refused
    except _NoLen as e:
        return Refused(str(e))
    out = {"names": [], "dtype_names": [], "shapes": [], **payload}
    stricter = _ill_typed_lists(payload)
    src = payload.get("src", 0)
    if not (_is_int(src) and src >= 0):  # [newer] vLLM checks it only when receiving
        stricter.append("src")
    elif src == 0:
        out.pop("src", None)  # the default: not sent, so vLLM 0.33.0 reads the payload
    return Accepted(out, stricter)


def expect_sparse(payload) -> Refused | Accepted:
    """vLLM's sparse worker parsing ``update_info`` (SparseNCCLWeightTransferUpdateInfo)."""
    what = "update_info"
    if not isinstance(payload, dict):
        return Refused(f"^Invalid {what} for {SPARSE_ENGINE}")
    refused = (_unknown(payload, SPARSE_KEYS, what, SPARSE_ENGINE)
               or _missing(payload, SPARSE_KEYS, "positional", what, SPARSE_ENGINE))
    if refused:
        return refused
    counts = payload["num_updates_list"]
    try:  # SparseNCCLWeightTransferUpdateInfo.__post_init__, in its order
        n = _len(payload["names"], what, SPARSE_ENGINE)
        for key in ("dtype_names", "shapes"):
            refused = _same_size(key, _len(payload[key], what, SPARSE_ENGINE), n)
            if refused:
                return refused
        if _len(counts, what, SPARSE_ENGINE) == 0:
            return Refused("^`num_updates_list` cannot be empty for sparse updates$")
        refused = _same_size("num_updates_list", len(counts), n)
        if refused:
            return refused
    except _NoLen as e:
        if not counts:  # null, 0, false: the library calls it empty, vLLM has no len()
            return Refused("num_updates_list|has no len")
        return Refused(str(e))
    try:
        negative = any(n < 0 for n in counts)
    except TypeError:  # a comparison Python cannot make: vLLM refuses, in Python's words
        return Refused("num_updates_list")
    if negative:
        # vLLM: "Sparse `num_updates_list` entries must be non-negative"
        # (the whole sentence: test_sparse_refusals_are_in_vllms_words)
        return Refused("num_updates_list")
    stricter = _ill_typed_lists(payload)
    if not all(_is_int(n) for n in counts):
        stricter.append("num_updates_list")
    return Accepted(dict(payload), stricter)


def same_json(a, b) -> bool:
    """The same JSON text (``==`` would take ``true`` for ``1`` and ``1.0`` for ``1``)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def outcome(parse, expect, payload) -> str:
    """Parse ``payload`` with the library and hold it to ``expect``; which way it went."""
    want = expect(payload)
    try:
        info = parse(payload)
    except (ValueError, TypeError) as e:
        if isinstance(want, Refused):
            assert isinstance(e, ValueError), (payload, e)
            assert re.search(want.pattern, str(e)), (payload, str(e), want.pattern)
            return "refused"
        assert want.stricter, f"vLLM accepts {payload!r}, the library refused: {e}"
        assert any(k in str(e) for k in want.stricter), (payload, str(e), want.stricter)
        return "stricter"
    assert isinstance(want, Accepted), f"vLLM refuses {payload!r} ({want.pattern}); accepted"
    assert same_json(info.to_payload(), want.payload), (payload, info.to_payload(), want.payload)
    return "accepted"


# ---- generators ----------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)
UID = base64.b64encode(bytes(range(128))).decode()
ids = st.binary(min_size=128, max_size=128).map(lambda b: base64.b64encode(b).decode())
names = st.text(min_size=1, max_size=12)
shapes = st.lists(st.integers(0, 2**20), max_size=4)
metadata = st.lists(st.tuples(names, st.sampled_from(DTYPES), shapes).map(list), min_size=1,
                    max_size=3)


def _ordered(draw, items: dict) -> dict:
    """The same keys in a drawn order (the order JSON carries them in)."""
    return dict(draw(st.permutations(list(items.items()))))


@st.composite
def valid_init(draw) -> dict:
    p: dict = {}
    if draw(st.booleans()):
        p["nccl_unique_id_b64"] = draw(ids)
        for key in ("master_address", "master_port"):
            if draw(st.booleans()):
                p[key] = None
    else:
        p["master_address"] = draw(st.sampled_from(["10.0.0.1", "trainer-0", "::1"]))
        p["master_port"] = draw(st.integers(1, 65535))
        if draw(st.booleans()):
            p["nccl_unique_id_b64"] = draw(st.sampled_from([None, ""]))
    p["rank_offset"] = ro = draw(st.integers(1, 8))
    p["world_size"] = draw(st.integers(ro + 1, ro + 64))
    if draw(st.booleans()):
        p["packed"] = draw(st.booleans())
    if draw(st.booleans()):
        p["packed_buffer_size_bytes"] = draw(st.integers(1, 2**40))
    if draw(st.booleans()):
        p["packed_num_buffers"] = draw(st.integers(1, 16))
    plan = draw(st.sampled_from(["none", "on", "off", "off with metadata"]))
    if plan == "on":
        p["use_load_plan"], p["metadata"] = True, draw(metadata)
    elif plan != "none":
        p["use_load_plan"] = False
        if plan == "off with metadata":
            p["metadata"] = draw(metadata)
    return _ordered(draw, p)


@st.composite
def valid_update(draw) -> dict:
    n = draw(st.integers(0, 4))
    p = {"names": draw(st.lists(names, min_size=n, max_size=n, unique=True)),
         "dtype_names": draw(st.lists(st.sampled_from(DTYPES), min_size=n, max_size=n)),
         "shapes": draw(st.lists(shapes, min_size=n, max_size=n))}
    if n == 0:  # all defaulted: any of them may be left out
        p = {k: v for k, v in p.items() if draw(st.booleans())}
    if draw(st.booleans()):
        p["src"] = draw(st.integers(0, 8))
    return _ordered(draw, p)


@st.composite
def valid_sparse(draw) -> dict:
    n = draw(st.integers(1, 4))
    p = {"names": draw(st.lists(names, min_size=n, max_size=n, unique=True)),
         "dtype_names": draw(st.lists(st.sampled_from(["bfloat16", "float16", "float32"]),
                                      min_size=n, max_size=n)),
         "shapes": draw(st.lists(shapes, min_size=n, max_size=n)),
         "num_updates_list": draw(st.lists(st.integers(0, 2**20), min_size=n, max_size=n))}
    return _ordered(draw, p)


def _mutate_value(draw, key: str, value):
    """A small change to one value: junk, a list cut or grown, a sign, a broken id."""
    how = draw(st.sampled_from(["junk", "cut", "grow", "element", "negate", "bool", "float",
                                "id"]))
    if how == "element" and isinstance(value, list) and value:
        i = draw(st.integers(0, len(value) - 1))
        return [*value[:i], draw(json_values), *value[i + 1:]]
    if how == "cut" and isinstance(value, list) and value:
        return value[:-1]
    if how == "grow" and isinstance(value, list):
        return [*value, draw(json_values)]
    if how == "negate" and _is_int(value):
        return -value
    if how == "negate" and isinstance(value, list) and value and _is_int(value[0]):
        return [-value[0] - 1, *value[1:]]
    if how == "bool":
        return bool(value)
    if how == "float" and _is_int(value):
        return value + 0.5
    if how == "id" and isinstance(value, str) and len(value) > 4:
        return draw(st.sampled_from([value.rstrip("="), value[:-4], value + "====",
                                     value.replace("/", "_").replace("+", "-"),
                                     value[:50] + " " + value[50:]]))
    return draw(json_values)


def mutated(valid, extra_keys: list[str]):
    """A valid payload with one thing changed: a key dropped or added, or a value."""
    @st.composite
    def build(draw) -> dict:
        p = dict(draw(valid))
        how = draw(st.sampled_from(["drop", "add", "change", "change"]))
        if how == "drop" and p:
            del p[draw(st.sampled_from(sorted(p)))]
        elif how == "add":
            p[draw(st.sampled_from(extra_keys))] = draw(json_values | st.just(None) | ids)
        elif p:
            key = draw(st.sampled_from(sorted(p)))
            p[key] = _mutate_value(draw, key, p[key])
        return p
    return build()


def junk(keys: list[str]):
    return st.dictionaries(st.sampled_from(keys), json_values | ids | st.integers(0, 5),
                           max_size=len(keys)) | json_values


def mixed(valid, keys: list[str], extra_keys: list[str]):
    return st.one_of(valid, mutated(valid, keys + extra_keys), junk(keys + extra_keys))


def fuzz(parse, expect, strategy, examples: int, always: tuple = ()) -> Counter:
    """Run the fuzz (``always`` first); how often each outcome came."""
    seen: Counter = Counter()

    def run(payload):
        seen[outcome(parse, expect, payload)] += 1

    for payload in always:
        run = example(payload)(run)
    settings(max_examples=examples, deadline=None)(given(strategy)(run))()
    return seen


def fair_share(seen: Counter) -> None:
    """The fuzz accepted, and refused, in a fair share of its examples."""
    total = sum(seen.values())
    assert seen["accepted"] >= 0.15 * total and seen["refused"] >= 0.15 * total, seen


# ---- valid payloads are accepted and round-trip exactly --------------------------

@settings(max_examples=300, deadline=None)
@given(valid_init())
def test_every_valid_init_info_is_accepted_and_sent_back_unchanged(payload):
    want = expect_init(payload)
    assert isinstance(want, Accepted) and not want.stricter, (payload, want)
    assert outcome(InitInfo.from_payload, expect_init, payload) == "accepted"


@settings(max_examples=300, deadline=None)
@given(valid_update())
def test_every_valid_update_info_is_accepted_and_sent_back_unchanged(payload):
    want = expect_update(payload)
    assert isinstance(want, Accepted) and not want.stricter, (payload, want)
    assert outcome(UpdateInfo.from_payload, expect_update, payload) == "accepted"


@settings(max_examples=200, deadline=None)
@given(valid_sparse())
def test_every_valid_sparse_update_info_is_accepted_and_sent_back_unchanged(payload):
    want = expect_sparse(payload)
    assert isinstance(want, Accepted) and not want.stricter, (payload, want)
    assert outcome(SparseUpdateInfo.from_payload, expect_sparse, payload) == "accepted"


# ---- anything: vLLM's answer, or a round trip ---------------------------------

def test_init_info_payloads_round_trip_or_are_refused_like_vllm():
    seen = fuzz(InitInfo.from_payload, expect_init,
                mixed(valid_init(), list(INIT_KEYS), ["src", "extra", "num_updates_list"]), 600,
                always=({"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1,
                         "world_size": 2},  # TCP mode: sent back with its address, no null id
                        {"nccl_unique_id_b64": UID, "rank_offset": 1, "world_size": 2,
                         "metadata": [["w", "float32", [2]]]}))  # metadata without the plan
    fair_share(seen)


def test_update_info_payloads_round_trip_or_are_refused_like_vllm():
    seen = fuzz(UpdateInfo.from_payload, expect_update,
                mixed(valid_update(), list(DENSE_KEYS), ["packed", "extra", "num_updates_list"]),
                600, always=({"names": ["w"], "dtype_names": ["float32"], "shapes": [[1.5]]},))
    fair_share(seen)


def test_sparse_update_info_payloads_round_trip_or_are_refused_like_vllm():
    seen = fuzz(SparseUpdateInfo.from_payload, expect_sparse,
                mixed(valid_sparse(), list(SPARSE_KEYS), ["src", "extra", "packed"]), 400,
                always=({"names": ["w"], "dtype_names": ["float32"], "shapes": [None],
                         "num_updates_list": [0]},
                        # vLLM refuses at the counts, before any list's types
                        {"names": [None], "dtype_names": [None], "shapes": [None],
                         "num_updates_list": [None]},
                        {"names": [1], "dtype_names": ["float32"], "shapes": [[1]],
                         "num_updates_list": [-1]}))
    fair_share(seen)


# ---- vLLM's wording, case by case ----------------------------------------------


def test_an_unknown_key_is_named_as_python_names_it():
    """``NCCLWeightTransferInitInfo(**payload)`` names the first unexpected
    keyword in the order the payload carries them."""
    payload = {"nccl_unique_id_b64": UID, "rank_offset": 1, "world_size": 2, "zeta": 1, "alpha": 2}
    with pytest.raises(ValueError, match=r"^Invalid init_info for NCCLWeightTransferEngine: "
                                         r"\w+\.__init__\(\) got an unexpected keyword argument "
                                         r"'zeta'$"):
        InitInfo.from_payload(payload)


def test_sparse_refusals_are_in_vllms_words():
    """vLLM's parse_update_info names ``self.__class__.__name__``, which for the
    sparse backend is ``SparseNCCLWeightTransferEngine``; its negative count
    has a sentence of its own."""
    base = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[4]], "num_updates_list": [1]}
    for payload, vllm in [
        ({**base, "src": 1}, "Invalid update_info for SparseNCCLWeightTransferEngine: "
                             "SparseNCCLWeightTransferUpdateInfo.__init__() got an unexpected "
                             "keyword argument 'src'"),
        ({"names": [], "dtype_names": [], "shapes": []},
         "Invalid update_info for SparseNCCLWeightTransferEngine: "
         "SparseNCCLWeightTransferUpdateInfo.__init__() missing 1 required positional "
         "argument: 'num_updates_list'"),
        ({**base, "num_updates_list": [-1]}, "Sparse `num_updates_list` entries must be "
                                             "non-negative"),
    ]:
        with pytest.raises(ValueError) as e:
            SparseUpdateInfo.from_payload(payload)
        # the dataclass's own name may differ; the rest is vLLM's sentence
        ours = re.sub(r"\w+\.__init__", "SparseNCCLWeightTransferUpdateInfo.__init__", str(e.value))
        assert ours == vllm


def test_a_shape_is_sent_as_given_or_refused():
    """vLLM's dataclasses do not check JSON types, so the parser may accept a
    dimension that is not an int, or lists that are not lists; it must then
    send back the payload it was given, or refuse it naming the key. The
    builder, likewise, must never send another shape than it was given."""
    wrong = []
    for parse, payload in [
        (UpdateInfo.from_payload, {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1.5]]}),
        (UpdateInfo.from_payload, {"names": ["w"], "dtype_names": ["float32"], "shapes": [["2"]]}),
        (UpdateInfo.from_payload, {"names": "ab", "dtype_names": "cd", "shapes": ["", ""]}),
        (SparseUpdateInfo.from_payload, {"names": ["w"], "dtype_names": ["float32"],
                                         "shapes": [None], "num_updates_list": [0]}),
        (lambda p: UpdateInfo(**p), {"names": ["w"], "dtype_names": ["float32"], "shapes": [[1.5]]}),
    ]:
        try:
            info = parse(payload)
        except (ValueError, TypeError) as e:
            if not any(k in str(e) for k in ("names", "dtype_names", "shapes")):
                wrong.append((payload, f"refused without naming the key: {e}"))
            continue
        try:
            back = info.to_payload()
        except Exception as e:  # accepted, then cannot be sent
            wrong.append((payload, f"accepted, then to_payload raised {type(e).__name__}: {e}"))
            continue
        if not same_json(back, payload):
            wrong.append((payload, f"accepted, sent back as {back}"))
    assert not wrong, "\n".join(f"{p}: {why}" for p, why in wrong)


# ---- the id, the numpy scalar ----------------------------------------------------

@given(st.binary(max_size=200))
def test_unique_id_from_raw_bytes(raw):
    if len(raw) == 128:
        assert UniqueId(raw).to_b64() == base64.b64encode(raw).decode()
    else:
        with pytest.raises(ValueError, match=f"128 bytes, got {len(raw)}"):
            UniqueId(raw)


def test_numpy_scalars_are_not_json_ints():
    """A numpy int is not an int to vLLM's JSON: the builder refuses it up front."""
    with pytest.raises(TypeError):
        UpdateInfo(names=["w"], dtype_names=["float32"], shapes=[[2]], src=np.int64(1))

"""The unique id as vLLM reads it: 128 bytes, standard padded base64 on the wire.

vLLM decodes with ``base64.b64decode(s, validate=True)``, so the URL-safe
alphabet, missing padding and whitespace are all rejected, and the result must
be exactly 128 bytes. ``from_b64`` applies the same rules with messages that
say which one failed, so a bad id is refused here rather than by the server.
"""

from __future__ import annotations

import base64
import binascii
import codecs
import re
from dataclasses import dataclass, field

from .errors import RendezvousError

UNIQUE_ID_BYTES = 128
B64_LENGTH = 172  # 4 * ceil(128 / 3), ending in one "="

_STD_ALPHABET = re.compile(r"[A-Za-z0-9+/]*={0,2}")
# What may hold an id: a run of 64 or more characters of either base64
# alphabet or backslashes (JSON may write "/" as "\/"), then any padding: far
# shorter than an id's 172, far longer than a word. One character class, and
# a look-behind that starts a match only where a run starts, so a search costs
# time linear in the text and no memory per character (an alternation inside a
# repeated group keeps state per character: 2 GB and 12 s for a 16 MiB run).
_RUN_CLASS = r"A-Za-z0-9+/_\\-"
_SECRET_LIKE = re.compile(rf"(?<![{_RUN_CLASS}])[{_RUN_CLASS}]{{64,}}={{0,2}}")
_SECRET_LIKE_BYTES = re.compile(_SECRET_LIKE.pattern.encode())
# The rest of a run (and its padding) from a given position on.
_RUN_REST = re.compile(rf"[={_RUN_CLASS}]*")
_RUN_REST_BYTES = re.compile(_RUN_REST.pattern.encode())


class UniqueIdError(RendezvousError, ValueError):
    """A unique id (or its base64 form) that vLLM would refuse."""


@dataclass(frozen=True)
class UniqueId:
    """An ``ncclUniqueId``. It is a credential for joining the group: never printed.

    Attributes:
        raw: the id's ``UNIQUE_ID_BYTES`` bytes (left out of ``repr``).

    Raises:
        UniqueIdError: ``raw`` is not bytes, or not ``UNIQUE_ID_BYTES`` long.
    """

    raw: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.raw, bytes):
            raise UniqueIdError(f"a unique id is bytes, got {type(self.raw).__name__}")
        if len(self.raw) != UNIQUE_ID_BYTES:
            raise UniqueIdError(
                f"a unique id is {UNIQUE_ID_BYTES} bytes, got {len(self.raw)}")

    @classmethod
    def mint(cls) -> UniqueId:
        """A fresh id from ``ncclGetUniqueId``; this process must outlive every rank's init.

        Returns:
            The new id.

        Raises:
            NcclLibraryNotFound: no usable libnccl.
            NcclError: ``ncclGetUniqueId`` failed.
        """
        from nccl_cffi import get_unique_id
        return cls(get_unique_id())

    def to_b64(self) -> str:
        """Standard RFC 4648 base64 with padding: what ``nccl_unique_id_b64`` carries.

        Returns:
            ``B64_LENGTH`` ASCII characters.
        """
        return base64.b64encode(self.raw).decode("ascii")

    @classmethod
    def from_b64(cls, text: str) -> UniqueId:
        """Decode with exactly vLLM's rules; the error names the rule broken.

        Args:
            text: the ``nccl_unique_id_b64`` value.

        Returns:
            The id.

        Raises:
            UniqueIdError: not a non-empty str, whitespace, the URL-safe
                alphabet, misplaced or missing padding, other characters, or
                not ``UNIQUE_ID_BYTES`` once decoded.
        """
        if not isinstance(text, str):
            raise UniqueIdError(f"nccl_unique_id_b64 must be a string, got {type(text).__name__}")
        if not text:
            raise UniqueIdError("nccl_unique_id_b64 is empty")
        if any(c.isspace() for c in text):
            raise UniqueIdError("nccl_unique_id_b64 contains whitespace; send it as one token")
        if "-" in text or "_" in text:
            raise UniqueIdError(
                "nccl_unique_id_b64 uses the URL-safe alphabet ('-' or '_'); vLLM accepts "
                "only standard base64 (base64.b64encode, not urlsafe_b64encode)")
        if "=" in text.rstrip("="):
            raise UniqueIdError("nccl_unique_id_b64 has '=' padding before its end")
        if not _STD_ALPHABET.fullmatch(text):
            raise UniqueIdError("nccl_unique_id_b64 has characters outside the base64 alphabet")
        if len(text) % 4:
            raise UniqueIdError(
                f"nccl_unique_id_b64 is {len(text)} characters, not a multiple of 4: "
                "the '=' padding is missing or the text is truncated")
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError) as e:
            raise UniqueIdError(f"nccl_unique_id_b64 is not valid standard base64 ({e})") from e
        if len(raw) != UNIQUE_ID_BYTES:
            raise UniqueIdError(
                f"nccl_unique_id_b64 must decode to {UNIQUE_ID_BYTES} bytes, got {len(raw)}")
        return cls(raw)

    def __str__(self) -> str:
        return "UniqueId(<128 bytes, hidden>)"


def redact(text: str) -> str:
    """``text`` with anything that may be a unique id replaced by ``<redacted>``.

    For text that may quote a request (a server's error, a log line): every
    run of 64 or more characters of the base64 or base64url alphabet or
    backslashes (JSON's ``\\/`` escape), with its ``=`` padding. An id is 172
    such characters; SHA-256 hex digests and other long tokens go too. The
    cost is linear in ``text``, with no memory beyond the result.

    Args:
        text: any text.

    Returns:
        ``text`` with each such run replaced.
    """
    return _SECRET_LIKE.sub("<redacted>", text)


def redacted_head(data: str | bytes | bytearray, chars: int) -> str:
    """``redact(data)[:chars]``, without decoding or redacting the rest of
    ``data``: for a body that may be megabytes long.

    ``data`` is read in windows, each ending after a whole run (an id that
    crosses a window's end is still judged whole), until ``chars`` are kept:
    the work is a few times ``chars``, plus the length of the last run read.

    Args:
        data: text, or bytes read as UTF-8 (invalid bytes replaced).
        chars: how many characters to keep at most.

    Returns:
        The redacted start of ``data``, at most ``chars`` characters.
    """
    is_text = isinstance(data, str)
    secret, rest = (_SECRET_LIKE, _RUN_REST) if is_text else (_SECRET_LIKE_BYTES, _RUN_REST_BYTES)
    decode = _as_is if is_text else codecs.getincrementaldecoder("utf-8")("replace").decode
    kept: list[str] = []
    size = at = 0
    while size < chars and at < len(data):
        end = rest.match(data, min(at + chars - size, len(data))).end()
        for run in secret.finditer(data, at, end):
            kept += [decode(data[at:run.start()]), "<redacted>"]
            at = run.end()
        kept.append(decode(data[at:end], end == len(data)))
        size = sum(map(len, kept))  # a few hundred pieces at most per window
        at = end
    return "".join(kept)[:chars]


def _as_is(text: str, final: bool = False) -> str:
    return text


def check_rendezvous_mode(*, nccl_unique_id_b64: str | None, master_address: str | None,
                          master_port: int | None) -> UniqueId | None:
    """vLLM's rule: the unique id, or master address and port, never both nor neither.

    Args:
        nccl_unique_id_b64: the id in base64, or None (or "") on the
            master-address path.
        master_address: the rendezvous host of the other path, or None.
        master_port: the rendezvous port of the other path, or None.

    Returns:
        The decoded id, or None on the master-address path.

    Raises:
        UniqueIdError: both paths given or neither, or an id ``from_b64``
            refuses.
    """
    has_uid = bool(nccl_unique_id_b64)
    if has_uid and (master_address is not None or master_port is not None):
        raise UniqueIdError("pass nccl_unique_id_b64 OR master_address/master_port, not both")
    if not has_uid:
        if master_address is None or master_port is None:
            raise UniqueIdError(
                "need nccl_unique_id_b64, or both master_address and master_port "
                f"(got master_address={master_address!r}, master_port={master_port!r})")
        return None
    return UniqueId.from_b64(nccl_unique_id_b64)

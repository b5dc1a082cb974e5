"""The job key: only processes that hold it take part, and what they send is authenticated.

A job may be given a secret key (``--job-key-file``, or the file named by
``$LOCO_JOB_KEY_FILE``). With it:

* [`admit`][loco.comm.auth.admit] runs an HMAC challenge-response among the ranks of a
  [`Comm`][loco.comm.comm.Comm] before any model state moves: a process that cannot prove
  the key is named and refused (an elastic job does it at every new quorum);
* a [`JobKey`][loco.comm.auth.JobKey] puts an HMAC-SHA256 tag on payloads (one per row of a
  ``(rows, width)`` uint8 tensor, or one per message) and checks them; every tag binds a
  *context* (the job's session, the operation and its sequence number, the sender: see
  [`context`][loco.comm.auth.context]), so a payload replayed from another operation fails;
* optionally AES-256-GCM ([`JobKey.seal`][loco.comm.auth.JobKey.seal]) encrypts a payload and
  authenticates it in one pass (``pip install 'loco[encrypt]'``);
* the state a joining elastic worker receives is sealed by its sender and opened by the
  joiner only once its tag is checked ([`seal_state`][loco.comm.auth.seal_state]).

Everything here works on bytes in host memory; the costs are measured by
``benchmarks/auth_cost.py`` (docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import secrets
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from loco.comm.hostreads import allowed

Comm = Any  # a loco.comm.comm.Comm (not imported: the Comm's MACs import this module)

KEY_ENV = "LOCO_JOB_KEY_FILE"
"""The environment variable naming the key's file (kept equal to
``loco.config.trust.JOB_KEY_ENV``; the comm layer does not import the config)."""

MIN_KEY_BYTES = 16
"""The shortest key accepted, in bytes (after decoding a hex file)."""

TAG_BYTES = 32
"""The length of one HMAC-SHA256 tag."""

NONCE_BYTES = 32
"""The length of each rank's admission challenge."""


class AuthError(RuntimeError):
    """A payload or a state whose tag does not match: tampered with, replayed from another
    operation, or sent by a process that does not hold the job's key."""


class AdmissionError(AuthError):
    """Some ranks could not prove the job key: they are not admitted."""


# ---------------------------------------------------------------------------------- the key
def load_key(path: str | os.PathLike) -> bytes:
    """The job key held in the file ``path``.

    The file holds either hex digits (an even number of them, e.g. from
    ``python -c "import secrets; print(secrets.token_hex(32))"``), decoded to bytes, or
    any other raw bytes, taken as they are. Surrounding whitespace (the trailing newline) is
    stripped first.

    Args:
        path: the key's file.

    Raises:
        ValueError: the file is missing or unreadable, or the key is shorter than
            ``MIN_KEY_BYTES`` (16) bytes; the message says which, in one line.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read().strip()
    except FileNotFoundError:
        raise ValueError(f"the key file {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"the key file {path} cannot be read: {e.strerror or e}") from None
    key = _decode(raw)
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(f"the key in {path} has {len(key)} bytes, fewer than "
                         f"{MIN_KEY_BYTES} (make one with: python -c \"import secrets; "
                         f"print(secrets.token_hex(32))\" > job.key)")
    return key


def _decode(raw: bytes) -> bytes:
    """Hex digits decoded; anything else as it is."""
    try:
        return bytes.fromhex(raw.decode("ascii")) if len(raw) % 2 == 0 else raw
    except (UnicodeDecodeError, ValueError):
        return raw


def job_key(path: str | None = None) -> bytes | None:
    """The job's key: from the file ``path`` if given, else from the file named by
    ``$LOCO_JOB_KEY_FILE``; None when neither is set (the job runs without a key).

    Args:
        path: the key's file (``--job-key-file``), or None.

    Raises:
        ValueError: as [`load_key`][loco.comm.auth.load_key].
    """
    path = path or os.environ.get(KEY_ENV)
    return load_key(path) if path else None


def context(*parts: str | int | bytes) -> bytes:
    """An unambiguous encoding of what a tag is bound to, e.g. ``context("reduce", seq,
    sender)``: each part typed and length-prefixed, so that no two different lists of parts
    encode alike.

    Args:
        *parts: text, integers (64-bit, signed) or bytes.
    """
    out = bytearray()
    for p in parts:
        kind, b = ((b"s", p.encode()) if isinstance(p, str) else
                   (b"i", p.to_bytes(8, "big", signed=True)) if isinstance(p, int) else
                   (b"b", bytes(p)))
        out += kind + len(b).to_bytes(4, "big") + b
    return bytes(out)


_encode = context  # for the methods below, whose argument ``context`` hides the function


# ----------------------------------------------------------------------------- the JobKey
class JobKey:
    """Tags and checks payloads with a job's key (HMAC-SHA256), optionally encrypts them
    (AES-256-GCM).

    Two keys are derived from the job key, one for the tags and one for encryption. Every
    tag covers ``job`` (the session that [`admit`][loco.comm.auth.admit] agreed, empty
    before), then the caller's ``context``, then the data; a tag made under one context
    fails under any other.

    Payload tensors are read in host memory: a CUDA tensor is copied to the host first
    (which waits for the kernels that write it).

    Args:
        key: the job key (at least ``MIN_KEY_BYTES`` bytes).
        job: the session every tag is bound to; default empty.
        encrypt: whether [`protect`][loco.comm.auth.JobKey.protect] encrypts (AES-GCM)
            rather than only tags; default False.
    """

    def __init__(self, key: bytes, job: bytes = b"", encrypt: bool = False):
        if len(key) < MIN_KEY_BYTES:
            raise ValueError(f"a job key needs at least {MIN_KEY_BYTES} bytes, got {len(key)}")
        self._key = bytes(key)
        self._mac_key = hmac.digest(self._key, b"loco mac key", "sha256")
        self.job = bytes(job)
        self.encrypt = encrypt
        self._aead = None

    def bound(self, job: bytes) -> JobKey:
        """The same key, its tags bound to another session.

        Args:
            job: the session (e.g. what [`admit`][loco.comm.auth.admit] agreed); it
                replaces any before.
        """
        return JobKey(self._key, job, self.encrypt)

    def _start(self, ctx: bytes) -> Any:
        """An HMAC that has taken the job and ``ctx``, to copy for each message."""
        return hmac.new(self._mac_key, _encode(self.job, ctx), "sha256")

    # ---------------------------------------------------------------------- one message
    def tag(self, data: bytes | memoryview, context: bytes = b"") -> bytes:
        """The 32-byte tag of ``data`` under ``context``.

        Args:
            data: the message.
            context: what the tag is bound to ([`context`][loco.comm.auth.context]).
        """
        h = self._start(context)
        h.update(data)
        return h.digest()

    def verify(self, data: bytes | memoryview, tag: bytes, context: bytes = b"") -> bool:
        """Whether ``tag`` is ``data``'s under ``context`` (compared in constant time).

        Args:
            data: the message received.
            tag: the tag that came with it.
            context: what the tag is bound to ([`context`][loco.comm.auth.context]).
        """
        return hmac.compare_digest(self.tag(data, context), bytes(tag))

    def check(self, data: bytes | memoryview, tag: bytes, context: bytes, what: str) -> None:
        """Raise unless ``tag`` is ``data``'s under ``context``.

        Args:
            data: the message received.
            tag: the tag that came with it.
            context: what the tag is bound to ([`context`][loco.comm.auth.context]).
            what: what it is, for the error (e.g. "NoLoCo's exchange from rank 2").

        Raises:
            AuthError: naming ``what``.
        """
        if not self.verify(data, tag, context):
            raise AuthError(f"{what} failed its MAC: it was tampered with, replayed from "
                            "another operation, or sent by a process without the job key")

    # ------------------------------------------------------------------------- rows
    def tag_rows(self, payload: torch.Tensor, context: bytes = b"") -> torch.Tensor:
        """One tag per row of ``payload`` under ``context``, each over the row's index and
        bytes (so rows cannot be swapped).

        Args:
            payload: a ``(rows, width)`` uint8 tensor (a CUDA one is copied to the host).
            context: what the tags are bound to ([`context`][loco.comm.auth.context]).

        Returns:
            A ``(rows, 32)`` uint8 tensor on ``payload``'s device.
        """
        base = self._start(context)
        rows = _host_rows(payload)
        tags = torch.empty((len(rows), TAG_BYTES), dtype=torch.uint8)
        out = tags.numpy()
        for i, row in enumerate(rows):
            h = base.copy()
            h.update(i.to_bytes(8, "big"))
            h.update(row)
            out[i] = np.frombuffer(h.digest(), dtype=np.uint8)
        return tags.to(payload.device)

    def check_rows(self, payload: torch.Tensor, tags: torch.Tensor, context: bytes = b""
                   ) -> list[int]:
        """The rows of ``payload`` whose tag in ``tags`` fails under ``context`` (empty:
        every row is authentic).

        Args:
            payload: a ``(rows, width)`` uint8 tensor, as given to ``tag_rows``.
            tags: the ``(rows, 32)`` uint8 tags that came with it.
            context: the context they were made under.
        """
        expected = self.tag_rows(payload, context).cpu().numpy()
        got = tags.detach().cpu().contiguous().numpy()
        if got.shape != expected.shape:
            raise ValueError(f"tags of shape {tuple(got.shape)} for a payload of "
                             f"{payload.shape[0]} rows: expected ({payload.shape[0]}, "
                             f"{TAG_BYTES})")
        return [i for i in range(len(expected))
                if not hmac.compare_digest(expected[i].tobytes(), got[i].tobytes())]

    # ---------------------------------------------------------------------- encryption
    def _cipher(self):
        if self._aead is None:
            try:
                from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            except ImportError:
                raise RuntimeError("encrypting loco's payloads needs the 'cryptography' "
                                   "package: pip install 'loco[encrypt]'") from None
            self._aead = AESGCM(hmac.digest(self._key, b"loco aes-256-gcm key", "sha256"))
        return self._aead

    def seal(self, data: bytes | memoryview, context: bytes = b"") -> bytes:
        """``data`` encrypted and authenticated with AES-256-GCM, bound to the job and
        ``context`` (its associated data): a fresh random 12-byte nonce, then the cipher
        text and its 16-byte tag. Random nonces: keep under 2**32 messages per key.

        Args:
            data: the message.
            context: what it is bound to ([`context`][loco.comm.auth.context]).

        Raises:
            RuntimeError: ``cryptography`` is not installed (``loco[encrypt]``).
        """
        nonce = secrets.token_bytes(12)
        return nonce + self._cipher().encrypt(nonce, data, _encode(self.job, context))

    def open(self, sealed: bytes | memoryview, context: bytes = b"", what: str = "a payload"
             ) -> bytes:
        """The data [`seal`][loco.comm.auth.JobKey.seal] sealed under ``context``.

        Args:
            sealed: what ``seal`` returned.
            context: what it was bound to.
            what: what it is, for the error.

        Raises:
            AuthError: naming ``what``: the cipher text or its context differ.
        """
        from cryptography.exceptions import InvalidTag

        sealed = bytes(sealed)
        try:
            return self._cipher().decrypt(sealed[:12], sealed[12:], _encode(self.job, context))
        except (InvalidTag, ValueError):
            raise AuthError(f"{what} failed its authentication (AES-GCM): it was tampered "
                            "with, replayed from another operation, or sealed without the "
                            "job key") from None

    def protect(self, data: bytes | memoryview, context: bytes = b"") -> bytes:
        """``data`` sealed (``encrypt``) or prefixed with its tag, for
        [`unprotect`][loco.comm.auth.JobKey.unprotect].

        Args:
            data: the message.
            context: what the tag is bound to ([`context`][loco.comm.auth.context]).
        """
        return self.seal(data, context) if self.encrypt else self.tag(data, context) + data

    def unprotect(self, body: bytes | memoryview, context: bytes = b"",
                  what: str = "a payload") -> memoryview:
        """The data of a [`protect`][loco.comm.auth.JobKey.protect]ed ``body``, once
        authenticated under ``context``.

        Args:
            body: what ``protect`` returned.
            context: what it was bound to.
            what: what it is, for the error.

        Raises:
            AuthError: naming ``what``.
        """
        if self.encrypt:
            return memoryview(self.open(body, context, what))
        body = memoryview(body)
        self.check(body[TAG_BYTES:], body[:TAG_BYTES], context, what)
        return body[TAG_BYTES:]


def _host_rows(payload: torch.Tensor) -> list[memoryview]:
    """The rows of a 2-D uint8 tensor as memoryviews of one host buffer (no copy on the
    CPU)."""
    if payload.dtype != torch.uint8 or payload.dim() != 2:
        raise ValueError(f"expected a (rows, width) uint8 tensor, got {payload.dtype} of shape "
                         f"{tuple(payload.shape)}")
    with allowed("sync"):  # a CUDA payload is read on the host, on purpose
        host = payload.detach().cpu().contiguous().numpy()
    flat, width = memoryview(host.reshape(-1)), host.shape[1]
    return [flat[i * width:(i + 1) * width] for i in range(host.shape[0])]


# ------------------------------------------------------------------------------ admission
def admit(comm: Comm, key: bytes | JobKey, names: Sequence[str] | None = None) -> JobKey:
    """Admit the ranks of ``comm`` that prove the job key; refuse the job if any cannot.

    Every rank draws a random challenge; the challenges are all-gathered; every rank
    answers with the HMAC of all of them and its rank; the answers are all-gathered and each
    rank checks every other's. A process without the key cannot answer (the challenges are
    fresh, the answers bound to the rank). Collective: every rank of ``comm`` calls it, before
    any model state is sent (its bytes are counted under the tag ``"setup"``).

    Args:
        comm: the Comm whose ranks must prove the key.
        key: the job key, or a [`JobKey`][loco.comm.auth.JobKey] (its ``encrypt`` is kept).
        names: what to call each rank in the error (e.g. ``"worker 3"``); default
            ``"rank R"``.

    Returns:
        The key bound to this admission's session (a digest of every challenge, the same
            on every rank): tags made with it cannot be replayed into another session.

    Raises:
        AdmissionError: naming the ranks whose answer failed (this rank's own key is the
            odd one if every other rank is named).
    """
    jk = key if isinstance(key, JobKey) else JobKey(key)
    with allowed("setup"):
        transcript = b"".join(_gather_bytes(comm, secrets.token_bytes(NONCE_BYTES)))
        answers = _gather_bytes(comm, jk.tag(transcript, context("admission", comm.rank)))
    bad = [r for r in range(comm.size) if r != comm.rank
           and not jk.verify(transcript, answers[r], context("admission", r))]
    if bad:
        who = [names[r] if names else f"rank {r}" for r in bad]
        raise AdmissionError(
            f"{comm.name} rank {comm.rank}: {', '.join(who)} could not prove the job key: "
            "not admitted, and no state was sent to them"
            + (" (every other rank failed: this process's key may be the one that differs)"
               if len(bad) == comm.size - 1 and comm.size > 2 else ""))
    return jk.bound(hashlib.sha256(transcript).digest())


def _gather_bytes(comm: Comm, data: bytes) -> list[bytes]:
    """Every rank's ``data`` (equally long everywhere), in rank order."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(comm.device)
    return [bytes(row.cpu().numpy()) for row in comm.all_gather(t, tag="setup").wait()]


# ------------------------------------------------------------------- a joiner's state
def seal_state(key: JobKey, state: Any, context: bytes) -> bytes:
    """``state`` (a tree of tensors and numbers) serialised and protected
    ([`JobKey.protect`][loco.comm.auth.JobKey.protect]) under ``context``, for a joiner to
    [`open_state`][loco.comm.auth.open_state].

    Args:
        key: the job key.
        state: what to send.
        context: what it is bound to (the step and the sender, for a joiner's state).
    """
    buf = io.BytesIO()
    torch.save(state, buf)
    return key.protect(buf.getbuffer(), context)


def open_state(key: JobKey, body: bytes, context: bytes, sender: str) -> Any:
    """The state [`seal_state`][loco.comm.auth.seal_state] sealed, once authenticated:
    nothing is deserialised before its tag is checked (the state is loaded with pickle,
    which would run a forger's code).

    Args:
        key: the job key.
        body: what ``seal_state`` returned, as received.
        context: what it was bound to.
        sender: who sent it, for the error.

    Raises:
        AuthError: naming ``sender``.
    """
    data = key.unprotect(body, context, what=f"the state sent by {sender}")
    return torch.load(io.BytesIO(data), weights_only=False)


def request_proof(key: JobKey, path: str) -> str:
    """A header value that proves to a state server that the requester of ``path`` holds
    the key: a fresh nonce and the tag of the path under it (hex).

    Args:
        key: the job key.
        path: the path requested (``/checkpoint/STEP/full``).
    """
    nonce = secrets.token_bytes(16)
    return nonce.hex() + "." + key.tag(path.encode(), context("state request", nonce)).hex()


def proves_request(key: JobKey, proof: str | None, path: str, seen: set[bytes]) -> bool:
    """Whether ``proof`` ([`request_proof`][loco.comm.auth.request_proof]) is a valid,
    unused proof for ``path``; a valid one is added to ``seen`` (replays fail).

    Args:
        key: the job key.
        proof: the request's header value (None: absent).
        path: the path requested.
        seen: the nonces of the proofs accepted so far (for the state being served).
    """
    try:
        nonce, tag = (bytes.fromhex(p) for p in (proof or "").split("."))
    except ValueError:
        return False
    if nonce in seen or not key.verify(path.encode(), tag, context("state request", nonce)):
        return False
    seen.add(nonce)  # (the nonce, not the header: its hex can be spelt in other cases)
    return True


__all__ = [
    "KEY_ENV",
    "MIN_KEY_BYTES",
    "TAG_BYTES",
    "AdmissionError",
    "AuthError",
    "JobKey",
    "admit",
    "context",
    "job_key",
    "load_key",
    "open_state",
    "proves_request",
    "request_proof",
    "seal_state",
]

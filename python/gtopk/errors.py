"""gtopk's exceptions: one class per gRPC status code.

Every failure of a gtopk call (joining the cluster, a parameter download, a
step, a recovery) is raised as an instance of :class:`Error` -- in fact of the
subclass for its status code, e.g. :class:`DeadlineExceeded` -- carrying the
code (``.code``, a :class:`StatusCode`) and the message (``.message``; where a
server answered, its message, prefixed with the shard that failed). The codes
and their meaning in gtopk are those of ``worker/client.h``:

=====================  =====================================================
``Aborted``            another worker's push failed the step (retry after
                       ``recover()``)
``DeadlineExceeded``   a missing worker or a stalled shard (names them)
``Unavailable``        a shard cannot be reached
``InvalidArgument``    this worker's input was refused (wrong length,
                       non-finite value, a bad setting)
``FailedPrecondition`` the cluster's settings differ from this worker's, a
                       parameter-count mismatch, shards at different steps
``AlreadyExists``      the rank is taken by a live worker
``PermissionDenied``   another worker joined this rank since
``Cancelled``          the call was cancelled (the client was closed)
=====================  =====================================================

``RETRYABLE`` is the tuple of classes a recovery loop retries after
``recover()``::

    deadline = time.monotonic() + 120   # the recovery budget
    while True:
        try:
            opt.step()
            break
        except gtopk.RETRYABLE:
            if time.monotonic() > deadline:
                raise   # e.g. a peer that never returns
            opt.recover()

Standard library only: importable without the compiled extension (which
imports this module when it raises).
"""

import enum

__all__ = [
    "StatusCode", "Error", "Cancelled", "Unknown", "InvalidArgument",
    "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange",
    "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated",
    "from_status", "RETRYABLE",
]


class StatusCode(enum.IntEnum):
    """gRPC / absl status codes (the same numbers)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class Error(Exception):
    """A failed gtopk call.

    Attributes:
      code: the status code, a :class:`StatusCode` (a plain ``int`` only for
        a code outside gRPC's 0..16).
      message: the message (``str``), without the code.

    ``str(e)`` is ``"<CODE_NAME>: <message>"``, e.g.
    ``"DEADLINE_EXCEEDED: shard 1 (127.0.0.1:5001): ..."``.

    The subclasses fix the code: ``gtopk.FailedPrecondition("...")``. The
    base class takes it as the second argument: ``gtopk.Error("...", code)``
    (default ``UNKNOWN``).
    """

    #: The code of this class (the subclasses set their own).
    _default_code = StatusCode.UNKNOWN

    def __init__(self, message="", code=None):
        if code is None:
            code = type(self)._default_code
        else:
            try:
                code = StatusCode(int(code))
            except ValueError:
                code = int(code)  # outside 0..16: kept as it came
        message = str(message)
        super().__init__(message, code)
        self.code = code
        self.message = message

    @property
    def code_name(self):
        """The code's name (``"DEADLINE_EXCEEDED"``), ``"CODE_<n>"`` for a
        code outside gRPC's."""
        if isinstance(self.code, StatusCode):
            return self.code.name
        return "CODE_%d" % self.code

    def __str__(self):
        return "%s: %s" % (self.code_name, self.message)

    def __repr__(self):
        if type(self) is Error:
            return "Error(%r, %r)" % (self.message, self.code)
        return "%s(%r)" % (type(self).__name__, self.message)

    def __reduce__(self):
        # Picklable (multiprocessing, pytest-xdist): rebuilt with its code.
        if type(self) is Error:
            return (Error, (self.message, self.code))
        return (type(self), (self.message,))


def _subclass(name, code, doc):
    cls = type(name, (Error,), {"__doc__": doc, "_default_code": code,
                                "__module__": __name__})
    return cls


Cancelled = _subclass("Cancelled", StatusCode.CANCELLED,
                      "CANCELLED: the call was cancelled (e.g. the client "
                      "was closed while it ran).")
Unknown = _subclass("Unknown", StatusCode.UNKNOWN, "UNKNOWN.")
InvalidArgument = _subclass(
    "InvalidArgument", StatusCode.INVALID_ARGUMENT,
    "INVALID_ARGUMENT: an input was refused (wrong length, non-finite "
    "value, a malformed setting); the message names it.")
DeadlineExceeded = _subclass(
    "DeadlineExceeded", StatusCode.DEADLINE_EXCEEDED,
    "DEADLINE_EXCEEDED: a worker missed the step deadline or a shard "
    "stalled (the message names them). Retryable after recover().")
NotFound = _subclass("NotFound", StatusCode.NOT_FOUND, "NOT_FOUND.")
AlreadyExists = _subclass(
    "AlreadyExists", StatusCode.ALREADY_EXISTS,
    "ALREADY_EXISTS: the requested rank is taken by a live worker.")
PermissionDenied = _subclass(
    "PermissionDenied", StatusCode.PERMISSION_DENIED,
    "PERMISSION_DENIED: another worker joined this rank since (or the "
    "credentials were refused).")
ResourceExhausted = _subclass(
    "ResourceExhausted", StatusCode.RESOURCE_EXHAUSTED,
    "RESOURCE_EXHAUSTED: a message over the cluster's max_message_bytes, or "
    "out of (device) memory.")
FailedPrecondition = _subclass(
    "FailedPrecondition", StatusCode.FAILED_PRECONDITION,
    "FAILED_PRECONDITION: a setting differs from the cluster's (the message "
    "names it), a parameter-count mismatch, or shards at different steps.")
Aborted = _subclass(
    "Aborted", StatusCode.ABORTED,
    "ABORTED: the step failed for everyone (another worker's push failed "
    "it). Retryable after recover().")
OutOfRange = _subclass("OutOfRange", StatusCode.OUT_OF_RANGE, "OUT_OF_RANGE.")
Unimplemented = _subclass(
    "Unimplemented", StatusCode.UNIMPLEMENTED,
    "UNIMPLEMENTED: not supported by this build (e.g. the CUDA step in a "
    "build without CUDA).")
Internal = _subclass(
    "Internal", StatusCode.INTERNAL,
    "INTERNAL: a malformed message or a broken invariant (a bug, or the "
    "replicas diverged).")
Unavailable = _subclass(
    "Unavailable", StatusCode.UNAVAILABLE,
    "UNAVAILABLE: a shard cannot be reached. Retryable after recover().")
DataLoss = _subclass("DataLoss", StatusCode.DATA_LOSS, "DATA_LOSS.")
Unauthenticated = _subclass(
    "Unauthenticated", StatusCode.UNAUTHENTICATED,
    "UNAUTHENTICATED: missing or wrong credentials.")

_BY_CODE = {cls._default_code: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound,
    AlreadyExists, PermissionDenied, ResourceExhausted, FailedPrecondition,
    Aborted, OutOfRange, Unimplemented, Internal, Unavailable, DataLoss,
    Unauthenticated)}


def from_status(code, message):
    """The exception for a status: an instance of the subclass for ``code``
    (e.g. ``from_status(4, "...")`` is a :class:`DeadlineExceeded`), or a
    plain :class:`Error` keeping ``code`` (``OK``, or a raw ``int`` outside
    gRPC's 0..16). Returns it; does not raise."""
    try:
        code = StatusCode(int(code))
    except ValueError:
        return Error(message, int(code))
    cls = _BY_CODE.get(code)
    if cls is None:  # OK: not an error, but keep what was given
        return Error(message, code)
    return cls(message)


#: What a recovery loop retries after ``recover()``: the step failed for
#: everyone (ABORTED), a peer or shard was missing (DEADLINE_EXCEEDED) or
#: unreachable (UNAVAILABLE).
RETRYABLE = (Aborted, DeadlineExceeded, Unavailable)

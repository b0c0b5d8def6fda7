"""gtopk: gTop-k sparsified data-parallel training, from Python.

The package is the worker side of a gtopk cluster (``gtopk-server`` shards,
see the repository's README): a compiled extension over the C++ worker
client (``worker/client.h``) plus, in :mod:`gtopk.torch`, a PyTorch
optimizer that makes one training step one gTop-k step::

    import gtopk.torch
    opt = gtopk.torch.DistributedOptimizer(    # joins the cluster
        model.parameters(), lr=0.05, momentum=0.9,
        tls="mutual", tls_cert="worker.crt", tls_key="worker.key",
        tls_ca="ca.crt")         # or GTOPK_TLS=... (docs/security.md)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

What is here:
  * :class:`Client` -- the worker client itself (join, parameter download,
    step on flat float32 buffers, recovery, worker state, metrics);
  * :func:`checksum` -- FNV-1a 64 of a float32 buffer, as ``gtopk-worker``'s
    summary prints it;
  * ``has_cuda`` -- whether this build has the CUDA (device) step;
  * the exceptions of :mod:`gtopk.errors` (:class:`Error` and one subclass
    per status code, :data:`RETRYABLE`);
  * :mod:`gtopk.torch` -- imported on first use (``import gtopk.torch`` or
    ``gtopk.torch``), so ``import gtopk`` does not import torch.

Algorithm: Shi et al., "A Distributed Synchronous SGD Algorithm with Global
Top-k Sparsification for Low Bandwidth Networks", ICDCS 2019,
arXiv:1901.04359; momentum correction and warm-up from Lin et al., "Deep
Gradient Compression", ICLR 2018, arXiv:1712.01887.

Build: ``make python`` in the repository, then ``PYTHONPATH=build/python``
(or install it, see the README). The extension is built for one interpreter
(Debian's ``/usr/bin/python3``, which has ``python3-torch``).
"""

import glob as _glob
import os as _os
import sys as _sys

from gtopk.errors import (  # noqa: F401  (re-exported)
    RETRYABLE,
    Aborted,
    AlreadyExists,
    Cancelled,
    DataLoss,
    DeadlineExceeded,
    Error,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
    StatusCode,
    Unauthenticated,
    Unavailable,
    Unimplemented,
    Unknown,
    from_status,
)

__version__ = "0.1.0"


def _import_error_text(cause):
    here = _os.path.dirname(_os.path.abspath(__file__))
    built = sorted(_os.path.basename(p) for p in
                   _glob.glob(_os.path.join(here, "_gtopk*.so")))
    if isinstance(cause, ModuleNotFoundError) and \
            cause.name == "gtopk._gtopk":
        cause = "no such module"
    lines = [
        "gtopk: cannot import the compiled extension gtopk._gtopk (%s)."
        % cause,
        "  This interpreter: %s (Python %d.%d), package at %s." % (
            _sys.executable, _sys.version_info[0], _sys.version_info[1],
            here),
    ]
    if built:
        lines.append(
            "  Found %s, which was built for another interpreter or cannot "
            "load its libraries: run it with the interpreter it was built "
            "for (Debian's /usr/bin/python3) or rebuild." % ", ".join(built))
    else:
        lines.append("  The extension is not built here.")
    lines.append(
        "  Build it from the repository with `make python` (it needs "
        "Debian's pybind11-dev / python3-pybind11, and python3-torch for "
        "gtopk.torch; `make deps` installs them), then run "
        "`PYTHONPATH=<repo>/build/python /usr/bin/python3 ...`.")
    return "\n".join(lines)


try:
    import gtopk._gtopk as _gtopk
except ImportError as _e:  # not built, or built for another interpreter
    raise ImportError(_import_error_text(_e)) from _e

#: The worker client (``gtopk._gtopk.Client``); see its docstring.
Client = _gtopk.Client
#: Whether this build has the CUDA step (``Client.step_cuda``).
has_cuda = bool(_gtopk.has_cuda)
#: FNV-1a 64 of a float32 buffer's bytes: 16 lowercase hex digits, as the
#: ``param_checksum`` / ``server_checksum`` of ``gtopk-worker``'s summary.
checksum = _gtopk.checksum

__all__ = [
    "Client", "checksum", "has_cuda", "__version__",
    "StatusCode", "Error", "Cancelled", "Unknown", "InvalidArgument",
    "DeadlineExceeded", "NotFound", "AlreadyExists", "PermissionDenied",
    "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange",
    "Unimplemented", "Internal", "Unavailable", "DataLoss", "Unauthenticated",
    "from_status", "RETRYABLE",
]


def __getattr__(name):
    # PEP 562: `gtopk.torch` imports torch only when it is first used.
    if name == "torch":
        import importlib
        return importlib.import_module("gtopk.torch")
    raise AttributeError("module 'gtopk' has no attribute %r" % name)


def __dir__():
    return sorted(set(globals()) | {"torch"})

"""Where a bundle runs: the backend (Core ML or the MIL executor), the executor's precision and Core ML's compute
units, declared here once (the CLI's and the server's flags read their choices from here) and carried together as a
`Device` to every opener (backend.open_engine, drafter.open_drafter, encoder.open_image_encoder / open_audio_encoder).
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass

from ..bundle.errors import BundleError
from ..errors import DeviceError

log = logging.getLogger(__name__)
BACKENDS = ("auto", "coreml", "mil")
PRECISIONS = ("fp16", "fp32")  # the MIL executor's arithmetic between ops (Core ML's is the program's own)
COMPUTE_UNITS = {"cpu_and_ne": "CPU_AND_NE", "cpu_only": "CPU_ONLY", "cpu_and_gpu": "CPU_AND_GPU", "all": "ALL"}


class BackendError(BundleError, DeviceError):
    """A backend that cannot be opened here, or a chunk it cannot run; the message says which."""


def pick_backend(backend: str) -> str:
    """`auto` is Core ML on macOS and the MIL executor elsewhere (and says which it picked)."""
    if backend not in BACKENDS:
        raise BackendError(f"backend={backend!r}: choose {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "coreml" if platform.system() == "Darwin" else "mil"
        log.info("backend: %s (%s)", backend, "Core ML" if backend == "coreml" else "MIL executor")
    if backend == "coreml" and platform.system() != "Darwin":
        # said in words both a CLI user (--backend mil) and a Python caller (backend="mil") act on
        raise BackendError("backend coreml: Core ML prediction needs macOS; choose backend mil (the MIL executor)")
    return backend


@dataclass(frozen=True)
class Device:
    """A backend picked ("mil" or "coreml", never "auto": see `of`), the executor's precision, Core ML's compute
    units. Each backend checks the part it uses when it opens a model (the executor its precision, Core ML its
    units), as it always has."""

    backend: str
    precision: str = "fp16"
    compute_units: str = "cpu_and_ne"

    @classmethod
    def of(cls, backend: str = "auto", precision: str = "fp16", compute_units: str = "cpu_and_ne") -> Device:
        return cls(pick_backend(backend), precision, compute_units)

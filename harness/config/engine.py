"""What the configuration knows of engine=horovod: the Horovod that `make horovod`
builds, whether it loads here (checked before anything starts) and the columns a
result row records of it. Starting Horovod in the workers is harness/launch/horovod.py."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
from typing import Any

from omegaconf import DictConfig

from harness.config.schema import first_line

VERSION = "0.28.1"  # Horovod's last release; harness/install_horovod.py builds it
INSTALL = (f"build it into this venv with `make horovod` (Horovod {VERSION} from source, "
           "about 5 minutes)")


def version() -> str | None:
    """The installed Horovod's version, without loading it; None if none is installed."""
    try:
        return importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return None


def problem(*, device: str) -> str | None:
    """Why engine=horovod cannot run here on `device` ("cpu" or "cuda"), or None.

    Loads Horovod's torch library (quietly: a missing one only prints a warning on
    import), so a Horovod built against another torch is caught here too."""
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from horovod.torch import mpi_ops
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError: any failure to load
        return (f"engine=horovod needs Horovod, which cannot be loaded here "
                f"({type(exc).__name__}: {first_line(exc)}); {INSTALL}, or use engine=native")
    if not mpi_ops.gloo_built():
        return f"engine=horovod needs Horovod built with Gloo, and this one is not; {INSTALL}"
    if device == "cuda" and not mpi_ops.nccl_built():
        return ("engine=horovod on GPUs needs Horovod built with NCCL, and this one is not; "
                "rebuild it with `HOROVOD_GPU_OPERATIONS=NCCL make horovod` (README: Horovod "
                "as an engine), or use cluster.device=cpu")
    return None


def columns(cfg: DictConfig) -> dict[str, Any]:
    """The engine columns of a result row: Horovod's version and settings on engine=horovod."""
    on = cfg.engine == "horovod"
    settings = cfg.method.horovod
    return {"engine": cfg.engine, "horovod_version": version() if on else None,
            "horovod_fusion_threshold_bytes": settings.fusion_threshold_bytes if on else None,
            "horovod_cycle_time_s": settings.cycle_time_s if on else None,
            "horovod_cache_capacity": settings.cache_capacity if on else None}

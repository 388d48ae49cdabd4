"""The service's settings from the environment (pydantic-settings; the pipeline's are
:mod:`rangeprof.profiler.settings`).

=============================  ==============================================================
``RANGEPROF_DB``               the service's database URL (``--db``); default an SQLite file
``RANGEPROF_STORAGE``          the service's file store (``--storage``)
``RANGEPROF_DB_RETRY_S``       how long a worker retries a database error that can pass (a lost
                               connection, a serialization failure, a locked SQLite, a full
                               disk) before it gives up; default 60
``RANGEPROF_JOB_RETRIES``      how often a job whose worker died is queued again (default 1;
                               every job is idempotent), then it fails
``RANGEPROF_ANALYSIS_S``       wall time of an upload's analysis (a model loaded and tracked,
                               a data file read through), in a process of its own; then the
                               upload is refused (422); default 120
``RANGEPROF_ANALYSIS_MB``      memory that analysis may allocate (address space, beyond its
                               process's libraries; a model takes about 8 times its size);
                               default 8192
``RANGEPROF_JOB_MEMORY_MB``    a run's, evaluation's or build's memory: one whose estimated peak
                               is over it is refused (422), and its process cannot allocate
                               more (address space: it fails with "memory limit"); default 8192
=============================  ==============================================================

Read afresh at each call, a bad value one error naming its variable, as the pipeline's.
Command-line options, where a command has them, take precedence.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from rangeprof.profiler.settings import PREFIX, read


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    db: str | None = None
    storage: Path | None = None
    db_retry_s: float = Field(60.0, ge=0)
    job_retries: int = Field(1, ge=0)
    analysis_s: float = Field(120.0, gt=0)
    analysis_mb: int = Field(8192, gt=0)
    job_memory_mb: int = Field(8192, gt=0)


def settings() -> ServiceSettings:
    """The service's settings the environment gives now."""
    return read(ServiceSettings)

"""The service's settings from the environment (pydantic-settings; the pipeline's are
:mod:`rangeprof.profiler.settings`).

=============================  ==============================================================
``RANGEPROF_DB``               the service's database URL (``--db``); default an SQLite file
``RANGEPROF_STORAGE``          the service's file store (``--storage``)
=============================  ==============================================================

Read afresh at each call, a bad value one error naming its variable, as the pipeline's.
Command-line options, where a command has them, take precedence.
"""

from __future__ import annotations

from pathlib import Path

from pydantic_settings import BaseSettings, SettingsConfigDict

from rangeprof.profiler.settings import PREFIX, read


class ServiceSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    db: str | None = None
    storage: Path | None = None


def settings() -> ServiceSettings:
    """The service's settings the environment gives now."""
    return read(ServiceSettings)

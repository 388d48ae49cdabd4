"""The settings the pipeline and the targets read from the environment (pydantic-settings); the
service's own (``RANGEPROF_DB``, ``RANGEPROF_STORAGE``) are in :mod:`rangeprof.service.settings`.

=============================  ==============================================================
``RANGEPROF_CACHE``            the build cache folder, or ``off``; default ``~/.cache/rangeprof``
``RANGEPROF_RAY``              the service's runs on a Ray cluster: ``local`` or its address
``RANGEPROF_RAY_WORKERS``      Ray workers for those runs (default 2)
``RANGEPROF_NPU_SRAM_KB``      the NPU's on-chip buffer (default 256), read when the plugin is
                               obtained (``get_plugin("npu")``)
``RANGEPROF_AARCH64_RUNTIME``  the TVM runtime for aarch64 under qemu (default: in the cache)
``RANGEPROF_X86_MCPU``         the x86 CPU builds are for, an LLVM name (``haswell`` or
                               ``znver3``: AVX2, no VNNI); default this machine's; read when
                               the plugin is obtained
``XDG_CACHE_HOME``             where the default caches go (default ``~/.cache``)
=============================  ==============================================================

:func:`settings` reads them afresh at each call (a test or a long-lived server may change the
environment) and turns a bad value into one :class:`~rangeprof.profiler.errors.RangeprofError`
naming the variable (:func:`read`, which the service's settings use too). Command-line options,
where a command has them, take precedence.
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import AliasChoices, Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from rangeprof.profiler.errors import RangeprofError

PREFIX = "RANGEPROF_"
_S = TypeVar("_S", bound=BaseSettings)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", frozen=True)

    cache: str | None = None
    ray: str | None = None
    ray_workers: int = Field(2, gt=0)
    npu_sram_kb: int = Field(256, ge=1)
    aarch64_runtime: Path | None = None
    x86_mcpu: str | None = None
    xdg_cache_home: Path | None = Field(None, validation_alias=AliasChoices("XDG_CACHE_HOME"))

    @property
    def cache_home(self) -> Path:
        """The user's cache folder (``$XDG_CACHE_HOME``, else ``~/.cache``)."""
        return self.xdg_cache_home or Path.home() / ".cache"


def read(model: type[_S]) -> _S:
    """The settings of ``model`` the environment gives now; a bad value is a
    :class:`~rangeprof.profiler.errors.RangeprofError` naming its variable."""
    try:
        return model()
    except ValidationError as err:
        first = err.errors()[0]
        field = str(first["loc"][0])
        variable = "XDG_CACHE_HOME" if field == "XDG_CACHE_HOME" else PREFIX + field.upper()
        raise RangeprofError(f"{variable}={first['input']!r}: {first['msg']}") from None


def settings() -> Settings:
    """The settings the environment gives now."""
    return read(Settings)

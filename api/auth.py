"""API tokens: ``rangeprof token create NAME`` makes one; every API call presents it as
``Authorization: Bearer <token>``. Only the token's sha256 is stored, so a database leak does not
leak usable tokens; a token owns the models it uploaded and sees nothing else."""

from __future__ import annotations

import hashlib
import secrets
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select

from profiler.errors import RangeprofError

from .context import ServiceDep
from .db import Database
from .models import Token

_PREFIX = "rp_"
_bearer = HTTPBearer(auto_error=False, description="A token from `rangeprof token create NAME`.")


class TokenError(RangeprofError):
    """A token cannot be created as asked."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(db: Database, name: str) -> str:
    """A new token named ``name``; the caller shows it once, only its hash is kept."""
    if not name.strip() or len(name) > 200:
        raise TokenError(f"token name {name!r} must be 1 to 200 characters, not blank")
    token = _PREFIX + secrets.token_urlsafe(32)
    with db.session() as session:
        if session.scalar(select(Token.id).where(Token.name == name)) is not None:
            raise TokenError(f"a token named {name!r} exists already")
        session.add(Token(name=name, token_hash=token_hash(token)))
    return token


def _unauthorized(detail: str) -> HTTPException:
    return HTTPException(
        status.HTTP_401_UNAUTHORIZED, detail, headers={"WWW-Authenticate": "Bearer"}
    )


def current_owner(
    service: ServiceDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> int:
    """The id of the token the request presents; 401 without a valid one."""
    if credentials is None:
        raise _unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    with service.db.session() as session:
        owner = session.scalar(
            select(Token.id).where(Token.token_hash == token_hash(credentials.credentials))
        )
    if owner is None:
        raise _unauthorized("invalid bearer token")
    return owner


Owner = Annotated[int, Depends(current_owner)]

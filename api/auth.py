"""API tokens: ``rangeprof token create NAME [--expires-days D]`` makes one; every API call
presents it as ``Authorization: Bearer <token>``. Only the token's sha256 is stored, so a
database leak does not leak usable tokens; a token owns the models it uploaded and sees nothing
else. ``rangeprof token list`` shows them, ``rangeprof token revoke NAME`` (or ``DELETE
/api/token`` with the token itself) ends one; an expired or revoked token is 401, naming why."""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import Annotated

from fastapi import Depends, HTTPException, status
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select

from rangeprof.profiler.errors import RangeprofError

from .context import ServiceDep
from .db import Database
from .models import Token, utcnow

_PREFIX = "rp_"
_bearer = HTTPBearer(auto_error=False, description="A token from `rangeprof token create NAME`.")


class TokenError(RangeprofError):
    """A token cannot be created as asked."""


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_token(db: Database, name: str, expires_in: timedelta | None = None) -> str:
    """A new token named ``name`` (valid for ``expires_in``, or until revoked); the caller
    shows it once, only its hash is kept."""
    if not name.strip() or len(name) > 200:
        raise TokenError(f"token name {name!r} must be 1 to 200 characters, not blank")
    if expires_in is not None and expires_in <= timedelta(0):
        raise TokenError(f"a token must be valid for some time, not {expires_in}")
    token = _PREFIX + secrets.token_urlsafe(32)
    expires_at = None if expires_in is None else utcnow() + expires_in
    with db.session() as session:
        if session.scalar(select(Token.id).where(Token.name == name)) is not None:
            raise TokenError(f"a token named {name!r} exists already")
        session.add(Token(name=name, token_hash=token_hash(token), expires_at=expires_at))
    return token


def list_tokens(db: Database) -> list[dict]:
    """Every token's name, dates and state (never the token: only its hash is kept)."""
    with db.session() as session:
        return [_described(t) for t in session.scalars(select(Token).order_by(Token.id))]


def revoke_token(db: Database, name: str) -> None:
    """End the token named ``name`` now; its models stay, unreachable until deleted."""
    with db.session() as session:
        token = session.scalar(select(Token).where(Token.name == name))
        if token is None:
            raise TokenError(f"no token named {name!r}")
        if token.revoked_at is not None:
            raise TokenError(f"token {name!r} was revoked already")
        token.revoked_at = utcnow()


def _described(token: Token) -> dict:
    return {
        "name": token.name,
        "created_at": token.created_at,
        "expires_at": token.expires_at,
        "revoked_at": token.revoked_at,
        "state": _state(token) or "valid",
    }


def _state(token: Token) -> str | None:
    """Why the token is no longer valid, if it is not."""
    if token.revoked_at is not None:
        return "revoked"
    if token.expires_at is not None and token.expires_at <= utcnow():
        return "expired"
    return None


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
    with service.db.read() as session:
        token = session.scalar(
            select(Token).where(Token.token_hash == token_hash(credentials.credentials))
        )
        if token is None:
            raise _unauthorized("invalid bearer token")
        ended = _state(token)
        if ended is not None:
            raise _unauthorized(f"bearer token {ended}")
        return token.id


Owner = Annotated[int, Depends(current_owner)]

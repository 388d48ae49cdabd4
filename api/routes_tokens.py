"""``/api/token``: the presented token itself, shown or revoked (tokens are made and listed with
``rangeprof token``, on the server's machine)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from .auth import Owner
from .context import RetriedReads, ServiceDep
from .models import Token, utcnow
from .schemas import TokenOut

router = APIRouter(prefix="/api/token", tags=["tokens"], route_class=RetriedReads)


@router.get("")
def get_token(service: ServiceDep, owner: Owner) -> TokenOut:
    """The presented token's name and dates."""
    with service.db.read() as session:
        return TokenOut.model_validate(session.get(Token, owner))


@router.delete("", status_code=status.HTTP_204_NO_CONTENT)
def revoke_token(service: ServiceDep, owner: Owner) -> Response:
    """Revoke the presented token now: every later request with it is 401."""
    with service.db.session() as session:
        session.get(Token, owner).revoked_at = utcnow()
    return Response(status_code=status.HTTP_204_NO_CONTENT)

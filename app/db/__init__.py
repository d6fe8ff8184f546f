"""CASI's database layer: SQLAlchemy 2 models (`models`), engines and Alembic (`session`),
and repositories that never commit (`repositories`). Services own the transaction."""

from app.db.models import (
    ApiKey,
    AuditReport,
    Base,
    CreditRecord,
    PolicyKind,
    PolicyVersion,
    RunStatus,
    StepMetric,
    TrainingRun,
)
from app.db.session import (
    make_engine,
    make_session_factory,
    session_scope,
    upgrade_to_head,
)

__all__ = [
    "ApiKey",
    "AuditReport",
    "Base",
    "CreditRecord",
    "PolicyKind",
    "PolicyVersion",
    "RunStatus",
    "StepMetric",
    "TrainingRun",
    "make_engine",
    "make_session_factory",
    "session_scope",
    "upgrade_to_head",
]

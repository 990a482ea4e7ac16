"""models a worker refused at load, with why (issue 32)

Revision ID: 0009_model_refusals
Revises: 0008_shared_failures
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009_model_refusals"
down_revision: str | None = "0008_shared_failures"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "worker_heartbeats",
        sa.Column("refused", sa.Text(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_column("worker_heartbeats", "refused")

"""runs of a line that failed with other lines in them

Revision ID: 0008_shared_failures
Revises: 0007_dashboard_sessions
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008_shared_failures"
down_revision: str | None = "0007_dashboard_sessions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column(
        "batch_requests",
        sa.Column("shared_failures", sa.Integer(), nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_column("batch_requests", "shared_failures")

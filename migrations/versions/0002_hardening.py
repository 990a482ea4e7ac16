"""hardening: infrastructure failures per line, failed runs per batch

Revision ID: 0002_hardening
Revises: 0001
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002_hardening"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("batch_requests") as table:
        table.add_column(
            sa.Column("infra_failures", sa.Integer(), nullable=False, server_default="0")
        )
    with op.batch_alter_table("batches") as table:
        table.add_column(sa.Column("failures", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("batches") as table:
        table.drop_column("failures")
    with op.batch_alter_table("batch_requests") as table:
        table.drop_column("infra_failures")

"""prefix keys on request lines, cached-token usage

Revision ID: 0005_prefix
Revises: 0004_lifecycle
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005_prefix"
down_revision: str | None = "0004_lifecycle"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("batch_requests", sa.Column("prefix_key", sa.String(length=16), nullable=True))
    op.add_column(
        "batch_requests",
        sa.Column("cached_tokens", sa.Integer(), nullable=False, server_default="0"),
    )
    op.add_column(
        "batches", sa.Column("cached_tokens", sa.BigInteger(), nullable=False, server_default="0")
    )


def downgrade() -> None:
    op.drop_column("batches", "cached_tokens")
    op.drop_column("batch_requests", "cached_tokens")
    op.drop_column("batch_requests", "prefix_key")

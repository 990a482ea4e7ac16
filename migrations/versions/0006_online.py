"""online requests: a usage row per request, per-project online rate limits

Revision ID: 0006_online
Revises: 0005_prefix
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_online"
down_revision: str | None = "0005_prefix"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.add_column("projects", sa.Column("online_requests_per_minute", sa.BigInteger()))
    op.add_column("projects", sa.Column("online_tokens_per_minute", sa.BigInteger()))
    op.create_table(
        "online_requests",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("project_id", sa.String(length=40), nullable=False),
        sa.Column("key_id", sa.String(length=40), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.Float(), nullable=False),
        sa.Column("stream", sa.Boolean(), nullable=False),
        sa.Column("status", sa.Integer(), nullable=False),
        sa.Column("error_code", sa.String(length=64), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("time_to_first_token", sa.Float(), nullable=True),
        sa.Column("duration", sa.Float(), nullable=False),
        sa.Column("finish_reasons", sa.JSON(), nullable=True),
        sa.Column("disconnected", sa.Boolean(), nullable=False),
        sa.ForeignKeyConstraint(
            ["project_id"],
            ["projects.id"],
            name=op.f("fk_online_requests_project_id_projects"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_online_requests")),
    )
    op.create_index(
        "ix_online_requests_project_created", "online_requests", ["project_id", "created_at"]
    )


def downgrade() -> None:
    op.drop_index("ix_online_requests_project_created", table_name="online_requests")
    op.drop_table("online_requests")
    op.drop_column("projects", "online_tokens_per_minute")
    op.drop_column("projects", "online_requests_per_minute")

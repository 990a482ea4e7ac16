"""shared service: worker heartbeats, per-project weights and quotas, batch token counts

Revision ID: 0003_service
Revises: 0002_hardening
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003_service"
down_revision: str | None = "0002_hardening"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_heartbeats",
        sa.Column("id", sa.String(length=200), nullable=False),
        sa.Column("host", sa.String(length=200), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("models", sa.Text(), nullable=False),
        sa.Column("loaded", sa.Text(), nullable=False),
        sa.Column("control", sa.Boolean(), nullable=False),
        sa.Column("rows_in_flight", sa.Integer(), nullable=False),
        sa.Column("tokens_per_second", sa.Float(), nullable=False),
        sa.Column("lines_completed", sa.BigInteger(), nullable=False),
        sa.Column("started_at", sa.Float(), nullable=False),
        sa.Column("last_seen", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_worker_heartbeats")),
    )
    op.create_index(
        op.f("ix_worker_heartbeats_last_seen"), "worker_heartbeats", ["last_seen"], unique=False
    )
    with op.batch_alter_table("projects") as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("max_enqueued_lines", sa.BigInteger(), nullable=True))
        batch_op.add_column(sa.Column("max_enqueued_tokens", sa.BigInteger(), nullable=True))
    with op.batch_alter_table("batches") as batch_op:
        batch_op.add_column(sa.Column("enqueued_tokens", sa.BigInteger(), nullable=True))
    # Fair share counts the lines each batch holds in flight per model: running rows only.
    op.create_index(
        "ix_batch_requests_running",
        "batch_requests",
        ["batch_id"],
        unique=False,
        postgresql_where=sa.text("state = 'running'"),
        sqlite_where=sa.text("state = 'running'"),
    )


def downgrade() -> None:
    op.drop_index("ix_batch_requests_running", table_name="batch_requests")
    with op.batch_alter_table("batches") as batch_op:
        batch_op.drop_column("enqueued_tokens")
    with op.batch_alter_table("projects") as batch_op:
        batch_op.drop_column("max_enqueued_tokens")
        batch_op.drop_column("max_enqueued_lines")
        batch_op.drop_column("weight")
    op.drop_index(op.f("ix_worker_heartbeats_last_seen"), table_name="worker_heartbeats")
    op.drop_table("worker_heartbeats")

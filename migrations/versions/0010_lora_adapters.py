"""LoRA adapters added at run time, and the adapters each worker holds

Revision ID: 0010_lora_adapters
Revises: 0009_model_refusals
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_lora_adapters"
down_revision: str | None = "0009_model_refusals"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("base", sa.String(200), nullable=False),
        sa.Column("path", sa.Text(), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("target_modules", sa.Text(), nullable=False),
        sa.Column("created_at", sa.BigInteger(), nullable=False),
    )
    op.create_index("ix_lora_adapters_base", "lora_adapters", ["base"])
    op.add_column(
        "worker_heartbeats",
        sa.Column("adapters", sa.Text(), nullable=False, server_default=""),
    )


def downgrade() -> None:
    op.drop_column("worker_heartbeats", "adapters")
    op.drop_index("ix_lora_adapters_base", table_name="lora_adapters")
    op.drop_table("lora_adapters")

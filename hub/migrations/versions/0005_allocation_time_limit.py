"""an allocation's time limit (the queue estimates starts from it)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-07
"""
from alembic import op
import sqlalchemy as sa


revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.add_column(sa.Column('max_runtime', sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.drop_column('max_runtime')

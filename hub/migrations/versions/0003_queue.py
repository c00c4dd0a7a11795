"""the GPU queue's entries

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-05
"""
from alembic import op
import sqlalchemy as sa


revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('queue_entries',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('pool', sa.String(length=64), nullable=False),
    sa.Column('user', sa.String(length=255), nullable=False),
    sa.Column('groups', sa.Text(), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('holder', sa.String(length=255), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=True),
    sa.Column('submitted_at', sa.Float(), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('max_runtime', sa.Float(), nullable=True),
    sa.Column('preemptible', sa.Integer(), nullable=False),
    sa.Column('wait_until', sa.Float(), nullable=True),
    sa.Column('held', sa.Integer(), nullable=False),
    sa.Column('top_at', sa.Float(), nullable=True),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('allocation_id', sa.String(length=32), nullable=True),
    sa.Column('borrowed', sa.Integer(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('queue_entries', schema=None) as batch_op:
        batch_op.create_index('ix_queue_entries_pool_state', ['pool', 'state'], unique=False)
        batch_op.create_index('ix_queue_entries_holder', ['user', 'kind', 'holder'], unique=False)
        batch_op.create_index('ix_queue_entries_allocation', ['allocation_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('queue_entries', schema=None) as batch_op:
        batch_op.drop_index('ix_queue_entries_allocation')
        batch_op.drop_index('ix_queue_entries_holder')
        batch_op.drop_index('ix_queue_entries_pool_state')
    op.drop_table('queue_entries')

"""ledger: pools, devices, quotas, audit, allocations

Revision ID: 0001
Revises: 
Create Date: 2026-12-02
"""
from alembic import op
import sqlalchemy as sa


revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table('pools',
    sa.Column('name', sa.String(length=64), nullable=False),
    sa.Column('assigns_devices', sa.Integer(), nullable=False),
    sa.PrimaryKeyConstraint('name')
    )
    op.create_table('quota_audit',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('at', sa.Float(), nullable=False),
    sa.Column('actor', sa.String(length=255), nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('old', sa.Text(), nullable=True),
    sa.Column('new', sa.Text(), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('quota_audit', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_quota_audit_at'), ['at'], unique=False)

    op.create_table('quotas',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('scope', sa.String(length=16), nullable=False),
    sa.Column('name', sa.String(length=255), nullable=False),
    sa.Column('max_gpus', sa.Integer(), nullable=False),
    sa.Column('max_per_request', sa.Integer(), nullable=True),
    sa.Column('gpu_hours', sa.Float(), nullable=True),
    sa.Column('window_hours', sa.Integer(), nullable=True),
    sa.Column('updated_at', sa.Float(), nullable=False),
    sa.Column('updated_by', sa.String(length=255), nullable=False),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('scope', 'name', name='uq_quotas_scope_name')
    )
    op.create_table('allocations',
    sa.Column('id', sa.String(length=32), nullable=False),
    sa.Column('pool', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('holder', sa.String(length=255), nullable=False),
    sa.Column('user', sa.String(length=255), nullable=False),
    sa.Column('gpus', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=True),
    sa.Column('devices', sa.Text(), nullable=False),
    sa.Column('started_at', sa.Float(), nullable=False),
    sa.Column('ended_at', sa.Float(), nullable=True),
    sa.Column('end_reason', sa.String(length=255), nullable=False),
    sa.ForeignKeyConstraint(['pool'], ['pools.name'], ),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.create_index('ix_allocations_open', ['ended_at', 'pool'], unique=False)
        batch_op.create_index('ix_allocations_user_time', ['user', 'started_at'], unique=False)

    op.create_table('devices',
    sa.Column('pool', sa.String(length=64), nullable=False),
    sa.Column('index', sa.Integer(), nullable=False),
    sa.Column('uuid', sa.String(length=128), nullable=False),
    sa.Column('model', sa.String(length=128), nullable=False),
    sa.Column('memory_mib', sa.Integer(), nullable=False),
    sa.Column('simulated', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['pool'], ['pools.name'], ),
    sa.PrimaryKeyConstraint('pool', 'index')
    )


def downgrade() -> None:
    op.drop_table('devices')
    with op.batch_alter_table('allocations', schema=None) as batch_op:
        batch_op.drop_index('ix_allocations_user_time')
        batch_op.drop_index('ix_allocations_open')

    op.drop_table('allocations')
    op.drop_table('quotas')
    with op.batch_alter_table('quota_audit', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_quota_audit_at'))

    op.drop_table('quota_audit')
    op.drop_table('pools')

"""payments and idempotency keys

The example's first revision: its own ``payments`` table and the records table
of Flask-Idempotency, which ``Idempotency(db=db)`` defines on ``db.metadata`` so
``flask db migrate`` generated it alongside. Hand-checked against
``flask_idempotency/store/table.py``: the unique constraint on ``key_digest`` is what
lets exactly one concurrent first request claim a key (C8); the index on
``expires_at_ms`` serves ``flask idempotency prune``; ``body_omitted`` has a
server default so the column can be filled on a populated table.

Revision ID: f048528d1498
Revises:
Create Date: 2026-11-21 20:18:01.068530

"""
from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision = 'f048528d1498'
down_revision = None
branch_labels = None
depends_on = None


def upgrade():
    op.create_table('payments',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('amount_cents', sa.Integer(), nullable=False),
    sa.Column('currency', sa.String(length=3), nullable=False),
    sa.Column('description', sa.String(length=255), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )

    op.create_table('idempotency_keys',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('key_digest', sa.String(length=64), nullable=False, comment='sha256(scope, key)'),
    sa.Column('scope', sa.Text(), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('method', sa.String(length=16), nullable=False),
    sa.Column('path', sa.Text(), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('lock_token', sa.String(length=32), nullable=True),
    sa.Column('created_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('expires_at_ms', sa.BigInteger(), nullable=False),
    sa.Column('lease_expires_at_ms', sa.BigInteger(), nullable=True),
    sa.Column('completed_at_ms', sa.BigInteger(), nullable=True),
    sa.Column('response_status', sa.Integer(), nullable=True),
    sa.Column('response_headers', sa.Text(), nullable=True),
    sa.Column('response_body', sa.LargeBinary(), nullable=True),
    sa.Column('body_omitted', sa.Boolean(), server_default=sa.false(), nullable=False),
    sa.CheckConstraint("state IN ('in_progress', 'completed')", name='ck_idempotency_keys_state'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('key_digest', name='uq_idempotency_keys_key_digest'),
    comment='Flask-Idempotency records: one row per (scope, Idempotency-Key).'
    )
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.create_index('ix_idempotency_keys_expires_at_ms', ['expires_at_ms'], unique=False)


def downgrade():
    with op.batch_alter_table('idempotency_keys', schema=None) as batch_op:
        batch_op.drop_index('ix_idempotency_keys_expires_at_ms')

    op.drop_table('idempotency_keys')
    op.drop_table('payments')

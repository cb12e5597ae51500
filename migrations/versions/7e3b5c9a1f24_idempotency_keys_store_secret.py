"""idempotency keys store secret

The store's secret (issue 34, C60): a ``secret`` column on ``idempotency_keys_store``.
Keys derived from it authenticate every value the Redis tier writes (a service that
shares only the Redis can no longer forge a cached answer) and key the default
scope's HMAC of ``Authorization`` when the app sets neither
``IDEMPOTENCY_SCOPE_SECRET`` nor ``SECRET_KEY``. Hand-checked against
``flask_idempotency/store/identity.py``.

The column is added empty: the first process that reads the store's identity draws
the secret from Python's ``secrets`` and writes it where the row has none (racing
processes agree: only a NULL is ever replaced). No SQL expression draws it, so no
database's random generator is trusted with it, and one script applied to several
databases (``flask db upgrade --sql``) never gives them the same secret.

Revision ID: 7e3b5c9a1f24
Revises: d921ddd355bf
Create Date: 2026-11-28 16:00:00.000000

"""
from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision = '7e3b5c9a1f24'
down_revision = 'd921ddd355bf'
branch_labels = None
depends_on = None


def upgrade():
    with op.batch_alter_table('idempotency_keys_store', schema=None) as batch_op:
        batch_op.add_column(
            sa.Column('secret', sa.String(length=64), nullable=True,
                      comment='random; keys the MAC of cached values; never leaves the database')
        )


def downgrade():
    with op.batch_alter_table('idempotency_keys_store', schema=None) as batch_op:
        batch_op.drop_column('secret')

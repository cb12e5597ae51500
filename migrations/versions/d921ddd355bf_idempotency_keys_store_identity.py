"""idempotency keys store identity

The records table's companion, ``idempotency_keys_store`` (issue 26 item 6, C41):
one row holding a random ``id`` that names this store in a shared Redis. The Redis
tier used to name a store by the text of its database URL, and two services whose
URLs read the same but reach different databases shared each other's cached
responses. Hand-checked against ``flask_idempotency/store/identity.py``.

The id is drawn by the database itself, so each database upgraded with this
revision gets its own, also from one SQL script applied to several databases
(``flask db upgrade --sql``). Should the row be missing (a database copied without
it, a row deleted to give a copy an identity of its own), the first process that
uses Redis writes a new one.

Revision ID: d921ddd355bf
Revises: 3c1d2e7a9b40
Create Date: 2026-11-25 19:13:09.000000

"""
from alembic import op
import sqlalchemy as sa


# revision identifiers, used by Alembic.
revision = 'd921ddd355bf'
down_revision = '3c1d2e7a9b40'
branch_labels = None
depends_on = None

#: A random id (32 hex characters) and the database clock in epoch milliseconds, in
#: each database's own words (the clock as flask_idempotency/store/dialects writes it).
IDENTITY_ROW = {
    'postgresql': (
        "md5(random()::text || clock_timestamp()::text || pg_backend_pid()::text)",
        "CAST(EXTRACT(EPOCH FROM statement_timestamp()) * 1000 AS BIGINT)",
    ),
    'mysql': (
        "MD5(CONCAT(UUID(), RAND()))",
        "CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(3)) DIV 1000"
        " AS SIGNED)",
    ),
    'sqlite': (
        "lower(hex(randomblob(16)))",
        "(CAST(strftime('%s', 'now') AS INTEGER) * 1000"
        " + CAST(substr(strftime('%f', 'now'), 4) AS INTEGER))",
    ),
}
IDENTITY_ROW['mariadb'] = IDENTITY_ROW['mysql']


def upgrade():
    op.create_table('idempotency_keys_store',
    sa.Column('singleton', sa.Integer(), autoincrement=False, nullable=False),
    sa.Column('id', sa.String(length=32), nullable=False,
              comment='random; names the store in Redis'),
    sa.Column('created_at_ms', sa.BigInteger(), nullable=False),
    sa.CheckConstraint('singleton = 1', name='ck_idempotency_keys_store_singleton'),
    sa.PrimaryKeyConstraint('singleton'),
    comment="Flask-Idempotency: this store's identity (one row), which names its"
            " records in a shared Redis.",
    mysql_engine='InnoDB',
    mysql_charset='utf8mb4',
    )
    row = IDENTITY_ROW.get(op.get_context().dialect.name)
    if row is not None:  # elsewhere the first process that uses Redis writes it
        random_id, now_ms = row
        op.execute(
            'INSERT INTO idempotency_keys_store (singleton, id, created_at_ms)'
            f' VALUES (1, {random_id}, {now_ms})'
        )


def downgrade():
    op.drop_table('idempotency_keys_store')

"""idempotency keys on MySQL and MariaDB

Additive, and a no-op on PostgreSQL and SQLite. On MySQL and MariaDB the first
revision's ``LargeBinary`` became ``BLOB``, which stops at 64 KiB: the stored
response body becomes ``LONGBLOB`` (what ``flask_idempotency/store/table.py`` defines
there), and the table uses utf8mb4 so any scope or path fits, whatever the
database's default character set.

Revision ID: 3c1d2e7a9b40
Revises: f048528d1498
Create Date: 2026-11-23 14:50:00.000000

"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import mysql


# revision identifiers, used by Alembic.
revision = '3c1d2e7a9b40'
down_revision = 'f048528d1498'
branch_labels = None
depends_on = None

MYSQL_FAMILY = ('mysql', 'mariadb')


def upgrade():
    if op.get_bind().dialect.name not in MYSQL_FAMILY:
        return
    # Column by column, not CONVERT TO: that would widen TEXT to MEDIUMTEXT.
    op.execute(
        'ALTER TABLE idempotency_keys DEFAULT CHARACTER SET utf8mb4,'
        ' MODIFY scope TEXT CHARACTER SET utf8mb4 NOT NULL,'
        ' MODIFY path TEXT CHARACTER SET utf8mb4 NOT NULL,'
        ' MODIFY response_headers TEXT CHARACTER SET utf8mb4 NULL'
    )
    op.alter_column(
        'idempotency_keys', 'response_body',
        existing_type=sa.LargeBinary(), type_=mysql.LONGBLOB(), existing_nullable=True,
    )


def downgrade():
    if op.get_bind().dialect.name not in MYSQL_FAMILY:
        return
    op.alter_column(
        'idempotency_keys', 'response_body',
        existing_type=mysql.LONGBLOB(), type_=sa.LargeBinary(), existing_nullable=True,
    )

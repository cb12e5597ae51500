"""A primary failover under load: Patroni, etcd and two PostgreSQL nodes (issue 25, C55)."""

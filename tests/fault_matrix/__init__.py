"""The fault matrix of the store's writes (CONTRACT C58, C59; issue 33 item 7).

Each store write, under each way it can fail, on each database it runs on, with the
outcome the contract promises. The cells live in this package, one module per kind
of fault, each with its own table in its docstring; a few older cells that already
proved a row live beside the code they cover, and are named here.

Faults: **lost** — the connection is lost after the statement was sent, before the
reply (the write may have landed); **cut** — the statement waits on a lock past the
statement deadline; **refused** — the database refuses the write for good; **outage >
lease** — the store is unreachable for longer than what is left of the lease; **exit**
— the process ends with the write still pending. Databases: pg2 = psycopg2, pg3 =
psycopg 3, my = MariaDB (PyMySQL), lite = SQLite; "+bouncer" = through PgBouncer in
transaction mode.

write × fault -> outcome (where; databases):

claim
  lost        recognised as ours (test_store_faults c8; pg2 pg3 my); no reply, commits
              later: a kept fenced release frees it (test_cut_statements; pg2)
  cut         cancelled on the server, the retry runs the view, never 409
              (test_cut_statements; pg2 pg3 my, pg2 and pg3 through PgBouncer)
  refused     --- (it carries no body; the key and fingerprint are bounded before it)
  outage      503, nothing held, nothing in Redis (test_store_identity c25; chaos
              database cut; pg2 pg3 my)
  exit        --- (nothing pending: the client got its 503)
renew
  lost, cut   no cell of its own: a renewal sets an expiry by token and the next round
              repeats it; store/deadline.py cancels a cut renewal as it cancels a claim
  refused     --- (it writes only an expiry)
  outage      a kept completion's lease renewed whenever the store answers (test_leases;
              pg2 pg3)
  exit        the next process renews adopted leases by token (test_handover; pg2 pg3)
complete
  lost        an earlier try that landed is recognised on every try (test_own_landings;
              pg2 pg3 my lite)
  cut         committed after the deadline: landed, promoted, no lease_lost
              (test_own_landings; pg2 pg3)
  refused     over max_allowed_packet (my) or 54000 (pg2 pg3): stored without its body;
              22003 even without it: released once; kept, then refused: lands without its
              body (test_refusals)
  outage      never taken over by the keeping process (test_leases); lands when the store
              answers (test_deferred); pg2 pg3
  exit        handed on through the spool, landed by the next process (test_handover;
              pg2 pg3 my lite); gunicorn --max-requests during a 16 s outage: 0 views run
              again (deploy/test_recycled_workers)
release
  lost, cut   recognised; claim_released, no lease_lost (test_own_landings; pg2 pg3 my lite)
  refused     released once as store-refused (test_refusals; pg2 pg3)
  outage      lands and frees the key (test_deferred; pg2 pg3)
  exit        handed on, also the release of a claim that got no reply (test_handover;
              pg2 pg3)
once()
  refused     its result omitted (test_refusals; pg2 pg3); lost, cut, outage as complete
  exit        handed on (test_handover; lite)
identity read
  outage      503, nothing in Redis (test_store_identity c25); read once per process, 16
              racing threads -> 1 SELECT; the tier back within one step of the table
              appearing (test_tier_resume)

What is left is stated in docs/guarantees.md under C58 and C59 (a host that dies with its
spool; a completion refused even without its body while it was kept; an outage longer
than the lease across processes, with the lease to choose for a failover time).
"""

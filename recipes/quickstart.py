"""The quick start: one app, one protected endpoint (``flask --app quickstart run``)."""

import itertools

from flask import Flask, request

from flask_idempotency import Idempotency, idempotent, release_claim

app = Flask(__name__)
app.config.from_prefixed_env()  # e.g. FLASK_IDEMPOTENCY_REDIS_URL=redis://localhost:6379/0
idempotency = Idempotency(app)  # records: a SQLite file in app.instance_path
payment_ids = itertools.count(1)


@idempotency.scope_loader
def key_owner():
    """Whose key is this? Keys of two scopes never meet."""
    return request.headers.get("X-Account")  # demo only: return your authenticated user's id


@app.post("/payments")
@idempotent(required=True)  # or bare @idempotent: the key is then optional
def create_payment():
    data = request.get_json(silent=True)
    amount = data.get("amount_cents") if isinstance(data, dict) else None
    if not isinstance(amount, int) or amount <= 0:
        release_claim()  # nothing happened: the client may fix it and reuse the key
        problem = {
            "title": "Invalid payment",
            "status": 400,
            "detail": "amount_cents must be a positive integer",
        }
        return problem, 400, {"Content-Type": "application/problem+json"}
    payment = {"id": next(payment_ids), "amount_cents": amount}  # charge the card here
    return payment, 201, {"Location": f"/payments/{payment['id']}"}

"""App factory, blueprints, Flask-SQLAlchemy, and keys scoped to the Flask-Login user.

The records table lives in the app's own database (``Idempotency(db=db)``), so
``flask db migrate`` generates it next to your models. Each logged-in user has a
key space of their own: the scope loader returns ``current_user.get_id()``, and
two users who happen to send the same key never see each other's responses.

Run it: ``flask --app recipes.factory_login run`` (it creates a demo user whose
token is ``demo-token``), then::

    curl -i -X POST localhost:5000/api/payments -H 'Authorization: Bearer demo-token' \\
        -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' \\
        -d '{"amount_cents": 500}'
"""

from __future__ import annotations

from typing import Any

from flask import Blueprint, Flask, Request, request, url_for
from flask_login import LoginManager, UserMixin, current_user, login_required
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy import ForeignKey, String, select
from sqlalchemy.orm import Mapped, mapped_column

from flask_idempotency import Idempotency, idempotent, release_claim

db = SQLAlchemy()
login_manager = LoginManager()
idempotency = Idempotency(db=db)  # the table joins db.metadata; the store uses db's engine


class User(UserMixin, db.Model):  # type: ignore[name-defined,misc]
    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(80))
    api_token: Mapped[str] = mapped_column(String(64), unique=True)


class Payment(db.Model):  # type: ignore[name-defined,misc]
    id: Mapped[int] = mapped_column(primary_key=True)
    user_id: Mapped[int] = mapped_column(ForeignKey("user.id"))
    amount_cents: Mapped[int]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "amount_cents": self.amount_cents}


@login_manager.request_loader
def user_from_token(req: Request) -> User | None:
    """An API logs in by bearer token; a browser app would use the session instead."""
    token = req.headers.get("Authorization", "").removeprefix("Bearer ").strip()
    if not token:
        return None
    return db.session.scalar(select(User).filter_by(api_token=token))


@idempotency.scope_loader
def key_owner() -> str | None:
    """Keys belong to the logged-in user (C5). ``None`` when nobody is logged in."""
    return current_user.get_id()


payments = Blueprint("payments", __name__, url_prefix="/api")


@payments.post("/payments")
@idempotent(required=True, atomic=True)  # the payment and the stored answer commit together
@login_required
def create_payment() -> Any:
    data = request.get_json(silent=True)
    amount = data.get("amount_cents") if isinstance(data, dict) else None
    if not isinstance(amount, int) or amount <= 0:
        release_claim()  # nothing was done: the corrected request may reuse the key
        return {"error": "amount_cents must be a positive integer"}, 400
    payment = Payment(user_id=current_user.id, amount_cents=amount)
    db.session.add(payment)
    db.session.flush()  # atomic=True: flush, never commit; the extension commits
    location = url_for("payments.get_payment", payment_id=payment.id)
    return payment.to_json(), 201, {"Location": location}


@payments.get("/payments/<int:payment_id>")
@login_required
def get_payment(payment_id: int) -> Any:
    payment = db.session.get(Payment, payment_id)
    if payment is None or payment.user_id != current_user.id:
        return {"error": "no such payment"}, 404
    return payment.to_json()


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///recipe-payments.sqlite3"  # instance/
    app.config.from_prefixed_env()  # FLASK_SQLALCHEMY_DATABASE_URI=postgresql+psycopg2://…
    app.config.update(config or {})
    db.init_app(app)
    login_manager.init_app(app)
    idempotency.init_app(app)
    app.register_blueprint(payments)
    with app.app_context():
        db.create_all()  # a real app runs `flask db upgrade` (Flask-Migrate) instead
        if app.config.get("DEMO_USER", True) and db.session.get(User, 1) is None:
            db.session.add(User(id=1, name="demo", api_token="demo-token"))
            db.session.commit()
    return app

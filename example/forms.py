"""A server-rendered checkout: the double-clicked "Pay" button must not order twice (C49).

    flask --app example.forms run --with-threads      # SQLite in instance/ by default
    DATABASE_URL=postgresql://… flask --app example.forms run

``GET /checkout`` renders the form with ``{{ idempotency_key_field() }}``: a hidden
input with a fresh random key. ``POST /checkout`` is ``@idempotent``: a second
submit of the same rendered form (a double click, or the back button and Pay
again) replays the first answer, a 303 to the same confirmation page, instead of
placing a second order (Post/Redirect/Get). Flask-WTF checks the CSRF token;
the token and the key field are left out of the request's fingerprint.

The page carries no ``Cache-Control: no-store``: the back button then shows the
page the browser kept, with the same key. Rendering the form again is a new key,
a new order, which is what a shopper who reloads the checkout expects.
"""

from __future__ import annotations

import os
import secrets
import time
from datetime import datetime, timezone
from typing import Any

from flask import Flask, abort, current_app, redirect, render_template, session, url_for
from flask_sqlalchemy import SQLAlchemy
from flask_wtf import CSRFProtect, FlaskForm
from sqlalchemy import DateTime, Integer, String
from sqlalchemy.orm import Mapped, mapped_column
from werkzeug.wrappers import Response
from wtforms import IntegerField, SelectField
from wtforms.validators import NumberRange

from flask_idempotency import Idempotency, idempotent, release_claim

db = SQLAlchemy()
idempotency = Idempotency(db=db)
csrf = CSRFProtect()

ITEMS = {"tea": ("Green tea, 100 g", 650), "mug": ("Stoneware mug", 1800)}


class Order(db.Model):  # type: ignore[name-defined,misc]
    """An order placed at checkout: the side effect a resubmitted form must not repeat."""

    __tablename__ = "checkout_orders"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    shopper: Mapped[str] = mapped_column(String(64), nullable=False)
    item: Mapped[str] = mapped_column(String(16), nullable=False)
    quantity: Mapped[int] = mapped_column(Integer, nullable=False)
    total_cents: Mapped[int] = mapped_column(Integer, nullable=False)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), nullable=False, default=lambda: datetime.now(timezone.utc)
    )


class CheckoutForm(FlaskForm):  # type: ignore[misc]
    item = SelectField("Item", choices=list(ITEMS))  # plain values: no deprecated tuples
    quantity = IntegerField("Quantity", default=1, validators=[NumberRange(1, 10)])


@idempotency.scope_loader
def shopper_scope() -> str | None:
    """Keys belong to the shopper's session: one shopper never replays another's order."""
    return session.get("shopper")


def create_app(config: dict[str, Any] | None = None) -> Flask:
    app = Flask(__name__)
    database_url = os.environ.get("DATABASE_URL", "")
    if database_url.startswith("postgres://"):
        database_url = "postgresql+psycopg2://" + database_url[len("postgres://") :]
    app.config.update(
        SECRET_KEY=os.environ.get("SECRET_KEY") or secrets.token_hex(16),
        SQLALCHEMY_DATABASE_URI=database_url or None,
        #: Seconds the (simulated) payment takes: room for a second click to arrive.
        CHECKOUT_LATENCY=float(os.environ.get("CHECKOUT_LATENCY", "0.5")),
    )
    app.config.update(config or {})
    if not app.config["SQLALCHEMY_DATABASE_URI"]:
        os.makedirs(app.instance_path, exist_ok=True)
        path = os.path.join(app.instance_path, "checkout.sqlite3")
        app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///" + path
    db.init_app(app)
    csrf.init_app(app)
    idempotency.init_app(app)
    with app.app_context():
        db.create_all()  # a demo; a real app ships migrations (see migrations/)
    app.add_url_rule("/checkout", view_func=checkout_form, methods=["GET"])
    app.add_url_rule("/checkout", view_func=place_order, methods=["POST"])
    app.add_url_rule("/orders/<int:order_id>", view_func=confirmation)
    return app


def checkout_form() -> str:
    session.setdefault("shopper", secrets.token_urlsafe(12))
    return render_template("checkout.html", form=CheckoutForm())


@idempotent(atomic=True)
def place_order() -> Response | tuple[str, int]:
    """One order per rendered form; the order row commits with the stored 303 (C40)."""
    form = CheckoutForm()
    if not form.validate_on_submit() or "shopper" not in session:
        release_claim()  # nothing happened: the shopper may fix the form and resubmit
        return render_template("checkout.html", form=form), 422
    time.sleep(current_app.config["CHECKOUT_LATENCY"])  # the payment provider's round trip
    price = ITEMS[form.item.data][1]
    order = Order(
        shopper=session["shopper"],
        item=form.item.data,
        quantity=form.quantity.data,
        total_cents=price * form.quantity.data,
    )
    db.session.add(order)
    db.session.flush()  # the extension commits it together with the response
    return redirect(url_for("confirmation", order_id=order.id), code=303)


def confirmation(order_id: int) -> str:
    order = db.session.get(Order, order_id)
    if order is None or order.shopper != session.get("shopper"):
        abort(404)
    return render_template("order.html", order=order, item_name=ITEMS[order.item][0])

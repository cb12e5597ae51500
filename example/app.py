"""A payments API: the smallest realistic place where a retried POST must not charge twice.

    flask --app example.app run          # or: make run  (python -m example.serve)

``POST /payments`` needs an ``Idempotency-Key``. Retrying it with the same key
and body replays the first answer (``Idempotent-Replayed: true``) instead of
creating a second payment; the same key with another body is a client bug (422).

The ``X-Account`` header names whose keys these are. It is a stand-in for real
authentication, for the demo only: never trust a client-chosen header as the
scope in production — derive it from the authenticated user.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import time
from pathlib import Path
from typing import Any

from flask import (
    Blueprint,
    Flask,
    Response,
    abort,
    current_app,
    jsonify,
    request,
    url_for,
)
from flask_migrate import Migrate
from werkzeug.exceptions import BadRequest, HTTPException

from flask_idempotency import Idempotency, IdempotencyProblem, idempotent, release_claim

from .models import Payment, db

#: The repository's top-level ``migrations/`` folder, shared with ``flask db``.
MIGRATIONS_DIR = str(Path(__file__).resolve().parent.parent / "migrations")
#: Base of the ``type`` URIs of this API's own problems (RFC 9457).
PROBLEM_BASE = "https://payments.example.com/problems/"
PROBLEM_MIMETYPE = "application/problem+json"

#: Largest amount accepted: keeps the value inside a 32-bit INTEGER column everywhere.
MAX_AMOUNT_CENTS = 100_000_000
MAX_DESCRIPTION_LENGTH = 255
_CURRENCY = re.compile(r"[A-Za-z]{3}")
_ACCOUNT = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")

idempotency = Idempotency(db=db)
migrate = Migrate()
api = Blueprint("payments", __name__)


@idempotency.scope_loader
def account_scope() -> str | None:
    """Keys belong to the ``X-Account`` of the request (demo only: trust your auth, not a header).

    Without the header the extension's default applies: a keyed digest of the
    ``Authorization`` header (keyed by ``SECRET_KEY``), or the shared ``anonymous`` scope.
    """
    account = request.headers.get("X-Account")
    if account is None:
        return None
    if not _ACCOUNT.fullmatch(account):
        raise BadRequest("X-Account must be 1-64 letters, digits, '.', '_' or '-'.")
    return account


# -- configuration ---------------------------------------------------------------------


def _env_config() -> dict[str, Any]:
    """The shorthands hosts hand out: ``DATABASE_URL``, ``REDIS_URL``; and the demo's latency.

    Everything else comes Flask's way, ``FLASK_<KEY>`` (see :func:`create_app`).
    """
    config: dict[str, Any] = {}
    database_url = os.environ.get("DATABASE_URL")
    if database_url:
        config["SQLALCHEMY_DATABASE_URI"] = _normalise_database_url(database_url)
    redis_url = os.environ.get("REDIS_URL")
    if redis_url:
        config["IDEMPOTENCY_REDIS_URL"] = redis_url
    latency = os.environ.get("GATEWAY_LATENCY")
    if latency:
        config["GATEWAY_LATENCY"] = latency
    return config


def _normalise_database_url(url: str) -> str:
    """Accept the ``postgres://`` spelling many hosts hand out (SQLAlchemy wants
    ``postgresql``), and a plain ``mysql://`` or ``mariadb://`` with the driver the
    example installs, PyMySQL (SQLAlchemy would pick mysqlclient, which needs a C
    compiler to install). A plain ``postgresql://`` stays: the example installs both
    drivers SQLAlchemy may pick for it (C51)."""
    if url.startswith("postgres://"):
        return "postgresql+psycopg2://" + url[len("postgres://") :]
    for plain in ("mysql://", "mariadb://"):
        if url.startswith(plain):
            return plain[:-3] + "+pymysql://" + url[len(plain) :]
    return url


def _instance_secret(instance_path: str) -> str:
    """The demo's ``SECRET_KEY`` when none is configured: made once, kept in ``instance/``.

    It keys the digest of an ``Authorization`` scope (C30), so it must be the same in
    every worker and across restarts, or a retry would land in another scope.
    """
    os.makedirs(instance_path, exist_ok=True)
    path = os.path.join(instance_path, "secret_key")
    try:
        with open(path, encoding="ascii") as kept:
            return kept.read().strip()
    except FileNotFoundError:
        pass
    secret = secrets.token_hex(32)
    try:
        with open(path, "x", encoding="ascii") as new:  # the first worker to get here wins
            os.chmod(path, 0o600)
            new.write(secret)
    except FileExistsError:
        with open(path, encoding="ascii") as kept:
            return kept.read().strip()
    return secret


def _gateway_latency(value: Any) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"GATEWAY_LATENCY must be a number of seconds, not {value!r}.") from None
    if not 0 <= seconds <= 60:
        raise ValueError("GATEWAY_LATENCY must be between 0 and 60 seconds.")
    return seconds


def create_app(config: dict[str, Any] | None = None, *, instance_path: str | None = None) -> Flask:
    """Build the payments app. ``config`` wins over the environment, which wins over defaults.

    The environment is read Flask's way: ``FLASK_<KEY>`` becomes ``app.config[KEY]``
    (``FLASK_IDEMPOTENCY_REDIS_URL=redis://…`` turns the Redis tier on, values are
    parsed as JSON where they can be: ``FLASK_IDEMPOTENCY_WAIT=2.5``), plus the
    ``DATABASE_URL`` / ``REDIS_URL`` shorthands hosts hand out.
    """
    app = Flask(__name__, instance_path=instance_path)
    app.config.update(
        GATEWAY_LATENCY=0.0,
        MAX_CONTENT_LENGTH=64 * 1024,  # a payment request is small; Flask answers 413 beyond
    )
    app.config.from_prefixed_env()
    app.config.update(_env_config())
    app.config.update(config or {})
    app.config["GATEWAY_LATENCY"] = _gateway_latency(app.config["GATEWAY_LATENCY"])
    if not app.config.get("SQLALCHEMY_DATABASE_URI"):
        os.makedirs(app.instance_path, exist_ok=True)
        path = os.path.join(app.instance_path, "payments.sqlite3")
        app.config["SQLALCHEMY_DATABASE_URI"] = "sqlite:///" + path
    if app.config["SQLALCHEMY_DATABASE_URI"].startswith("sqlite"):
        # Threads of the dev server write to one file: wait for the lock, don't fail.
        app.config.setdefault("SQLALCHEMY_ENGINE_OPTIONS", {"connect_args": {"timeout": 30}})

    if not app.config.get("SECRET_KEY"):
        app.config["SECRET_KEY"] = _instance_secret(app.instance_path)

    # The extension first: a missing database driver is then named by init_app (C51), not
    # raised as a bare ModuleNotFoundError by db.init_app, which builds the engine at once.
    idempotency.init_app(app)
    db.init_app(app)
    migrate.init_app(app, db, directory=MIGRATIONS_DIR)
    app.register_blueprint(api)
    app.register_error_handler(HTTPException, _problem_for_http_error)
    return app


# -- views -----------------------------------------------------------------------------


@api.post("/payments")
@idempotent(required=True, atomic=True)
def create_payment() -> tuple[Response, int, dict[str, str]] | Response:
    """Charge once per key: validate, call the (simulated) gateway, record the payment.

    ``atomic=True``: the view only flushes; the extension commits the payment row
    together with the stored response, so a crash leaves both or neither (C40).
    """
    charge = parse_charge(_json_body())
    if isinstance(charge, list):
        # Nothing happened yet: give the key back so the client can fix the body and
        # retry with the same key (C19). Without this the 400 would be stored and replayed.
        release_claim()
        return _problem(
            400,
            "invalid-payment",
            "The payment request is invalid",
            "Fix the listed fields and send the request again.",
            errors=charge,
        )
    charge_gateway(charge.amount_cents, charge.currency)
    payment = Payment(
        amount_cents=charge.amount_cents,
        currency=charge.currency,
        description=charge.description,
        status="succeeded",
    )
    db.session.add(payment)
    db.session.flush()  # assigns the id; the extension commits (atomic mode)
    location = url_for("payments.get_payment", payment_id=payment.id)
    return jsonify(payment.to_json()), 201, {"Location": location}


@api.get("/payments")
def list_payments() -> Response:
    """The most recent payments, newest first (at most 100)."""
    payments = db.session.scalars(db.select(Payment).order_by(Payment.id.desc()).limit(100)).all()
    return jsonify({"payments": [p.to_json() for p in payments]})


@api.get("/payments/<int:payment_id>")
def get_payment(payment_id: int) -> Response:
    """One payment, or a 404 problem."""
    payment = db.session.get(Payment, payment_id)
    if payment is None:
        abort(404, description=f"There is no payment {payment_id}.")
    return jsonify(payment.to_json())


def charge_gateway(amount_cents: int, currency: str) -> None:
    """Stand-in for the card network: slow, and the side effect a retry must not repeat.

    It only waits ``GATEWAY_LATENCY`` seconds, long enough to send a duplicate
    while the original is still in flight and watch it wait for the first answer.
    """
    time.sleep(current_app.config["GATEWAY_LATENCY"])


def _json_body() -> Any:
    """The parsed JSON body, or ``None`` when it is absent or unreadable.

    ``get_json(silent=True)`` swallows only ``ValueError``; a body nested deeper
    than Python's recursion limit raises ``RecursionError``, which is still the
    client's bad input (400), not a server error.
    """
    try:
        return request.get_json(silent=True)
    except RecursionError:
        return None


@dataclasses.dataclass(frozen=True)
class ChargeRequest:
    """A validated ``POST /payments`` body."""

    amount_cents: int
    currency: str
    description: str | None


def parse_charge(payload: Any) -> ChargeRequest | list[dict[str, str]]:
    """The charge the body asks for, or the list of what is wrong with it."""
    errors = _validation_errors(payload)
    if errors:
        return errors
    return ChargeRequest(
        amount_cents=payload["amount_cents"],
        currency=payload["currency"].upper(),
        description=payload.get("description"),
    )


def _validation_errors(payload: Any) -> list[dict[str, str]]:
    """Every problem with the body, so the client can fix them all in one go."""
    if not isinstance(payload, dict):
        return [{"field": "", "message": "The body must be a JSON object."}]
    errors: list[dict[str, str]] = []
    amount = payload.get("amount_cents")
    if isinstance(amount, bool) or not isinstance(amount, int):
        errors.append({"field": "amount_cents", "message": "Must be an integer number of cents."})
    elif not 0 < amount <= MAX_AMOUNT_CENTS:
        errors.append(
            {"field": "amount_cents", "message": f"Must be between 1 and {MAX_AMOUNT_CENTS}."}
        )
    currency = payload.get("currency")
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        errors.append({"field": "currency", "message": "Must be a 3-letter code such as EUR."})
    description = payload.get("description")
    if description is not None:
        if not isinstance(description, str):
            errors.append({"field": "description", "message": "Must be a string."})
        elif (
            len(description) > MAX_DESCRIPTION_LENGTH
            or _CONTROL_CHARS.search(description)
            or not _is_encodable(description)
        ):
            errors.append(
                {
                    "field": "description",
                    "message": f"At most {MAX_DESCRIPTION_LENGTH} characters of text,"
                    " no control characters.",
                }
            )
    return errors


def _is_encodable(text: str) -> bool:
    """JSON may carry lone surrogates (``"\\ud800"``); no database can store them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# -- errors as problem+json ------------------------------------------------------------


def _problem(status: int, code: str, title: str, detail: str, **members: Any) -> Response:
    body = {"type": PROBLEM_BASE + code, "title": title, "status": status, "detail": detail}
    body.update(code=code, **members)
    response = jsonify(body)
    response.status_code = status
    response.mimetype = PROBLEM_MIMETYPE
    return response


def _problem_for_http_error(exc: HTTPException) -> Response:
    """Every HTTP error as problem+json; the idempotency layer's own keep their documents."""
    if isinstance(exc, IdempotencyProblem):
        return exc.get_response()
    status = exc.code or 500
    detail = exc.description or exc.name
    if status >= 500:
        detail = "The server could not complete the request. Retry with the same key."
    # "about:blank": nothing to add beyond the HTTP status itself (RFC 9457 §4.2.1).
    response = _problem(
        status, exc.name.lower().replace(" ", "-"), exc.name, detail, type="about:blank"
    )
    for name, value in exc.get_headers():
        if name.lower() != "content-type":
            response.headers[name] = value
    return response

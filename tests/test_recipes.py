"""The recipes in ``recipes/`` run as documented (issue 14, item 3), on the real PostgreSQL.

Each recipe is a complete file the docs show verbatim (``literalinclude``), so a
recipe that stops working fails here, not in a reader's hands.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL

ROOT = Path(__file__).resolve().parent.parent
RECIPES = ROOT / "recipes"

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_config(pg_url: URL, pg_table: str) -> Iterator[dict[str, Any]]:
    """The extension's store on this session's PostgreSQL database, in a table of its own."""
    config = {
        "TESTING": True,
        "IDEMPOTENCY_DATABASE_URI": pg_url.render_as_string(hide_password=False),
        "IDEMPOTENCY_TABLE": pg_table,
        "IDEMPOTENCY_CREATE_TABLE": True,
    }
    yield config
    engine = create_engine(pg_url)
    with engine.begin() as conn:
        conn.execute(text(f'DROP TABLE IF EXISTS "{pg_table}"'))
    engine.dispose()


@pytest.fixture
def own_database(pg_url: URL) -> Iterator[str]:
    """A database of this test's own: the recipe creates its tables with ``db.create_all()``."""
    name = f"{pg_url.database}_recipe_{uuid.uuid4().hex[:8]}"
    admin = create_engine(pg_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield pg_url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


# -- the quick start -----------------------------------------------------------------


def test_i14_3_quickstart_runs_as_a_users_own_file_c9_c7_c19(tmp_path: Path) -> None:
    """The quick start, copied out of the checkout, replays (C9), refuses another body
    under its key (C7) and frees a released key (C19)."""
    for name in ("quickstart.py", "check_quickstart.py"):
        shutil.copy(RECIPES / name, tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASK_")}
    result = subprocess.run(
        [sys.executable, "check_quickstart.py", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "quick start OK" in result.stdout
    assert (tmp_path / "instance").is_dir(), "the records went to the app's instance folder"


def test_i14_3_readme_quick_start_is_the_tested_recipe() -> None:
    """The README shows recipes/quickstart.py verbatim (its code after the docstring)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    recipe = (RECIPES / "quickstart.py").read_text(encoding="utf-8")
    body = recipe.split('"""', 2)[2].lstrip("\n")
    assert body in blocks, "README.md's quick start differs from recipes/quickstart.py"


# -- app factory + blueprints + Flask-SQLAlchemy + Flask-Login -------------------------


@pytest.fixture
def login_app(own_database: str) -> Iterator[Any]:
    from recipes import factory_login

    app = factory_login.create_app(
        {"TESTING": True, "SQLALCHEMY_DATABASE_URI": own_database, "DEMO_USER": False}
    )
    with app.app_context():
        db = factory_login.db
        db.session.add_all(
            [
                factory_login.User(id=1, name="ada", api_token="token-ada"),
                factory_login.User(id=2, name="bob", api_token="token-bob"),
            ]
        )
        db.session.commit()
    yield app
    with app.app_context():
        factory_login.db.engine.dispose()


def _payments(app: Any) -> list[tuple[int, int]]:
    from recipes import factory_login

    with app.app_context():
        rows = factory_login.db.session.execute(
            text("SELECT user_id, amount_cents FROM payment ORDER BY id")
        )
        return [tuple(row) for row in rows]


def _pay(client: Any, token: str, key: str, amount: Any) -> Any:
    return client.post(
        "/api/payments",
        json={"amount_cents": amount},
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": key},
    )


def test_i14_3_login_scope_c5_two_users_same_key_never_meet(login_app: Any) -> None:
    """Keys are scoped to ``current_user.get_id()``: the same key from two users is two
    payments, and each user's retry replays their own (C5, C9)."""
    client = login_app.test_client()
    ada = _pay(client, "token-ada", "order-1", 500)
    bob = _pay(client, "token-bob", "order-1", 700)
    assert (ada.status_code, bob.status_code) == (201, 201)
    assert ada.json["id"] != bob.json["id"]
    again = _pay(client, "token-ada", "order-1", 500)
    assert again.headers.get("Idempotent-Replayed") == "true"
    assert again.get_data() == ada.get_data()
    assert _payments(login_app) == [(1, 500), (2, 700)]
    location = client.get(ada.headers["Location"], headers={"Authorization": "Bearer token-ada"})
    assert location.json == ada.json


def test_i14_3_login_scope_c8_concurrent_retries_make_one_payment(login_app: Any) -> None:
    """Twelve threads send one user's request with one key at once: one payment row (C8, C40)."""
    results: list[int] = []
    barrier = threading.Barrier(12)

    def send() -> None:
        client = login_app.test_client()
        barrier.wait()
        results.append(_pay(client, "token-bob", "order-42", 1999).status_code)

    threads = [threading.Thread(target=send) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 12 and set(results) <= {201, 409}, results
    assert _payments(login_app) == [(2, 1999)]


def test_i14_3_login_scope_c19_unauthenticated_and_invalid_requests(login_app: Any) -> None:
    """No user: 401 and no payment. An invalid body releases the key (C19), so the
    corrected request may reuse it."""
    client = login_app.test_client()
    anonymous = client.post(
        "/api/payments", json={"amount_cents": 5}, headers={"Idempotency-Key": "a"}
    )
    assert anonymous.status_code == 401
    bad = _pay(client, "token-ada", "order-7", "lots")
    assert bad.status_code == 400
    fixed = _pay(client, "token-ada", "order-7", 300)
    assert fixed.status_code == 201 and "Idempotent-Replayed" not in fixed.headers
    assert _payments(login_app) == [(1, 300)]


# -- Stripe-shaped errors --------------------------------------------------------------


def test_i14_3_stripe_errors_c27_key_reused_and_missing_key(pg_config: dict[str, Any]) -> None:
    """The layer's problems (C27) come out as ``{"error": {...}}`` with their status kept."""
    from recipes import stripe_errors

    client = stripe_errors.create_app(pg_config).test_client()
    first = client.post("/v1/charges", data={"amount": 2000}, headers={"Idempotency-Key": "k1"})
    assert first.status_code == 200 and first.json["amount"] == 2000
    again = client.post("/v1/charges", data={"amount": 2000}, headers={"Idempotency-Key": "k1"})
    assert again.headers["Idempotent-Replayed"] == "true" and again.json == first.json

    reused = client.post("/v1/charges", data={"amount": 1}, headers={"Idempotency-Key": "k1"})
    assert reused.status_code == 422
    assert reused.mimetype == "application/json"
    error = reused.json["error"]
    assert error["type"] == "idempotency_error" and error["code"] == "key_reused"
    assert error["message"] and error["doc_url"].endswith("/key-reused")

    missing = client.post("/v1/charges", data={"amount": 1})
    assert missing.status_code == 400
    assert missing.json["error"]["type"] == "invalid_request_error"
    assert missing.json["error"]["code"] == "missing_key"


def test_i14_3_stripe_errors_c25_store_down_keeps_retry_after() -> None:
    """With the database unreachable the 503 (C25) keeps its Retry-After in the new shape."""
    from recipes import stripe_errors

    app = stripe_errors.create_app(
        {
            "TESTING": True,
            "IDEMPOTENCY_DATABASE_URI": "postgresql+psycopg2://postgres@127.0.0.1:9/x",
        }
    )
    down = app.test_client().post(
        "/v1/charges", data={"amount": 1}, headers={"Idempotency-Key": "k2"}
    )
    assert down.status_code == 503
    assert down.json["error"]["type"] == "api_error"
    assert down.json["error"]["code"] == "store_unavailable"
    assert int(down.headers["Retry-After"]) >= 1


# -- CORS ------------------------------------------------------------------------------

ORIGIN = "https://shop.example"


def _header_names(value: str | None) -> set[str]:
    return {part.strip().lower() for part in (value or "").split(",") if part.strip()}


def test_i14_3_cors_preflight_allows_the_key_header_c1(pg_config: dict[str, Any]) -> None:
    """The preflight allows ``Idempotency-Key``; OPTIONS itself is never processed (C1)."""
    from recipes import cors

    client = cors.create_app(pg_config).test_client()
    preflight = client.options(
        "/orders",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, idempotency-key",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["Access-Control-Allow-Origin"] == ORIGIN
    allowed = _header_names(preflight.headers.get("Access-Control-Allow-Headers"))
    assert {"idempotency-key", "content-type"} <= allowed


def test_i14_3_cors_replay_is_readable_by_the_page_c9(pg_config: dict[str, Any]) -> None:
    """A replay (C9) carries the CORS headers, and ``Idempotent-Replayed`` is exposed."""
    from recipes import cors

    client = cors.create_app(pg_config).test_client()
    headers = {"Origin": ORIGIN, "Idempotency-Key": "cart-9"}
    first = client.post("/orders", json={"items": ["tea"]}, headers=headers)
    replay = client.post("/orders", json={"items": ["tea"]}, headers=headers)
    assert first.status_code == replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    for response in (first, replay):
        assert response.headers["Access-Control-Allow-Origin"] == ORIGIN
        exposed = _header_names(response.headers.get("Access-Control-Expose-Headers"))
        assert {"idempotent-replayed", "retry-after", "location"} <= exposed
    stranger = client.post(
        "/orders", json={"items": ["tea"]}, headers={**headers, "Origin": "https://evil.example"}
    )
    assert "Access-Control-Allow-Origin" not in stranger.headers

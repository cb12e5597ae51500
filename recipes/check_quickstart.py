"""Drive the quick start the way its docs describe, and fail loudly if it misbehaves.

``python check_quickstart.py DIR`` imports ``DIR/quickstart.py`` as a user's own
file (the ``flask_idempotency`` it uses is whatever the running Python has
installed) and sends the documented requests through Flask's test client: a
payment, the same request again (replayed), the same key with another body
(422), an invalid body (400, key released). ``tests/test_recipes.py`` runs it
against the checkout; ``.ci/package_check.py`` against the built wheel.
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(directory: str) -> None:
    sys.path.insert(0, directory)
    import quickstart  # type: ignore[import-not-found]

    import flask_idempotency

    client = quickstart.app.test_client()
    headers = {"Idempotency-Key": "4f1c0a", "X-Account": "acme"}

    first = client.post("/payments", json={"amount_cents": 500}, headers=headers)
    assert first.status_code == 201, first.get_data(as_text=True)
    assert "Idempotent-Replayed" not in first.headers

    again = client.post("/payments", json={"amount_cents": 500}, headers=headers)
    assert again.status_code == 201, again.get_data(as_text=True)
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.get_data() == first.get_data(), "a replay returns the same bytes (C9)"

    other = client.post("/payments", json={"amount_cents": 900}, headers=headers)
    assert other.status_code == 422, other.get_data(as_text=True)
    assert other.json is not None and other.json["code"] == "key-reused"

    missing = client.post("/payments", json={"amount_cents": 500}, headers={"X-Account": "a"})
    assert missing.status_code == 400 and missing.json["code"] == "missing-key"

    invalid_key = {"Idempotency-Key": "k-1", "X-Account": "acme"}
    bad = client.post("/payments", json={"amount_cents": -1}, headers=invalid_key)
    assert bad.status_code == 400, bad.get_data(as_text=True)
    fixed = client.post("/payments", json={"amount_cents": 7}, headers=invalid_key)
    assert fixed.status_code == 201, "the released key may be reused (C19)"

    print(
        f"quick start OK with flask_idempotency {flask_idempotency.__version__}"
        f" from {Path(flask_idempotency.__file__).parent}"
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent))

"""A person reading the API's docs page sees the key header (issue 35 item 5; CONTRACT C64).

Headless Chromium (as in ``tests/test_browser.py``) opens the Swagger UI page that
flask-smorest and APIFlask serve for the recipes' apps, on a threaded Werkzeug
server on a free loopback port, expands "Add a pet" and finds the
``Idempotency-Key`` header parameter (required) and the 409 answer with its
``Retry-After`` header. The machine has no internet, so Swagger UI's own files
come from the ``swagger-ui-bundle`` package, served by the app itself instead of
from a CDN; that bundle is Swagger UI 4, which renders OpenAPI 3.0, so these
pages are built with 3.0.3 (the 3.1 specs are checked in ``test_openapi.py``).
Screenshots go to ``$IDEMPOTENCY_TEST_ARTIFACTS`` (default ``test-artifacts/``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
from flask import Flask, send_from_directory
from werkzeug.serving import make_server

from tests.support.gunicorn import free_port
from tests.support.waiting import wait_until
from tests.test_browser import ARTIFACTS, browser  # noqa: F401 (the fixture)

pytestmark = pytest.mark.slow

ASSETS = "/swagger-ui-assets/"


def _serve_swagger_ui_assets(app: Flask) -> None:
    """Swagger UI's JavaScript and CSS from the swagger-ui-bundle package, not a CDN."""
    from swagger_ui_bundle import swagger_ui_path

    @app.get(ASSETS + "<path:name>")
    def swagger_ui_asset(name: str) -> Any:
        return send_from_directory(str(swagger_ui_path), name)


def _config(tmp_path: Any) -> dict[str, Any]:
    return {
        "OPENAPI_VERSION": "3.0.3",
        "IDEMPOTENCY_DATABASE_URI": f"sqlite:///{tmp_path}/docs.sqlite3",
        "IDEMPOTENCY_CREATE_TABLE": True,
        # flask-smorest: where swagger-ui-bundle.js and swagger-ui.css are
        "OPENAPI_SWAGGER_UI_URL": ASSETS,
        # APIFlask: each file by its URL
        "SWAGGER_UI_CSS": ASSETS + "swagger-ui.css",
        "SWAGGER_UI_BUNDLE_JS": ASSETS + "swagger-ui-bundle.js",
        "SWAGGER_UI_STANDALONE_PRESET_JS": ASSETS + "swagger-ui-standalone-preset.js",
    }


@pytest.fixture(params=["flask-smorest", "APIFlask"])
def docs_server(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[str, str]]:
    if request.param == "flask-smorest":
        from recipes.openapi_smorest import create_app
    else:
        from recipes.openapi_apiflask import create_app  # type: ignore[assignment]
    app = create_app(_config(tmp_path))
    _serve_swagger_ui_assets(app)
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield request.param, f"http://127.0.0.1:{port}"
    finally:
        server.shutdown()
        thread.join(10)


def test_c64_the_swagger_ui_page_shows_the_key_header(
    docs_server: tuple[str, str],
    browser: Any,  # noqa: F811
) -> None:
    from selenium.webdriver.common.by import By

    framework, base = docs_server
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    browser.get(base + "/docs")
    wait_until(
        lambda: browser.find_elements(By.CSS_SELECTOR, ".opblock-post .opblock-summary"),
        "Swagger UI's POST operation",
        within=60,
    )
    browser.find_element(By.CSS_SELECTOR, ".opblock-post .opblock-summary").click()
    wait_until(
        lambda: browser.find_elements(By.CSS_SELECTOR, 'tr[data-param-name="Idempotency-Key"]'),
        "the Idempotency-Key parameter row",
        within=30,
    )
    row = browser.find_element(By.CSS_SELECTOR, 'tr[data-param-name="Idempotency-Key"]')
    assert row.get_attribute("data-param-in") == "header"
    name = row.find_element(By.CSS_SELECTOR, ".parameter__name")
    assert "required" in name.get_attribute("class").split()  # shown as "Idempotency-Key *"
    assert row.text.startswith("Idempotency-Key *") and "(header)" in row.text
    responses = browser.find_element(By.CSS_SELECTOR, ".opblock-post .responses-table").text
    assert "409" in responses and "Retry-After" in responses
    assert "Idempotent-Replayed" in responses and "application/problem+json" in (
        browser.find_element(By.CSS_SELECTOR, ".opblock-post").get_attribute("innerHTML")
    )
    browser.execute_script("arguments[0].scrollIntoView()", row)
    shot = ARTIFACTS / f"c64-{framework.lower().replace('-', '_')}-swagger-ui.png"
    browser.save_screenshot(str(shot))

"""A real browser double-submits the checkout form (C49, with C40 for the order row).

Headless Chromium (Debian's ``chromium`` and ``chromium-driver``), driven by
Selenium, against ``example/forms.py`` served by Werkzeug on a free loopback
port, on the session's PostgreSQL database. The browser double-clicks "Pay",
then goes back and presses "Pay" again: exactly one order row, and each time the
same confirmation page. Screenshots are kept under ``$IDEMPOTENCY_TEST_ARTIFACTS``
(default ``test-artifacts/`` at the repository root).
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text
from werkzeug.serving import make_server

from flask_idempotency import signals
from tests.conftest import service_missing
from tests.support.gunicorn import free_port
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

ARTIFACTS = Path(
    os.environ.get(
        "IDEMPOTENCY_TEST_ARTIFACTS", Path(__file__).resolve().parents[1] / "test-artifacts"
    )
)


def _chromium() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        service_missing("Chromium", "apt-get install -y chromium chromium-driver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        service_missing("selenium", "pip install selenium")
    return str(browser), str(driver)


@pytest.fixture
def checkout_server(pg_url: Any, pg_table: str) -> Iterator[dict[str, Any]]:
    """The example checkout on PostgreSQL, on a threaded Werkzeug server in this process."""
    from example.forms import Order, create_app, db

    url = pg_url.render_as_string(hide_password=False)
    app = create_app(
        {
            "SQLALCHEMY_DATABASE_URI": url,
            "IDEMPOTENCY_TABLE": pg_table,
            "IDEMPOTENCY_CREATE_TABLE": True,
            "CHECKOUT_LATENCY": 1.0,  # the second click lands while the first still runs
            "SECRET_KEY": "browser-test",
        }
    )
    seen: dict[str, list[Any]] = {"posts": [], "executed": [], "replayed": [], "waited": []}

    inner = app.wsgi_app

    def count_posts(environ: dict[str, Any], start_response: Any) -> Any:
        # Outside Flask: every POST that reaches the app counts, replays included.
        if environ["REQUEST_METHOD"] == "POST":
            seen["posts"].append(environ["PATH_INFO"])
        return inner(environ, start_response)

    app.wsgi_app = count_posts  # type: ignore[method-assign]

    for name in ("executed", "replayed", "waited"):
        signal = getattr(signals, f"request_{name}")
        signal.connect(lambda sender, _n=name, **extra: seen[_n].append(extra), app, weak=False)
    with app.app_context():
        db.session.execute(text(f"TRUNCATE {Order.__tablename__}"))
        db.session.commit()
    port = free_port()
    server = make_server("127.0.0.1", port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    engine = create_engine(url)
    try:
        yield {"url": f"http://127.0.0.1:{port}", "seen": seen, "engine": engine}
    finally:
        server.shutdown()
        thread.join(10)
        engine.dispose()
        with app.app_context():
            db.drop_all()
            db.engine.dispose()


@pytest.fixture
def browser() -> Iterator[Any]:
    binary, driver_path = _chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--window-size=900,700",
    ):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def _orders(engine: Any) -> list[tuple[Any, ...]]:
    with engine.connect() as conn:
        return [
            tuple(r) for r in conn.execute(text("SELECT id, item, quantity FROM checkout_orders"))
        ]


def test_c49_browser_double_click_and_back_resubmit_place_one_order(
    checkout_server: dict[str, Any], browser: Any
) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    base, seen, engine = checkout_server["url"], checkout_server["seen"], checkout_server["engine"]
    ARTIFACTS.mkdir(parents=True, exist_ok=True)

    browser.get(base + "/checkout")
    key = browser.find_element(By.NAME, "_idempotency_key").get_attribute("value")
    browser.find_element(By.NAME, "quantity").clear()
    browser.find_element(By.NAME, "quantity").send_keys("2")
    browser.save_screenshot(str(ARTIFACTS / "c49-1-checkout.png"))

    # 1. Double click "Pay": two real clicks, the second while the first POST still runs.
    # (Clicks a few ms apart let Chromium drop the first submission before it is sent;
    # 0.3 s apart, as an impatient person's clicks land, both POSTs reach the server.)
    pay = browser.find_element(By.ID, "pay")
    ActionChains(browser).move_to_element(pay).click().pause(0.3).click().perform()
    wait_until(lambda: "/orders/" in browser.current_url, "the confirmation page", within=30)
    wait_until(
        lambda: browser.find_elements(By.ID, "confirmed"), "the confirmation heading", within=30
    )
    confirmation_url = browser.current_url
    heading = browser.find_element(By.ID, "confirmed").text
    browser.save_screenshot(str(ARTIFACTS / "c49-2-confirmation-after-double-click.png"))
    assert seen["posts"] == ["/checkout"] * 2, f"the browser sent {seen['posts']}"

    # 2. Back to the form the browser kept (same key), then "Pay" again.
    browser.back()
    wait_until(lambda: browser.current_url.endswith("/checkout"), "the form again", within=30)
    assert browser.find_element(By.NAME, "_idempotency_key").get_attribute("value") == key
    browser.find_element(By.ID, "pay").click()
    wait_until(lambda: "/orders/" in browser.current_url, "the confirmation again", within=30)
    wait_until(lambda: browser.find_elements(By.ID, "confirmed"), "the heading again", within=30)
    browser.save_screenshot(str(ARTIFACTS / "c49-3-confirmation-after-back-and-resubmit.png"))

    assert browser.current_url == confirmation_url
    assert browser.find_element(By.ID, "confirmed").text == heading
    assert seen["posts"] == ["/checkout"] * 3
    assert len(seen["executed"]) == 1
    assert len(seen["replayed"]) == 2, seen["replayed"]
    orders = _orders(engine)
    assert len(orders) == 1, orders
    assert orders[0][1:] == ("tea", 2)
    assert heading == f"Order #{orders[0][0]} confirmed"

    # 3. A new rendering of the form is a new submission: a second order.
    browser.get(base + "/checkout")
    assert browser.find_element(By.NAME, "_idempotency_key").get_attribute("value") != key
    browser.find_element(By.ID, "pay").click()
    wait_until(
        lambda: "/orders/" in browser.current_url and browser.current_url != confirmation_url,
        "a second confirmation",
        within=30,
    )
    time.sleep(0.1)
    assert len(_orders(engine)) == 2

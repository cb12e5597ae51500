import threading

from flask import jsonify

from flask_idempotency import idempotent


def test_c8_pg_threads_smoke(make_pg_app):
    app, _ = make_pg_app({"IDEMPOTENCY_WAIT": 5})
    calls = []
    gate = threading.Event()

    @app.post("/pay")
    @idempotent
    def pay():
        calls.append(1)
        gate.wait(0.3)
        return jsonify(n=len(calls)), 201

    results = []
    barrier = threading.Barrier(50)

    def hit():
        client = app.test_client()
        barrier.wait()
        r = client.post("/pay", json={"a": 1}, headers={"Idempotency-Key": "k"})
        results.append((r.status_code, r.headers.get("Idempotent-Replayed"), r.data))

    threads = [threading.Thread(target=hit) for _ in range(50)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(calls) == 1
    from collections import Counter

    print(Counter((s, h) for s, h, _ in results))

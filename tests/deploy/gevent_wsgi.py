"""The recommended gevent entry point: patch first, then import the app.

``gevent.monkey.patch_all()`` at the very top of the wsgi module, before Flask,
SQLAlchemy, redis or the extension are imported, so every lock, socket and
thread they make is gevent's, also under ``gunicorn -k gevent --preload``
where the master imports this module before any worker exists.
"""

from gevent import monkey

monkey.patch_all()

from tests.deploy.wsgi import application  # noqa: E402

__all__ = ["application"]

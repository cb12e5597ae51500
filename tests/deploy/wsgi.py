"""The wsgi module of the matrix app: built at import, warmed up when told to.

Under ``--preload`` gunicorn's master imports this module, so ``DEPLOY_WARMUP=1``
sends a request through the extension in the master before any worker is forked.
"""

import os

from tests.deploy.matrixapp import create_app, warm_up

application = create_app()
if os.environ.get("DEPLOY_WARMUP") == "1":
    warm_up(application)

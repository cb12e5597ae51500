"""Complete, runnable recipes; each is tested by ``tests/test_recipes.py`` and shown in the docs."""

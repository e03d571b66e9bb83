"""compat/: differential suites, the real fairscale / torch class against oss_plus's adapter.

The ``pool`` fixture comes from the root ``conftest.py`` (one pool for tests/ and compat/).
"""

"""Side-by-side benchmarks of oss_plus against fairscale OSS, torch ZeRO and references.

Run them with ``python -m oss_plus bench`` (see :mod:`benchmarks.cli`); never imported by
``oss_plus`` itself and never asserted on in tests beyond a smoke run.
"""

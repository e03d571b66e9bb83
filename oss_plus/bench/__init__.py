"""Side-by-side benchmarks of oss_plus against fairscale OSS, torch ZeRO and references.

Shipped in the wheel, so ``oss-plus bench`` (``python -m oss_plus bench``, see
:mod:`oss_plus.bench.cli`) works wherever oss_plus is installed. Rows whose package is not
installed (fairscale) are skipped with a note. Never imported by ``oss_plus`` itself; the
tests run it in tiny configurations only (speed targets are never asserted in tests).
"""

"""Runtime helpers (internal): process-group helpers and the one error-agreement phase
(``dist``), arrival checks (``arrival``), exit handling (``exit``), local launches
(``launch``), profiler labels (``trace``).
"""

"""Main copies (internal): the exact values of what a rank sends on a compressed wire
(``region``: one region; ``copies``: a rank's set; ``step``: stepping them in place of the
params). See ``docs/amp.md``.
"""

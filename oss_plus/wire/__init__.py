"""The parameter sync (internal): bucket layouts, the transfer of their bytes, the transport
choice, what a step checks before it reuses a layout (``changes``), transfers in flight, the
step status that travels with them, and the fp32 main copies of a compressed wire
(``wire.main``). See ``docs/design.md``.
"""

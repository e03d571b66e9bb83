"""The cross-param probe's parts (:mod:`oss_plus.step.coupling` decides with them): ``trace``
(where every value of a step comes from), ``numbers`` (host numbers that keep their origins),
``ops`` (what the trace needs of an aten op), ``runs`` (the optimizer stepped over copies of
two params), ``modes`` (the dispatch and function modes a trace runs under) and ``verdict``
(the two witnesses, and what they found in words)."""

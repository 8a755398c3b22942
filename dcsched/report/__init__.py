"""Stage 4, the report: before and after figures of each algorithm, and the formats that render them.

:mod:`~dcsched.report.compare` builds the comparison as plain data,
:mod:`~dcsched.report.sweep` the memory / step-time trade-off,
:mod:`~dcsched.report.formats` the table, JSON, trace, plot and sweep renderings
(with :mod:`~dcsched.report.chrome_trace` and :mod:`~dcsched.report.plot_memory`
doing the drawing).
"""

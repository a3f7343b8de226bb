"""Renderers of a finished :class:`~rlprof.analysis.report.Report`: they only format (pyinstrument's shape).

:mod:`.sections` turns the report into titled tables and lines once; :mod:`.console` (rich), :mod:`.markdown` and
:mod:`.html` (self-contained, with plotly charts) print those; :mod:`.jsonout` writes the documented JSON.
"""

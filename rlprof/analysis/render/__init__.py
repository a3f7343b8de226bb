"""Renderers: they only format (pyinstrument's shape).

Each result has one layout module that builds its :class:`~rlprof.analysis.document.Document` (sections of lines
and tables, the data, the charts): :mod:`.report_layout`, :mod:`.compare_layout`, :mod:`.bench_layout`,
:mod:`.memory_layout`. Every renderer takes a document: :mod:`.console` (rich), :mod:`.markdown`, :mod:`.jsonout`
(the documented JSON) and :mod:`.html` (self-contained, plotly charts inlined). ``--format`` finds its renderer in
:mod:`.registry` (by name, or your own by import path).
"""
